// Conformance of the decoder families of issue 19 (decoder_family.h) with transformers and
// PEFT (referee/hf_referee.py FAMILY_VARIANTS, referee/families_referee.py, run by the .venv).
//
// transformers makes tiny random Olmo2 / Olmo3 / Gemma3 (text and a multimodal checkpoint)
// models, and Mistral / Qwen2 with sliding windows, from small configs with every feature of
// the family switched on (windows of 8 on sequences of 24, Olmo 3's YaRN on its full layer,
// Gemma 3's local and global rope bases, linear rope_scaling, query_pre_attn_scalar,
// final_logit_softcapping, attention_bias, GQA, tied and untied) and saves them with
// save_pretrained in fp32 and bf16. replica loads each and must give:
//   - logits within 1e-4 of transformers' forward (fp32), the same greedy tokens (generate,
//     with its sliding-window KV cache) and the same loss; bf16 logits within one bf16 ulp of
//     transformers' sdpa path;
//   - the loss and every gradient of one training step within 1e-4 (with and without
//     activation checkpointing);
//   - LoRA: an adapter replica saves loads into PeftModel with replica's logits, and replica's
//     all-linear adapts exactly the modules PEFT's all-linear adapts on that model;
//   - GPT-OSS with output_router_logits (gpt_oss_aux): the load-balancing loss, the loss with
//     router_aux_loss_coef x it, and every gradient (the router's included), with and without
//     checkpointing;
//   - a gemma3 checkpoint: its text part, saved by replica, loads in transformers as
//     Gemma3ForCausalLM with the same logits.
#include "replica/models/tests/hf_conformance.h"
#include "replica/testing/program_runner.h"

#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>

using namespace replica::models;
using namespace replica::models::conformance;
using json = nlohmann::json;

namespace {

constexpr double kFp32Tolerance = 1e-4;
constexpr int64_t kNewTokens = 8;
constexpr int64_t kLength = 24;  // hf_referee.py WINDOW_LENGTH

bool is_bf16(const std::string& variant) { return variant.find("bf16") != std::string::npos; }

// What each variant's config.json must parse to in replica.
void expect_config(const std::string& variant, const LlamaConfig& c) {
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.torch_dtype, is_bf16(variant) ? "bfloat16" : "float32");
  auto slides = [&] {
    std::vector<bool> out;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) out.push_back(c.layer_slides(i));
    return out;
  };
  if (variant == "mistral_window") {
    EXPECT_EQ(slides(), (std::vector<bool>{true, true}));
  } else if (variant == "qwen2_window") {
    EXPECT_EQ(slides(), (std::vector<bool>{false, true, true}));
  } else if (variant == "olmo2" || variant == "olmo2_tied_bf16") {
    EXPECT_EQ(c.model_type, "olmo2");
    EXPECT_EQ(c.qk_norm, QkNorm::kWholeProjection);
    EXPECT_EQ(c.block_layout, BlockLayout::kPostNorm);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.tie_word_embeddings, variant != "olmo2");
  } else if (variant == "olmo3") {
    EXPECT_EQ(slides(), (std::vector<bool>{true, true, true, false}));
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_EQ(c.rope_scaling->rope_type, "yarn");
    EXPECT_EQ(c.local_rope_theta.value_or(-1), 500000.0);
  } else if (variant == "olmo3_bf16") {
    EXPECT_EQ(slides(), (std::vector<bool>{false, true}));
    EXPECT_TRUE(c.qkv_bias && c.o_bias && c.tie_word_embeddings);
  } else if (variant == "gpt_oss" || variant == "gpt_oss_bf16") {
    EXPECT_EQ(c.model_type, "gpt_oss");
    EXPECT_EQ(slides(), (std::vector<bool>{true, false}));
    EXPECT_EQ(c.num_local_experts, 4);
    EXPECT_EQ(c.num_experts_per_tok, 2);
    EXPECT_TRUE(c.attention_sinks && c.qkv_bias && c.o_bias);
    EXPECT_FALSE(c.output_router_logits);
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_EQ(c.rope_scaling->rope_type, "yarn");
    EXPECT_FALSE(c.rope_scaling->truncate);
  } else if (variant == "gpt_oss_aux") {
    EXPECT_EQ(slides(), (std::vector<bool>{true, false, true}));
    EXPECT_EQ(c.num_local_experts, 8);
    EXPECT_EQ(c.num_experts_per_tok, 3);
    EXPECT_TRUE(c.output_router_logits);
    EXPECT_EQ(c.router_aux_loss_coef, 0.5);
  } else if (variant == "gemma3_text" || variant == "gemma3") {
    EXPECT_EQ(c.model_type, "gemma3_text");
    EXPECT_EQ(c.wrapper_model_type, variant == "gemma3" ? "gemma3" : "");
    EXPECT_EQ(slides(), (std::vector<bool>{true, false, true, false}));
    EXPECT_EQ(c.head_dim, 24);
    EXPECT_EQ(c.query_pre_attn_scalar.value_or(-1), 20.0);
    EXPECT_EQ(c.local_rope_theta.value_or(-1), 10000.0);
    EXPECT_EQ(c.rope_theta, 1e6);
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_EQ(c.rope_scaling->rope_type, "linear");
    EXPECT_EQ(c.final_logit_softcapping.value_or(-1), variant == "gemma3" ? -1 : 8.0);
    EXPECT_TRUE(c.tie_word_embeddings && c.qkv_bias);
  } else if (variant == "gemma3_text_bf16") {
    EXPECT_EQ(slides(), (std::vector<bool>{true, false}));
    EXPECT_FALSE(c.tie_word_embeddings);
  } else {
    ADD_FAILURE() << "unknown variant " << variant;
  }
  if (c.sliding_window) EXPECT_EQ(*c.sliding_window, 8);
}

