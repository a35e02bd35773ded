// LoRA as PEFT does it: identity at init, PEFT names, frozen base, adapter round trip,
// merge equal to the unmerged forward, merged HF directory in the original dtype.
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/linear.h"
#include "replica/models/lora.h"

#include "replica/core/error.h"
#include "replica/models/tests/test_util.h"
#include "replica/io/safetensors.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace replica::models;
using namespace replica::models::testing;

namespace {


// Gives every lora_B random values so the adapters change the output.
void randomize_lora_b(torch::nn::Module& model, double std = 0.05) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    if (item.key().find(".lora_B.") != std::string::npos) item.value().normal_(0.0, std);
  }
}

const std::vector<std::string> kLinears = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.o_proj", "mlp.gate_proj",   "mlp.up_proj",
                                           "mlp.down_proj"};

}  // namespace

TEST(Lora, FreshAdapterIsTheIdentityAndNamesArePefts) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  auto model = load_hf_model(fixture("llama3_gqa"));  // untied: lm_head is a linear layer
  model->eval();
  auto ids = torch::randint(0, 96, {2, 10}, torch::kInt64);
  auto base = model->forward(ids);

  LoraConfig config;  // r 16, alpha 32, dropout 0.05, all-linear
  config.r = 4;
  auto adapted = apply_lora(*model, config);
  EXPECT_EQ(adapted.size(), 2u * 7u);
  EXPECT_TRUE(torch::equal(model->forward(ids), base));  // lora_B = 0

  // PEFT's adapter_model.safetensors keys, in model order; never lm_head.
  std::vector<std::string> expected;
  for (int layer = 0; layer < 2; ++layer) {
    for (const auto& l : kLinears) {
      for (const char* ab : {"lora_A", "lora_B"}) {
        expected.push_back("base_model.model.model.layers." + std::to_string(layer) + "." + l + "." + ab + ".weight");
      }
    }
  }
  std::vector<std::string> names;
  for (const auto& [name, t] : lora_state_dict(*model)) names.push_back(name);
  EXPECT_EQ(names, expected);
  EXPECT_EQ(config.target_modules, (std::vector<std::string>{"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                             "up_proj", "v_proj"}));
  EXPECT_FALSE(model->lm_head->has_lora());

  // Shapes and init: A [r, in] kaiming-uniform(a = sqrt 5) -> |A| <= 1/sqrt(in); B [out, r] zeros.
  auto q = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->q_proj;
  auto k = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->k_proj;
  EXPECT_EQ(q->lora_A->weight.sizes(), (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(k->lora_B->weight.sizes(), (std::vector<int64_t>{16, 4}));
  EXPECT_LE(q->lora_A->weight.abs().max().item<double>(), 1.0 / std::sqrt(32.0));
  EXPECT_GT(q->lora_A->weight.abs().max().item<double>(), 0.5 / std::sqrt(32.0));
  EXPECT_EQ(q->lora_B->weight.abs().max().item<double>(), 0.0);
  EXPECT_EQ(q->lora_A->weight.scalar_type(), torch::kFloat32);
  EXPECT_DOUBLE_EQ(q->lora_scaling(), 32.0 / 4.0);
}

TEST(Lora, OnlyAdapterWeightsTrain) {
  torch::manual_seed(1);
  auto model = load_hf_model(fixture("qwen2"));
  LoraConfig config;
  config.r = 2;
  config.lora_dropout = 0.0;
  apply_lora(*model, config);
  int64_t trainable = 0;
  for (const auto& item : model->named_parameters()) {
    const bool is_lora = item.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(item.value().requires_grad(), is_lora) << item.key();
    if (item.value().requires_grad()) trainable += item.value().numel();
  }
  // Per layer: q 2*(32+32), k 2*(32+8), v 2*(32+8), o 2*(32+32), gate/up 2*(32+64), down 2*(64+32).
  EXPECT_EQ(trainable, 2 * (128 + 80 + 80 + 128 + 3 * 192));
  EXPECT_EQ(lora_named_parameters(*model).size(), 2u * 7u * 2u);

  auto ids = torch::randint(0, 96, {2, 8}, torch::kInt64);
  causal_lm_loss(model->forward(ids), ids).backward();
  for (const auto& item : model->named_parameters()) {
    if (item.key().find(".lora_B.") != std::string::npos) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_GT(item.value().grad().abs().sum().item<double>(), 0.0) << item.key();
    } else if (!item.value().requires_grad()) {
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
    }
  }
}

TEST(Lora, DropoutIsOnTheAdapterPathOnly) {
  torch::manual_seed(2);
  LoraLinear layer(16, 8, /*bias=*/true);
  layer->add_lora(4, 2.0, /*dropout=*/0.5);
  layer->train();
  auto x = torch::randn({3, 16});
  auto base = replica::models::linear(x, layer->weight, layer->bias);  // the base layer's own product
  // B = 0: training-mode output is exactly the base output, dropout or not.
  EXPECT_TRUE(torch::equal(layer->forward(x), base));
  { torch::NoGradGuard g; layer->lora_B->weight.normal_(0.0, 0.1); }
  auto a = layer->forward(x), b = layer->forward(x);
  EXPECT_FALSE(torch::equal(a, b));  // the adapter path is dropped out at random
  layer->eval();
  auto expected = base + torch::linear(torch::linear(x, layer->lora_A->weight), layer->lora_B->weight) * 2.0;
  EXPECT_LE(max_abs_diff(layer->forward(x), expected), 1e-6);
}

// Note [LoRA's input path keeps a mask, not copies] (lora.cpp): the adapter branch saves x and a
// one-byte mask instead of PEFT's noise and dropped copy; it must draw the same mask as ATen's
// dropout and give PEFT's branch's output and gradients, in fp32 and under bf16 autocast over a
// bf16 base, with and without dropout.
TEST(Lora, AdapterBranchComputesPeftsDropoutBranchForwardAndBackward) {
  for_each_bf16_gemm_path([] {
  for (const bool bf16 : {false, true}) {
    for (const double p : {0.0, 0.3}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16 autocast" : "fp32") + " p=" + std::to_string(p));
      torch::manual_seed(4);
      LoraLinear layer(24, 40, /*bias=*/true, bf16 ? torch::kBFloat16 : torch::kFloat32);
      layer->add_lora(4, 2.0, p);
      { torch::NoGradGuard g; layer->lora_B->weight.normal_(0.0, 0.1); }
      layer->train();
      auto x0 = torch::randn({2, 5, 24}).to(bf16 ? torch::kBFloat16 : torch::kFloat32);
      auto weigh = torch::randn({2, 5, 40});  // a loss that weighs every output differently
      struct Pass {
        torch::Tensor out, gx, ga, gb;
      };
      auto run = [&](bool peft) {
        layer->zero_grad();
        auto x = x0.clone().requires_grad_(true);
        at::autocast::set_autocast_enabled(torch::kCPU, bf16);
        if (bf16) at::autocast::set_autocast_dtype(torch::kCPU, torch::kBFloat16);
        torch::manual_seed(9);
        torch::Tensor out;
        if (peft) {  // peft/tuners/lora/layer.py Linear.forward, through ATen's own ops
          auto h = torch::dropout(x.to(torch::kFloat32), p, /*train=*/true);
          auto branch = torch::linear(torch::linear(h, layer->lora_A->weight), layer->lora_B->weight) * 2.0;
          auto base = replica::models::linear(x, layer->weight, layer->bias);
          out = (base + branch).to(base.scalar_type());
        } else {
          out = layer->forward(x);
        }
        at::autocast::set_autocast_enabled(torch::kCPU, false);
        at::autocast::clear_cache();
        (out.to(torch::kFloat32) * weigh).sum().backward();
        return Pass{out.detach(), x.grad(), layer->lora_A->weight.grad().clone(), layer->lora_B->weight.grad().clone()};
      };
      const auto ours = run(false), peft = run(true);
      // fp32: float rounding (another GEMM); bf16: the same bf16 products, within a bf16 ulp. Another
      // mask than ATen's dropout draws would move the output by the branch's size, far beyond either.
      const double tol = bf16 ? 1e-2 : 1e-5;
      auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        return max_abs_diff(a.to(torch::kFloat32), b.to(torch::kFloat32)) /
               std::max(1e-12, b.to(torch::kFloat32).abs().max().item<double>());
      };
      EXPECT_LE(rel(ours.out, peft.out), tol);
      EXPECT_LE(rel(ours.gx, peft.gx), tol);
      EXPECT_LE(rel(ours.ga, peft.ga), tol);
      EXPECT_LE(rel(ours.gb, peft.gb), tol);
    }
  }
  });
}

TEST(Lora, TargetModulesSelectLayers) {
  LlamaForCausalLM model(load_hf_model(fixture("mistral")));
  LoraConfig config;
  config.target_modules = {"q_proj", "v_proj"};
  auto adapted = apply_lora(*model, config);
  EXPECT_EQ(adapted, (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                               "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  expect_error([&] { apply_lora(*model, config); }, {"already has adapters"});

  auto fresh = [] { return load_hf_model(fixture("mistral")); };
  auto m1 = fresh();
  LoraConfig bad;
  bad.target_modules = {"q_proj", "qv_proj"};
  expect_error([&] { apply_lora(*m1, bad); }, {"'qv_proj' not found"});
  bad.target_modules = {"lm_head"};
  expect_error([&] { apply_lora(*m1, bad); }, {"lm_head"});
  bad.target_modules = {"embed_tokens"};
  expect_error([&] { apply_lora(*m1, bad); }, {"'embed_tokens'", "not a linear layer"});
  bad.target_modules = {"q_proj"};
  bad.r = 0;
  expect_error([&] { apply_lora(*m1, bad); }, {"r must be at least 1"});
  // A PEFT regex string: full match on module names.
  LoraConfig regex;
  regex.target_modules = {R"(.*layers\.1\.mlp\.(up|down)_proj)"};
  regex.target_modules_is_regex = true;
  EXPECT_EQ(apply_lora(*m1, regex).size(), 2u);
}

TEST(Lora, AdapterSaveLoadRoundTripAndPeftConfig) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(4);
  TempDir tmp("adapter");
  auto model = load_hf_model(fixture("qwen3"));
  model->eval();
  LoraConfig config;
  config.r = 8;
  config.lora_alpha = 16;
  config.base_model_name_or_path = "Qwen/Qwen3-tiny";
  apply_lora(*model, config);
  randomize_lora_b(*model);
  auto ids = torch::randint(0, 96, {2, 10}, torch::kInt64);
  auto with_lora = model->forward(ids);
  save_adapter(*model, config, tmp.str("adapter"));

  auto cfg = json::parse(read_text(tmp.path / "adapter" / "adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfg["r"], 8);
  EXPECT_EQ(cfg["lora_alpha"], 16);
  EXPECT_DOUBLE_EQ(cfg["lora_dropout"].get<double>(), 0.05);
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["fan_in_fan_out"], false);
  EXPECT_EQ(cfg["inference_mode"], true);
  EXPECT_EQ(cfg["use_rslora"], false);
  EXPECT_EQ(cfg["use_dora"], false);
  EXPECT_EQ(cfg["base_model_name_or_path"], "Qwen/Qwen3-tiny");
  EXPECT_EQ(cfg["target_modules"], json({"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}));
  auto file = replica::io::load_safetensors(tmp.str("adapter/adapter_model.safetensors"));
  EXPECT_EQ(file.tensors.size(), 2u * 7u * 2u);
  EXPECT_TRUE(file.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(file.contains("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));

  auto other = load_hf_model(fixture("qwen3"));
  other->eval();
  auto loaded = load_adapter(*other, tmp.str("adapter"));
  EXPECT_EQ(loaded.r, 8);
  EXPECT_DOUBLE_EQ(loaded.scaling(), 2.0);
  EXPECT_TRUE(torch::equal(other->forward(ids), with_lora));
  for (const auto& item : other->named_parameters()) {
    EXPECT_EQ(item.value().requires_grad(), item.key().find(".lora_") != std::string::npos) << item.key();
  }

  // PEFT's in-memory spelling (adapter name "default") is accepted too.
  replica::io::NamedTensors renamed;
  for (const auto& [k, t] : file.tensors) {
    std::string n = k;
    n.replace(n.find(".weight"), 7, ".default.weight");
    renamed.emplace_back(n, t);
  }
  load_lora_state_dict(*other, renamed);
  // Missing and extra tensors are named.
  auto partial = file.tensors;
  partial.pop_back();
  expect_error([&] { load_lora_state_dict(*other, partial, "x.safetensors"); },
               {"x.safetensors", "model.layers.1.mlp.down_proj.lora_B.weight", "missing"});
}

TEST(Lora, UnsupportedAdapterConfigsAreNamed) {
  TempDir tmp("badadapter");
  auto model = load_hf_model(fixture("mistral"));
  LoraConfig config;
  config.r = 2;
  apply_lora(*model, config);
  save_adapter(*model, config, tmp.str("a"));
  auto good = json::parse(read_text(tmp.path / "a" / "adapter_config.json"));
  auto try_with = [&](const char* key, json value, const std::string& needle) {
    auto j = good;
    j[key] = value;
    write_text(tmp.path / "a" / "adapter_config.json", j.dump());
    expect_error([&] { read_adapter_config(tmp.str("a")); }, {needle, "adapter_config.json"});
  };
  try_with("peft_type", "IA3", "peft_type");
  try_with("use_dora", true, "use_dora");
  try_with("modules_to_save", json({"lm_head"}), "modules_to_save");
  try_with("bias", "all", "bias");
  try_with("rank_pattern", json({{"q_proj", 4}}), "rank_pattern");
  try_with("task_type", "TOKEN_CLS", "task_type");
  // A reward model's adapter (SEQ_CLS, its score head saved whole) reads, but loads only where a
  // score head takes it (the reward trainer), not into a causal LM.
  {
    auto j = good;
    j["task_type"] = "SEQ_CLS";
    j["modules_to_save"] = json({"classifier", "score"});
    write_text(tmp.path / "a" / "adapter_config.json", j.dump());
    EXPECT_EQ(read_adapter_config(tmp.str("a")).modules_to_save, std::vector<std::string>{"score"});
    auto fresh = load_hf_model(fixture("mistral"));
    expect_error([&] { load_adapter(*fresh, tmp.str("a")); }, {"task_type SEQ_CLS", "adapter_config.json"});
  }
  // PEFT 0.21's variants that compute something else than plain LoRA.
  try_with("alora_invocation_tokens", json({1, 2}), "alora_invocation_tokens");
  try_with("use_qalora", true, "use_qalora");
  try_with("arrow_config", json({{"top_k", 2}}), "arrow_config");
  write_text(tmp.path / "a" / "adapter_config.json", good.dump());
  // rsLoRA: alpha / sqrt(r).
  auto j = good;
  j["use_rslora"] = true;
  write_text(tmp.path / "a" / "adapter_config.json", j.dump());
  EXPECT_DOUBLE_EQ(read_adapter_config(tmp.str("a")).scaling(), 32.0 / std::sqrt(2.0));
}

TEST(Lora, MergeEqualsTheUnmergedForward) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  auto model = load_hf_model(fixture("llama3_gqa"));
  model->eval();
  LoraConfig config;
  config.r = 4;
  apply_lora(*model, config);
  randomize_lora_b(*model);
  auto ids = torch::randint(0, 96, {2, 12}, torch::kInt64);
  auto unmerged = model->forward(ids);
  EXPECT_GT(max_abs_diff(unmerged, load_hf_model(fixture("llama3_gqa"))->forward(ids)), 1e-3);  // adapters matter
  EXPECT_EQ(merge_lora(*model), 14);
  EXPECT_FALSE(has_lora(*model));
  for (const auto& item : model->named_parameters()) EXPECT_EQ(item.key().find(".lora_"), std::string::npos);
  const double d = max_abs_diff(model->forward(ids), unmerged);
  EXPECT_LE(d, 1e-5);
  std::printf("merge: max|merged - unmerged| logits %.3g\n", d);
}

TEST(Lora, MergeAdapterDirWritesAnHfModelInTheOriginalDtype) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(6);
  TempDir tmp("mergedir");
  fs::copy(fixture("llama_tied_bf16_sharded"), tmp.path / "base");
  write_text(tmp.path / "base" / "tokenizer.json", "{\"model\": {}}");
  write_text(tmp.path / "base" / "tokenizer_config.json", "{}");
  write_text(tmp.path / "base" / "special_tokens_map.json", "{}");

  auto model = load_hf_model(tmp.str("base"));  // bf16 weights -> fp32 parameters
  model->eval();
  LoraConfig config;
  config.r = 4;
  apply_lora(*model, config);
  randomize_lora_b(*model);
  save_adapter(*model, config, tmp.str("adapter"));
  auto ids = torch::randint(0, 96, {2, 12}, torch::kInt64);
  auto unmerged = model->forward(ids);
  expect_error([&] { save_hf_model_dir(model, tmp.str("nope"), tmp.str("base")); }, {"LoRA adapters"});

  merge_adapter_dir(tmp.str("base"), tmp.str("adapter"), tmp.str("merged"));
  EXPECT_EQ(read_text(tmp.path / "merged" / "config.json"), read_text(tmp.path / "base" / "config.json"));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_TRUE(fs::exists(tmp.path / "merged" / f)) << f;
  }
  EXPECT_FALSE(fs::exists(tmp.path / "merged" / "model.safetensors.index.json"));
  auto file = replica::io::load_safetensors(tmp.str("merged/model.safetensors"));
  for (const auto& [k, t] : file.tensors) {
    EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << k;
    EXPECT_EQ(k.find("lora"), std::string::npos) << k;
  }
  // Merged weights rounded to bf16: the logits move by about bf16 rounding of the deltas.
  auto merged = load_hf_model(tmp.str("merged"));
  const double d = max_abs_diff(merged->forward(ids), unmerged);
  EXPECT_LE(d, 2e-2);
  // The fp32 merge itself is exact to 1e-5 (same model, merged in memory).
  merge_lora(*model);
  auto exact = model->forward(ids);
  EXPECT_LE(max_abs_diff(exact, unmerged), 1e-5);
  // And the saved bf16 weights are the in-memory merged weights rounded once.
  auto w = file.at("model.layers.0.self_attn.q_proj.weight");
  auto mem = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->q_proj->weight;
  EXPECT_TRUE(torch::equal(w, mem.to(torch::kBFloat16)));
  std::printf("merge-adapter (bf16 checkpoint): max|logits diff| vs unmerged fp32 %.3g\n", d);
}

TEST(Lora, Bf16BaseKeepsFp32AdaptersLikePeft) {
  for_each_bf16_gemm_path([] {
  torch::manual_seed(7);
  auto model = load_hf_model(fixture("qwen2"), torch::kBFloat16);
  LoraConfig config;
  config.r = 2;
  config.lora_dropout = 0.0;
  apply_lora(*model, config);
  randomize_lora_b(*model);
  auto q = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->q_proj;
  EXPECT_EQ(q->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(q->lora_A->weight.scalar_type(), torch::kFloat32);
  auto ids = torch::randint(0, 96, {1, 8}, torch::kInt64);
  auto logits = model->forward(ids);
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  causal_lm_loss(logits, ids).backward();
  ASSERT_TRUE(q->lora_B->weight.grad().defined());
  EXPECT_EQ(q->lora_B->weight.grad().scalar_type(), torch::kFloat32);
  // The LoRA layer output: bf16(base_bf16 + fp32 adapter branch).
  torch::NoGradGuard no_grad;
  auto x = torch::randn({3, 32}).to(torch::kBFloat16);
  auto expected = (torch::linear(x, q->weight, q->bias) +
                   torch::linear(torch::linear(x.to(torch::kFloat32), q->lora_A->weight), q->lora_B->weight) *
                       q->lora_scaling())
                      .to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(q->forward(x), expected));
  });
}
