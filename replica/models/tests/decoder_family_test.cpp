// The decoder families of decoder_family.h without Python: config.json parsing (defaults of
// the Olmo and Gemma 3 config classes, layer_types patterns, a gemma3 checkpoint's text part,
// refusals), parameter names, and sliding windows on packed rows. The numbers against
// transformers are in families_conformance_test.cpp.
#include "replica/models/decoder_family.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"

#include "replica/models/tests/test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <set>
#include <string>

using json = nlohmann::json;
using namespace replica::models;
using namespace replica::models::testing;

namespace {

json olmo3_json() {
  return json::parse(R"({"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "sliding_window": 3, "rope_theta": 10000.0})");
}

json gemma3_json() {
  return json::parse(R"({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3, "query_pre_attn_scalar": 12,
    "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0})");
}

LlamaConfig parse(const json& j) { return parse_llama_config(j.dump(), "family config"); }

std::set<std::string> names_of(torch::nn::Module& m) {
  std::set<std::string> out;
  for (const auto& p : m.named_parameters()) out.insert(p.key());
  return out;
}

// Random weights, norms included (a zero Gemma norm weight would hide the (1 + w)).
void randomize(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& p : m.parameters()) p.copy_(torch::randn_like(p) * 0.3);
}

}  // namespace

TEST(DecoderFamily, Olmo3ConfigHasItsClassDefaultsAndPattern) {
  auto j = olmo3_json();
  const auto c = parse(j);
  EXPECT_EQ(c.norm_style, NormStyle::kWeightBeforeCast);
  EXPECT_EQ(c.block_layout, BlockLayout::kPostNorm);
  EXPECT_EQ(c.qk_norm, QkNorm::kWholeProjection);
  EXPECT_TRUE(c.rope_in_fp32);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.pad_token_id.value_or(-1), 1);  // Olmo3Config's pad_token_id when the file has none
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{50279});
  // No layer_types: Olmo3Config's three sliding layers, then one full.
  EXPECT_EQ(c.sliding_window.value_or(-1), 3);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, true, true, false}));
  EXPECT_FALSE(c.local_rope_theta.has_value());  // no rope_scaling: one rotary for both kinds
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  EXPECT_EQ(parse(j).local_rope_theta.value_or(-1), 10000.0);
  j.erase("sliding_window");
  EXPECT_EQ(parse(j).sliding_window.value_or(-1), 4096);  // Olmo3Config's default
  j["sliding_window"] = nullptr;
  expect_error([&] { parse(j); }, {"sliding_window is null", "family config"});
  j["sliding_window"] = 3;
  j["layer_types"] = {"full_attention", "sliding_attention"};
  expect_error([&] { parse(j); }, {"layer_types lists 2 layers", "num_hidden_layers is 4"});

  // Olmo 2: the same network without sliding windows.
  auto o2 = olmo3_json();
  o2["model_type"] = "olmo2";
  const auto c2 = parse(o2);
  EXPECT_FALSE(c2.sliding_window.has_value());
  EXPECT_EQ(c2.block_layout, BlockLayout::kPostNorm);

  // Parameter names are Olmo3ForCausalLM's: norms after attention and MLP, q/k norm over the
  // whole projection.
  LlamaForCausalLM model(c, torch::kFloat32, /*init=*/false);
  const auto names = names_of(*model);
  EXPECT_TRUE(names.count("model.layers.0.post_attention_layernorm.weight"));
  EXPECT_TRUE(names.count("model.layers.0.post_feedforward_layernorm.weight"));
  EXPECT_FALSE(names.count("model.layers.0.input_layernorm.weight"));
  EXPECT_EQ(model->named_parameters()["model.layers.0.self_attn.q_norm.weight"].sizes(), (std::vector<int64_t>{32}));
  EXPECT_EQ(model->named_parameters()["model.layers.0.self_attn.k_norm.weight"].sizes(), (std::vector<int64_t>{16}));
  EXPECT_TRUE(names.count("lm_head.weight"));
}