class TransformersFamily : public ::testing::TestWithParam<std::string> {};

bool has_router_loss(const std::string& variant) { return variant == "gpt_oss_aux"; }

// transformers' training loss: the mean over counted targets, plus router_aux_loss_coef x the
// load-balancing loss where the config asks for it (gpt_oss_aux). Through loss_sum, as the
// trainer computes it.
torch::Tensor training_loss(LlamaForCausalLM& model, const torch::Tensor& ids, const torch::Tensor& labels,
                            const std::string& variant) {
  const auto parts = model->loss_sum(ids, labels);
  EXPECT_EQ(parts.aux.defined(), has_router_loss(variant));
  auto loss = parts.sum / parts.count.to(torch::kFloat32);
  return parts.aux.defined() ? loss + parts.aux : loss;
}

std::string make_variant(const std::string& variant, const ScratchDir& dir) {
  const std::string model_dir = dir / "model";
  EXPECT_TRUE(run_referee("hf_referee.py", {"make", "--variant", variant, "--out", model_dir, "--logits",
                                            dir / "reference.safetensors", "--dtype",
                                            is_bf16(variant) ? "float32,bfloat16" : "float32", "--seed", "7"}));
  return model_dir;
}

// LoRA: replica's adapter (all-linear, random A and B) loads into PEFT with replica's logits,
// and all-linear means the same modules on both sides.
void check_peft(const std::string& variant, const ScratchDir& dir, const std::string& model_dir,
                const std::map<std::string, torch::Tensor>& ref) {
  const auto& ids = ref.at("input_ids");
  auto model = load_hf_model(model_dir, torch::kFloat32);
  LoraConfig lora;
  lora.r = 4;
  lora.lora_alpha = 8;
  lora.lora_dropout = 0;
  lora.target_modules = {"all-linear"};
  const auto adapted = apply_lora(*model, lora);
  {
    // B starts at zero, which would hide a wrong name or scaling: random A and B.
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& [name, p] : lora_named_parameters(*model)) p.copy_(torch::randn_like(p) * 0.1);
  }
  const std::string adapter = dir / "adapter";
  save_adapter(*model, lora, adapter);
  model->eval();
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(ids);
  }
  std::string output;
  ASSERT_TRUE(run_referee("families_referee.py", {"peft", "--base", model_dir, "--adapter", adapter, "--ref",
                                                  dir / "reference.safetensors", "--out", dir / "peft.safetensors"},
                          &output));
  const auto line = output.substr(output.rfind("{\"problems\""));
  const auto report = json::parse(line.substr(0, line.find('\n')));
  EXPECT_TRUE(report.at("problems").empty()) << report.at("problems").dump(2);
  const auto peft_logits = load_tensors(dir / "peft.safetensors").at("logits.peft");
  const double d = max_abs_diff(logits, peft_logits);
  EXPECT_LE(d, kFp32Tolerance);
  EXPECT_EQ(argmax_mismatches(logits, peft_logits), 0);
  const double effect = max_abs_diff(logits, ref.at("logits.float32"));
  EXPECT_GT(effect, 1e-2);  // the adapter changes the logits
  const std::set<std::string> ours(adapted.begin(), adapted.end());
  const auto theirs = report.at("all_linear").get<std::set<std::string>>();
  EXPECT_EQ(ours, theirs);
  std::printf("[%s] peft: all-linear adapts %zu modules, the same as PEFT's all-linear (%zu); logits max|diff| "
              "replica vs PeftModel %.3g (the adapter moves them by %.3g)\n",
              variant.c_str(), ours.size(), theirs.size(), d, effect);
}

}  // namespace