TEST(DecoderFamily, Gemma3TextConfigAndItsModel) {
  const auto c = parse(gemma3_json());
  EXPECT_EQ(c.norm_style, NormStyle::kOnePlusWeight);
  EXPECT_EQ(c.block_layout, BlockLayout::kSandwich);
  EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
  EXPECT_EQ(c.activation, Activation::kGeluTanh);
  EXPECT_TRUE(c.scale_embeddings);
  EXPECT_TRUE(c.tie_word_embeddings);  // Gemma3TextConfig's default (save_pretrained leaves it out)
  EXPECT_EQ(c.bos_token_id.value_or(-1), 2);
  EXPECT_EQ(c.pad_token_id.value_or(-1), 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.local_rope_theta.value_or(-1), 100.0);
  EXPECT_DOUBLE_EQ(c.attention_scale(), 1 / std::sqrt(12.0));
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false}));
  EXPECT_FALSE(c.final_logit_softcapping.has_value());

  LlamaForCausalLM model(c);  // init: Gemma's norms start at zero ((1 + w) = 1)
  const auto names = names_of(*model);
  for (const char* n : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm"}) {
    const std::string name = std::string("model.layers.1.") + n + ".weight";
    ASSERT_TRUE(names.count(name)) << name;
    EXPECT_EQ(model->named_parameters()[name].abs().max().item<float>(), 0.0f) << name;
  }
  EXPECT_EQ(model->named_parameters()["model.layers.0.self_attn.q_norm.weight"].sizes(), (std::vector<int64_t>{8}));
  EXPECT_FALSE(names.count("lm_head.weight"));
  // Embeddings scaled by sqrt(hidden_size): the first layer's input is the row times sqrt(32).
  torch::NoGradGuard no_grad;
  const auto ids = torch::tensor({{3, 5}}, torch::kInt64);
  EXPECT_TRUE(torch::allclose(model->model->embed_tokens(ids),
                              model->model->embed_tokens->weight.index_select(0, ids[0]).unsqueeze(0) *
                                  std::sqrt(32.0f)));

  // final_logit_softcapping bounds the logits.
  auto j = gemma3_json();
  j["final_logit_softcapping"] = 0.5;
  LlamaForCausalLM capped(parse(j));
  randomize(*capped, 1);
  EXPECT_LE(capped->forward(torch::randint(0, 64, {1, 6}, torch::kInt64)).abs().max().item<double>(), 0.5);
}

TEST(DecoderFamily, Gemma3CheckpointLoadsItsTextPart) {
  json mm = {{"model_type", "gemma3"},
             {"architectures", {"Gemma3ForConditionalGeneration"}},
             {"torch_dtype", "bfloat16"},
             {"eos_token_id", {1, 106}},
             {"text_config", {{"model_type", "gemma3_text"}, {"hidden_size", 32}, {"intermediate_size", 48},
                              {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 1},
                              {"head_dim", 8}, {"sliding_window", 4}, {"sliding_window_pattern", 3}}},
             {"vision_config", {{"model_type", "siglip_vision_model"}}}};
  const auto c = parse(mm);
  EXPECT_EQ(c.model_type, "gemma3_text");
  EXPECT_EQ(c.wrapper_model_type, "gemma3");
  EXPECT_EQ(c.vocab_size, 262208);  // Gemma3TextConfig's default: the text config lists what differs
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 106}));
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, true, false}));
  // Saved as the text model (Gemma3ForCausalLM), which transformers loads as such.
  const auto saved = json::parse(c.to_json_string());
  EXPECT_EQ(saved["model_type"], "gemma3_text");
  EXPECT_EQ(saved["architectures"][0], "Gemma3ForCausalLM");
  EXPECT_FALSE(saved.contains("vision_config"));
  // Checkpoint names: both layouts of the language model; the vision tower is skipped.
  EXPECT_EQ(text_parameter_name("language_model.model.layers.0.mlp.up_proj.weight", "gemma3"),
            "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(text_parameter_name("model.language_model.norm.weight", "gemma3"), "model.norm.weight");
  EXPECT_EQ(text_parameter_name("language_model.lm_head.weight", "gemma3"), "lm_head.weight");
  EXPECT_EQ(text_parameter_name("vision_tower.vision_model.post_layernorm.weight", "gemma3"), "");
  EXPECT_EQ(text_parameter_name("multi_modal_projector.mm_input_projection_weight", "gemma3"), "");
  EXPECT_EQ(text_parameter_name("model.layers.0.mlp.up_proj.weight", ""), "model.layers.0.mlp.up_proj.weight");
}

TEST(DecoderFamily, UnsupportedSettingsAreNamed) {
  auto j = gemma3_json();
  j["use_bidirectional_attention"] = true;
  expect_error([&] { parse(j); }, {"use_bidirectional_attention", "family config"});
  j = gemma3_json();
  j["attn_logit_softcapping"] = 50.0;
  expect_error([&] { parse(j); }, {"attn_logit_softcapping 50"});
  j = gemma3_json();
  j["hidden_activation"] = "gelu";
  expect_error([&] { parse(j); }, {"hidden_activation 'gelu'"});
  json mm = {{"model_type", "gemma3"}, {"text_config", gemma3_json()}};
  mm["text_config"]["final_logit_softcapping"] = 30.0;
  expect_error([&] { parse(mm); }, {"final_logit_softcapping 30", "Gemma3ForConditionalGeneration"});
  j = olmo3_json();
  j["final_logit_softcapping"] = 30.0;
  expect_error([&] { parse(j); }, {"final_logit_softcapping", "olmo3"});
  j = olmo3_json();
  j["model_type"] = "gemma2";
  expect_error([&] { parse(j); }, {"model_type 'gemma2'", "olmo3", "gemma3_text"});
}

// Packed rows: each sample's logits are those of the sample alone, with the window counted
// inside its sample; and gradients with activation checkpointing equal those without.
class FamilyPacking : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyPacking, SlidingWindowsStayInsideEachSampleAndRecomputeGivesTheSameGradients) {
  auto j = GetParam() == "olmo3" ? olmo3_json() : gemma3_json();
  const auto config = parse(j);
  LlamaForCausalLM model(config);
  randomize(*model, 2);
  model->eval();
  const auto a = torch::randint(1, 64, {1, 6}, torch::kInt64), b = torch::randint(1, 64, {1, 7}, torch::kInt64);
  const auto row = torch::cat({a, b}, 1);
  const auto segments = torch::cat({torch::zeros({1, 6}, torch::kInt64), torch::ones({1, 7}, torch::kInt64)}, 1);
  {
    torch::NoGradGuard no_grad;
    const auto packed = model->forward(row, {}, segments);
    EXPECT_LE(max_abs_diff(packed.narrow(1, 0, 6), model->forward(a)), 1e-5);
    EXPECT_LE(max_abs_diff(packed.narrow(1, 6, 7), model->forward(b)), 1e-5);
  }
  auto grads = [&](bool recompute) {
    model->zero_grad();
    model->model->set_gradient_checkpointing(recompute);
    causal_lm_loss(model->forward(row, {}, segments), row, segments).backward();
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  model->train();
  const auto plain = grads(false), recomputed = grads(true);
  ASSERT_EQ(plain.size(), recomputed.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LE(max_abs_diff(plain[i], recomputed[i]), 1e-6) << i;
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyPacking, ::testing::Values("olmo3", "gemma3"));

TEST(DecoderFamily, FreshConfigsRoundTrip) {
  for (const auto& j : {olmo3_json(), gemma3_json()}) {
    auto c = parse(j);
    c.json_text.clear();
    const auto again = parse_llama_config(c.to_json_string(), "round trip");
    EXPECT_EQ(again.model_type, c.model_type);
    EXPECT_EQ(again.sliding_layers, c.sliding_layers);
    EXPECT_EQ(again.sliding_window, c.sliding_window);
    EXPECT_EQ(again.local_rope_theta, c.local_rope_theta);
    EXPECT_EQ(again.query_pre_attn_scalar, c.query_pre_attn_scalar);
    EXPECT_EQ(again.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(again.activation, c.activation);
    EXPECT_EQ(again.pad_token_id, c.pad_token_id);
    EXPECT_EQ(again.eos_token_ids, c.eos_token_ids);
  }
}

// GPT-OSS's router load-balancing loss: read from config.json, switched by
// set_router_aux_loss (the router_aux_loss_coef key), kept in a fresh config, refused for a
// model without experts; the loss itself is a real term of loss_sum only when on.
TEST(DecoderFamily, RouterLoadBalancingLossSwitches) {
  const json gpt_oss = json::parse(R"({"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"], "rope_scaling": null})");
  auto c = parse(gpt_oss);
  EXPECT_FALSE(c.output_router_logits);  // GptOssConfig's default
  EXPECT_EQ(c.router_aux_loss_coef, 0.9);
  auto j = gpt_oss;
  j["output_router_logits"] = true;
  j["router_aux_loss_coef"] = 0.25;
  c = parse(j);
  EXPECT_TRUE(c.output_router_logits);
  EXPECT_EQ(c.router_aux_loss_coef, 0.25);
  c.json_text.clear();
  const auto again = parse_llama_config(c.to_json_string(), "round trip");
  EXPECT_TRUE(again.output_router_logits);
  EXPECT_EQ(again.router_aux_loss_coef, 0.25);
  j["router_aux_loss_coef"] = -1;
  expect_error([&] { parse(j); }, {"router_aux_loss_coef -1", "family config"});

  torch::manual_seed(3);
  LlamaForCausalLM model(parse(gpt_oss));
  const auto ids = torch::randint(0, 64, {2, 6}, torch::kInt64);
  EXPECT_FALSE(model->loss_sum(ids, ids).aux.defined());
  model->set_router_aux_loss(0.5);
  const auto parts = model->loss_sum(ids, ids);
  ASSERT_TRUE(parts.aux.defined());
  EXPECT_EQ(model->model->router_scores().size(), 2u);  // one [B T, E] per layer
  EXPECT_GT(parts.aux.item<double>(), 0.5 * 1.0);      // about 0.5 x top_k
  // Left-padded rows: pads (segment -1) are not counted, as transformers' attention mask.
  auto segments = torch::zeros({2, 6}, torch::kInt64);
  segments[0].narrow(0, 0, 2).fill_(-1);
  const auto masked = model->loss_sum(ids, ids, segments).aux;
  EXPECT_NE(masked.item<double>(), model->loss_sum(ids, ids).aux.item<double>());
  model->set_router_aux_loss(0);
  EXPECT_FALSE(model->loss_sum(ids, ids).aux.defined());

  LlamaForCausalLM dense(parse(olmo3_json()));
  expect_error([&] { dense->set_router_aux_loss(0.5); }, {"router_aux_loss_coef 0.5", "no mixture-of-experts"});
  EXPECT_NO_THROW(dense->set_router_aux_loss(0));
}