// Logits, greedy tokens, loss, and one training step's gradients.
TEST_P(TransformersFamily, LogitsGreedyTokensLossGradientsAndAdaptersAreTransformersAndPeft) {
  REPLICA_REQUIRE_PYTHON("transformers", "peft", "safetensors");
  const std::string variant = GetParam();
  ScratchDir dir("replica-family-" + variant);
  const std::string model_dir = make_variant(variant, dir);
  if (HasFailure()) return;
  const auto ref = load_tensors(dir / "reference.safetensors");
  const auto& ids = ref.at("input_ids");
  ASSERT_EQ(ids.size(1), kLength);
  expect_config(variant, read_hf_config(model_dir));

  auto model = load_hf_model(model_dir, torch::kFloat32);
  model->eval();
  EXPECT_EQ(model->checkpoint_dtype(), is_bf16(variant) ? torch::kBFloat16 : torch::kFloat32);
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(ids);
  }
  const auto& expected = ref.at("logits.float32");
  const double d = expect_logits_match(logits, expected, kFp32Tolerance);
  const auto tokens = greedy(model, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref.at("greedy.float32")))
      << "replica " << tokens << "\ntransformers " << ref.at("greedy.float32");
  const double loss = [&] {
    torch::NoGradGuard no_grad;
    return training_loss(model, ids, ref.at("labels"), variant).item<double>();
  }();
  const double ref_loss = ref.at("loss.float32").item<double>();
  EXPECT_LE(std::fabs(loss - ref_loss), 1e-5 * ref_loss);

  // One training step: the loss and the gradient of every parameter, as transformers'
  // backward gives them; the same with activation checkpointing (each layer recomputed).
  const std::string grads_file = dir / "grads.safetensors";
  ASSERT_TRUE(run_referee("families_referee.py",
                          {"grads", "--model", model_dir, "--ref", dir / "reference.safetensors", "--out", grads_file}));
  const auto hf_grads = load_tensors(grads_file);
  model->train();
  double worst_grad = 0, largest_grad = 0;
  for (const bool recompute : {false, true}) {
    model->zero_grad();
    model->model->set_gradient_checkpointing(recompute);
    const auto train_loss = training_loss(model, ids, ref.at("labels"), variant);
    train_loss.backward();
    EXPECT_LE(std::fabs(train_loss.item<double>() - hf_grads.at("loss").item<double>()), 1e-5 * ref_loss);
    if (has_router_loss(variant)) {
      // The load-balancing loss itself, and that it is a real part of the loss.
      torch::NoGradGuard no_grad;
      const double aux = model->router_aux_loss().item<double>() / model->config().router_aux_loss_coef;
      EXPECT_NEAR(aux, hf_grads.at("aux_loss").item<double>(), 1e-6);
      EXPECT_GT(aux, 0.5);
      if (!recompute) std::printf("[%s] load-balancing loss %.7g vs transformers %.7g\n", variant.c_str(), aux,
                                  hf_grads.at("aux_loss").item<double>());
    }
    int compared = 0;
    for (const auto& item : model->named_parameters()) {
      SCOPED_TRACE(item.key());
      const auto it = hf_grads.find("grad." + item.key());
      ASSERT_NE(it, hf_grads.end()) << "transformers gave no gradient for " << item.key();
      ASSERT_TRUE(item.value().grad().defined());
      const double g = max_abs_diff(item.value().grad(), it->second);
      EXPECT_LE(g, kFp32Tolerance);
      worst_grad = std::max(worst_grad, g);
      largest_grad = std::max(largest_grad, it->second.abs().max().item<double>());
      ++compared;
    }
    // every gradient, plus the loss (and the load-balancing loss)
    EXPECT_EQ(compared + 1 + (has_router_loss(variant) ? 1 : 0), static_cast<int>(hf_grads.size()));
  }
  model->model->set_gradient_checkpointing(false);
  std::printf("[%s] fp32: logits max|diff| %.3g (max|logit| %.3g), greedy %s, loss %.7g vs %.7g; gradients "
              "max|diff| %.3g (max|grad| %.3g) over %zu tensors, with and without recompute\n",
              variant.c_str(), d, expected.abs().max().item<double>(),
              torch::equal(tokens, ref.at("greedy.float32")) ? "equal" : "DIFFER", loss, ref_loss, worst_grad,
              largest_grad, hf_grads.size() - 1 - (has_router_loss(variant) ? 1 : 0));

  if (is_bf16(variant)) {
    // bf16 compute on both sides; replica's attention is transformers' sdpa (Note [attention
    // kernel]); eager rounds the probabilities to bf16 and differs by about an ulp.
    auto model16 = load_hf_model(model_dir, torch::kBFloat16);
    model16->eval();
    torch::NoGradGuard no_grad;
    const auto logits16 = model16->forward(ids);
    EXPECT_EQ(logits16.scalar_type(), torch::kBFloat16);
    const auto& sdpa16 = ref.at("logits.bfloat16");
    const auto& eager16 = ref.at("logits.bfloat16.eager");
    const double scale = sdpa16.abs().max().item<double>();
    const double ulp = scale / 128;
    const double d_sdpa = max_abs_diff(logits16, sdpa16), d_eager = max_abs_diff(logits16, eager16);
    EXPECT_LE(d_sdpa, ulp) << "max|logit| " << scale;
    // Against eager: within transformers' own eager-vs-sdpa gap plus an ulp.
    const double hf_gap = max_abs_diff(eager16, sdpa16);
    EXPECT_LE(d_eager, hf_gap + ulp) << "max|logit| " << scale;
    EXPECT_EQ(clear_argmax_mismatches(logits16, sdpa16, 2 * d_sdpa), 0);
    std::printf("[%s] bf16: logits max|diff| vs transformers sdpa %.3g, eager %.3g (max|logit| %.3g; transformers' "
                "eager vs sdpa %.3g)\n",
                variant.c_str(), d_sdpa, d_eager, scale, hf_gap);
  }

  if (variant == "olmo2" || variant == "olmo3" || variant == "gemma3_text" || variant == "gemma3" ||
      variant == "gpt_oss") {
    check_peft(variant, dir, model_dir, ref);
  }

  if (variant == "gemma3") {
    // The text part saved by replica (a full fine-tune's final/) is a Gemma3ForCausalLM
    // directory transformers loads with the same logits.
    const std::string text_dir = dir / "text_model", text_ref = dir / "text_reference.safetensors";
    save_hf_model_dir(model, text_dir, model_dir);
    ASSERT_TRUE(run_referee("hf_referee.py", {"logits", "--model", text_dir, "--out", text_ref, "--ids",
                                              dir / "reference.safetensors", "--new-tokens", "0"}));
    const auto text = load_tensors(text_ref);
    const double d_text = max_abs_diff(text.at("logits.float32"), expected);
    EXPECT_LE(d_text, kFp32Tolerance);
    const auto saved = json::parse(replica::testing::read_file(fs::path(text_dir) / "config.json"));
    EXPECT_EQ(saved.at("architectures").at(0), "Gemma3ForCausalLM");
    std::printf("[gemma3] the text part saved by replica, in transformers: logits max|diff| %.3g\n", d_text);
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, TransformersFamily,
                         ::testing::Values("mistral_window", "qwen2_window", "olmo2", "olmo2_tied_bf16", "olmo3",
                                           "olmo3_bf16", "gemma3_text", "gemma3_text_bf16", "gemma3", "gpt_oss",
                                           "gpt_oss_aux", "gpt_oss_bf16"));

