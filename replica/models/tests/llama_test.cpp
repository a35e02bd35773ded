// The Llama family against an independent reference (tests/reference/llama_reference.py, a
// plain-PyTorch transcription of transformers' eager code), plus packing, HF directory
// round trips, the embedded tiny model and the errors for unsupported configs.
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"

#include "replica/core/error.h"
#include "replica/models/tests/test_util.h"
#include "replica/io/safetensors.h"

#include <ATen/SDPBackend.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace replica::models;
using namespace replica::models::testing;

namespace {


struct Expected {
  replica::io::SafetensorsFile tensors;
  json values;
};

Expected expected(const std::string& name) {
  return {replica::io::load_safetensors(fixture(name) + "/expected.safetensors"),
          json::parse(read_text(fixture(name) + "/expected.json"))};
}

std::vector<std::vector<int32_t>> samples_of(const json& j) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& s : j["samples"]) out.push_back(s.get<std::vector<int32_t>>());
  return out;
}

std::vector<std::vector<uint8_t>> masks_of(const json& j) {
  std::vector<std::vector<uint8_t>> out;
  for (const auto& s : j["loss_mask"]) out.push_back(s.get<std::vector<uint8_t>>());
  return out;
}

// A small config for the tests that need no fixture.
LlamaConfig tiny_config(const std::string& extra = "") {
  std::string text = R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5)" +
                     extra + "}";
  return parse_llama_config(text, "tiny config");
}

class ReferenceParity : public ::testing::TestWithParam<std::string> {};

}  // namespace

// ---------------------------------------------------------------------------------------
// (a) parity with the reference

TEST_P(ReferenceParity, LogitsAndLossesMatchFp32) {
  torch::NoGradGuard no_grad;
  const std::string name = GetParam();
  auto model = load_hf_model(fixture(name), torch::kFloat32);
  model->eval();
  const auto ex = expected(name);
  const auto& ids = ex.tensors.at("input_ids");

  const double d_logits = max_abs_diff(model->forward(ids), ex.tensors.at("logits"));
  const double d_pos = max_abs_diff(model->forward(ids, ex.tensors.at("position_ids")), ex.tensors.at("logits_pos"));
  EXPECT_LE(d_logits, 1e-4);
  EXPECT_LE(d_pos, 1e-4);

  const double loss = mean_token_loss(model, samples_of(ex.values));
  const auto masks = masks_of(ex.values);
  const double loss_masked = mean_token_loss(model, samples_of(ex.values), &masks);
  const double ref = ex.values["mean_token_loss"].get<double>();
  const double ref_masked = ex.values["mean_token_loss_masked"].get<double>();
  EXPECT_LE(std::fabs(loss - ref) / ref, 1e-4);
  EXPECT_LE(std::fabs(loss_masked - ref_masked) / ref_masked, 1e-4);

  const double batch = causal_lm_loss(model->forward(ids), ex.tensors.at("labels")).item<double>();
  const double ref_batch = ex.values["batch_loss"].get<double>();
  EXPECT_LE(std::fabs(batch - ref_batch) / ref_batch, 1e-4);

  std::printf("[%s] fp32 logits max|diff| %.3g, with position_ids %.3g; mean_token_loss rel %.3g, masked rel %.3g, "
              "batch loss rel %.3g\n",
              name.c_str(), d_logits, d_pos, std::fabs(loss - ref) / ref, std::fabs(loss_masked - ref_masked) / ref_masked,
              std::fabs(batch - ref_batch) / ref_batch);
}

TEST_P(ReferenceParity, LogitsMatchInBf16) {
  // Parameters in bf16: activations bf16, RMSNorm / rotary / softmax in fp32 and cast back,
  // as transformers does. Same libtorch kernels on both sides, so the gap is tiny.
  torch::NoGradGuard no_grad;
  const std::string name = GetParam();
  auto model = load_hf_model(fixture(name), torch::kBFloat16);
  model->eval();
  const auto ex = expected(name);
  auto logits = model->forward(ex.tensors.at("input_ids"));
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  const auto& ref = ex.tensors.at("logits_bf16");
  const double d = max_abs_diff(logits, ref);
  const double scale = ref.abs().max().item<double>();
  // One bf16 ulp of the largest logit is scale / 128.
  EXPECT_LE(d, scale / 64) << "scale " << scale;
  const double d_fp32 = max_abs_diff(logits, ex.tensors.at("logits"));
  std::printf("[%s] bf16 logits max|diff| vs reference bf16 %.3g (vs fp32 reference %.3g, max|logit| %.3g)\n",
              name.c_str(), d, d_fp32, scale);
}

TEST_P(ReferenceParity, ParameterNamesAreTheCheckpointKeys) {
  const std::string name = GetParam();
  auto model = load_hf_model(fixture(name));
  std::set<std::string> file_keys;
  for (const auto& f : hf_weight_files(fixture(name))) {
    for (const auto& [k, t] : replica::io::load_safetensors(f).tensors) file_keys.insert(k);
  }
  std::set<std::string> param_keys;
  for (const auto& item : model->named_parameters()) param_keys.insert(item.key());
  EXPECT_EQ(param_keys, file_keys);
  EXPECT_TRUE(param_keys.count("model.embed_tokens.weight"));
  EXPECT_TRUE(param_keys.count("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_TRUE(param_keys.count("model.layers.0.mlp.down_proj.weight"));
  EXPECT_TRUE(param_keys.count("model.layers.0.post_attention_layernorm.weight"));
  EXPECT_TRUE(param_keys.count("model.norm.weight"));
  EXPECT_EQ(param_keys.count("lm_head.weight"), model->config().tie_word_embeddings ? 0u : 1u);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReferenceParity,
                         ::testing::Values("llama3_gqa", "llama_tied_bf16_sharded", "qwen2", "qwen3", "mistral"));

TEST(LlamaConfig, FixtureConfigsParseAsExpected) {
  auto llama3 = read_hf_config(fixture("llama3_gqa"));
  EXPECT_EQ(llama3.model_type, "llama");
  ASSERT_TRUE(llama3.rope_scaling.has_value());
  EXPECT_EQ(llama3.rope_scaling->original_max_position_embeddings, 256);
  EXPECT_EQ(llama3.num_key_value_groups(), 2);
  auto qwen2 = read_hf_config(fixture("qwen2"));
  EXPECT_TRUE(qwen2.qkv_bias);
  EXPECT_FALSE(qwen2.o_bias);
  EXPECT_FALSE(qwen2.sliding_window.has_value());  // use_sliding_window false
  auto qwen3 = read_hf_config(fixture("qwen3"));
  EXPECT_EQ(qwen3.qk_norm, QkNorm::kPerHead);
  EXPECT_EQ(qwen3.head_dim, 16);
  EXPECT_TRUE(qwen3.tie_word_embeddings);
  auto mistral = read_hf_config(fixture("mistral"));
  EXPECT_EQ(mistral.sliding_window.value_or(-1), 4096);
  auto tied = read_hf_config(fixture("llama_tied_bf16_sharded"));
  EXPECT_EQ(tied.torch_dtype, "bfloat16");
  EXPECT_TRUE(tied.qkv_bias && tied.o_bias && tied.mlp_bias);
  EXPECT_EQ(tied.bos_token_id.value_or(-1), 1);
  EXPECT_EQ(tied.eos_token_ids, std::vector<int64_t>{2});
}

TEST(Llama, Llama3RopeScalingTouchesAllThreeBands) {
  // head_dim 8, theta 500000: wavelengths 6.3, 167, 4.4e3, 1.2e5 against original context
  // 256 (high-frequency cut 64, low-frequency cut 256): kept, smoothed, divided, divided.
  auto config = read_hf_config(fixture("llama3_gqa"));
  RotaryEmbedding scaled(config);
  config.rope_scaling.reset();
  RotaryEmbedding plain(config);
  auto s = scaled.inv_freq(), p = plain.inv_freq();
  EXPECT_EQ(s[0].item<float>(), p[0].item<float>());
  const double smooth = (256.0 / (2 * M_PI / p[1].item<double>()) - 1.0) / 3.0;
  const double smoothed = (1 - smooth) * p[1].item<double>() / 8 + smooth * p[1].item<double>();
  EXPECT_NEAR(s[1].item<double>(), smoothed, 1e-6 * smoothed);  // fp32 rounding
  EXPECT_GT(s[1].item<double>(), 1.5 * p[1].item<double>() / 8);
  EXPECT_LT(s[1].item<double>(), 0.5 * p[1].item<double>());
  EXPECT_NEAR(s[2].item<double>(), p[2].item<double>() / 8, 1e-12);
  EXPECT_NEAR(s[3].item<double>(), p[3].item<double>() / 8, 1e-12);
}

TEST(HfModelDir, ShardedBf16CheckpointLoadsAndRecordsItsDtype) {
  const auto files = hf_weight_files(fixture("llama_tied_bf16_sharded"));
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(fs::path(files[0]).filename(), "model-00001-of-00003.safetensors");
  auto model = load_hf_model(fixture("llama_tied_bf16_sharded"));
  EXPECT_EQ(model->checkpoint_dtype(), torch::kBFloat16);
  EXPECT_EQ(model->model->embed_tokens->weight.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(model->lm_head.is_empty());
}

TEST(HfModelDir, SaveThenLoadIsExactAndCarriesFiles) {
  torch::NoGradGuard no_grad;
  TempDir tmp("save");
  // A source directory with tokenizer files next to the model.
  fs::copy(fixture("llama_tied_bf16_sharded"), tmp.path / "src");
  write_text(tmp.path / "src" / "tokenizer.json", "{\"version\": \"1.0\"}");
  write_text(tmp.path / "src" / "tokenizer_config.json", "{\"chat_template\": \"x\"}");
  write_text(tmp.path / "src" / "generation_config.json", "{\"bos_token_id\": 1}");
  auto model = load_hf_model(tmp.str("src"));
  save_hf_model_dir(model, tmp.str("out"), tmp.str("src"));

  EXPECT_EQ(read_text(tmp.path / "out" / "config.json"), read_text(tmp.path / "src" / "config.json"));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_EQ(read_text(tmp.path / "out" / f), read_text(tmp.path / "src" / f)) << f;
  }
  auto saved = replica::io::load_safetensors(tmp.str("out/model.safetensors"));
  EXPECT_FALSE(saved.contains("lm_head.weight"));  // tied, as save_pretrained writes it
  EXPECT_EQ(saved.metadata.at("format"), "pt");
  for (const auto& [k, t] : saved.tensors) EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << k;

  auto back = load_hf_model(tmp.str("out"));
  auto ids = torch::randint(0, 96, {2, 9}, torch::kInt64);
  EXPECT_TRUE(torch::equal(model->forward(ids), back->forward(ids)));

  // Saving in another dtype rewrites torch_dtype, keeping the other fields.
  save_hf_model_dir(model, tmp.str("out32"), tmp.str("src"), torch::kFloat32);
  auto cfg = json::parse(read_text(tmp.path / "out32" / "config.json"));
  EXPECT_EQ(cfg["torch_dtype"], "float32");
  EXPECT_EQ(cfg["transformers_version"], "4.46.0");
  EXPECT_EQ(replica::io::load_safetensors(tmp.str("out32/model.safetensors")).at("model.norm.weight").scalar_type(),
            torch::kFloat32);
  expect_error([&] { save_hf_model_dir(model, tmp.str("src"), tmp.str("src")); }, {"loaded from"});
}

// ---------------------------------------------------------------------------------------
// (b) packing

TEST(Llama, PackedSamplesMatchEachSampleAlone) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  auto model = load_hf_model(fixture("qwen3"));
  model->eval();
  auto a = torch::randint(0, 96, {1, 5}, torch::kInt64);
  auto b = torch::randint(0, 96, {1, 7}, torch::kInt64);
  auto packed = torch::cat({a, b}, 1);                                                     // [1, 12]
  auto segments = torch::cat({torch::zeros({1, 5}, torch::kInt64), torch::ones({1, 7}, torch::kInt64)}, 1);
  auto logits = model->forward(packed, {}, segments);
  const double da = max_abs_diff(logits.narrow(1, 0, 5), model->forward(a));
  const double db = max_abs_diff(logits.narrow(1, 5, 7), model->forward(b));
  EXPECT_LE(da, 1e-5);
  EXPECT_LE(db, 1e-5);
  // Explicit restarting position ids give the same as derived ones.
  auto positions = torch::cat({torch::arange(5), torch::arange(7)}).unsqueeze(0);
  EXPECT_LE(max_abs_diff(model->forward(packed, positions, segments), logits), 1e-6);
  // Without segments the second sample sees the first one.
  EXPECT_GT(max_abs_diff(model->forward(packed).narrow(1, 5, 7), model->forward(b)), 1e-3);
  std::printf("packing: max|diff| sample A %.3g, sample B %.3g\n", da, db);

  // A batch of two packed rows (one a single sample).
  auto batch = torch::cat({packed, torch::cat({b, a}, 1)}, 0);
  auto seg2 = torch::cat({segments, torch::cat({torch::full({1, 7}, 4, torch::kInt64),
                                                torch::full({1, 5}, 9, torch::kInt64)}, 1)}, 0);
  auto both = model->forward(batch, {}, seg2);
  EXPECT_LE(max_abs_diff(both[1].narrow(0, 7, 5), model->forward(a)[0]), 1e-5);

  // The loss ignores the prediction across the boundary: packed loss = the two alone.
  auto packed_loss = causal_lm_loss_sum(logits, packed, segments);
  auto la = causal_lm_loss_sum(model->forward(a), a);
  auto lb = causal_lm_loss_sum(model->forward(b), b);
  EXPECT_EQ(packed_loss.count.item<int64_t>(), 4 + 6);
  EXPECT_NEAR(packed_loss.sum.item<double>(), la.sum.item<double>() + lb.sum.item<double>(), 1e-4);
}

// Note [grouped-query attention and the math kernel] (llama.cpp): where ATen would send a
// grouped-query call to its math path, the key/value heads are repeated first. On CPU the flash
// kernel takes grouped queries, so the repeat path runs here with ATen's flash kernels turned
// off; it must compute what the grouped call computes, causal and packed, forward and backward.
TEST(Llama, RepeatedKeyValueHeadsComputeWhatGroupedQueryAttentionComputes) {
  torch::manual_seed(5);
  LlamaForCausalLM model(tiny_config());  // 4 query heads over 2 key/value heads
  auto ids = torch::randint(0, 50, {2, 12});
  auto segments = torch::cat({torch::zeros({2, 5}, torch::kInt64), torch::ones({2, 7}, torch::kInt64)}, 1);
  struct Pass {
    torch::Tensor logits;
    std::vector<torch::Tensor> grads;
  };
  auto run = [&](const torch::Tensor& seg) {
    model->zero_grad();
    auto logits = model->forward(ids, {}, seg);
    (logits * logits.detach().sin()).sum().backward();  // a loss that weighs every logit differently
    Pass p{logits.detach().clone(), {}};
    for (const auto& q : model->parameters()) p.grads.push_back(q.grad().clone());
    return p;
  };
  auto& ctx = at::globalContext();
  // The setting back as it was however the test ends (an ASSERT returns early).
  struct RestoreFlash {
    bool was = at::globalContext().userEnabledFlashSDP();
    ~RestoreFlash() { at::globalContext().setSDPUseFlash(was); }
  } restore;
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed segments" : "causal");
    const auto seg = packed ? segments : torch::Tensor();
    ctx.setSDPUseFlash(true);
    const auto grouped = run(seg);
    ctx.setSDPUseFlash(false);
    // The precondition: with the flash kernel off, ATen's choice for a grouped call is math.
    auto q = torch::randn({2, 4, 12, 8}), kv = torch::randn({2, 2, 12, 8});
    ASSERT_EQ(at::_fused_sdp_choice(q, kv, kv, {}, 0.0, true, {}, true), static_cast<int64_t>(at::SDPBackend::math));
    const auto repeated = run(seg);
    ctx.setSDPUseFlash(restore.was);
    EXPECT_LE(max_abs_diff(repeated.logits, grouped.logits), 1e-6);
    ASSERT_EQ(repeated.grads.size(), grouped.grads.size());
    for (size_t i = 0; i < grouped.grads.size(); ++i) {
      EXPECT_LE(max_abs_diff(repeated.grads[i], grouped.grads[i]), 1e-5) << i;
    }
  }
}

TEST(Llama, LossShiftAndIgnoreIndex) {
  // Logits that put all mass on token t+1 give zero loss; -100 labels are skipped.
  const int64_t V = 6;
  auto labels = torch::tensor({{3, 1, 4, 1, 5}}, torch::kInt64);
  auto logits = torch::full({1, 5, V}, -30.0);
  for (int t = 0; t < 4; ++t) logits[0][t][labels[0][t + 1].item<int64_t>()] = 30.0;
  EXPECT_LT(causal_lm_loss(logits, labels).item<double>(), 1e-10);
  auto parts = causal_lm_loss_sum(logits, labels);
  EXPECT_EQ(parts.count.item<int64_t>(), 4);
  logits[0][2].zero_();  // uniform at t = 2 (predicting labels[3])
  auto masked = labels.clone();
  masked[0][3] = -100;
  EXPECT_LT(causal_lm_loss(logits, masked).item<double>(), 1e-10);
  EXPECT_NEAR(causal_lm_loss(logits, labels).item<double>(), std::log(6.0) / 4, 1e-6);
  EXPECT_EQ(causal_lm_loss(logits, torch::full({1, 5}, -100, torch::kInt64)).item<double>(), 0.0);
}

TEST(Llama, GradientsReachEveryParameter) {
  torch::manual_seed(0);
  LlamaForCausalLM model(tiny_config(R"(, "tie_word_embeddings": true)"));
  auto ids = torch::randint(0, 50, {2, 6}, torch::kInt64);
  causal_lm_loss(model->forward(ids), ids).backward();
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_GT(item.value().grad().abs().sum().item<double>(), 0.0) << item.key();
  }
}

// loss_sum (the head and its loss in chunks, no [B, T, V] logits) is causal_lm_loss_sum of
// forward(): the loss, the count and every gradient, tied and untied, packed, chunks that cut
// rows and tokens ignored.
TEST(Llama, ChunkedLossSumEqualsTheLogitsPath) {
  for (const char* extra : {"", R"(, "tie_word_embeddings": true)"}) {
    torch::manual_seed(0);
    LlamaForCausalLM a(tiny_config(extra));
    LlamaForCausalLM b(tiny_config(extra));
    {
      torch::NoGradGuard no_grad;
      auto pa = a->named_parameters();
      for (auto& item : b->named_parameters()) item.value().copy_(pa[item.key()]);
    }
    auto ids = torch::randint(0, 50, {2, 9}, torch::kInt64);
    auto labels = ids.clone();
    labels.index_put_({0, torch::indexing::Slice(0, 3)}, -100);
    auto segments = torch::cat({torch::zeros({2, 4}, torch::kInt64), torch::ones({2, 5}, torch::kInt64)}, 1);
    auto plain = causal_lm_loss_sum(a->forward(ids, {}, segments), labels, segments);
    auto chunked = b->loss_sum(ids, labels, segments, /*chunk_tokens=*/5);
    EXPECT_EQ(chunked.count.item<int64_t>(), plain.count.item<int64_t>()) << extra;
    EXPECT_NEAR(chunked.sum.item<double>(), plain.sum.item<double>(), 1e-5 * plain.sum.item<double>()) << extra;
    plain.sum.backward();
    chunked.sum.backward();
    auto pa = a->named_parameters();
    for (auto& item : b->named_parameters()) {
      EXPECT_LE(max_abs_diff(item.value().grad(), pa[item.key()].grad()), 1e-5) << extra << " " << item.key();
    }
  }
}

TEST(Llama, MeanTokenLossChecksItsInputs) {
  LlamaForCausalLM model(tiny_config());
  model->train();
  std::vector<std::vector<int32_t>> samples = {{1, 2, 3}, {4}};
  std::vector<std::vector<uint8_t>> bad = {{1, 1}, {1}};
  expect_error([&] { mean_token_loss(model, samples, &bad); }, {"sample 0", "loss mask"});
  EXPECT_TRUE(model->is_training());  // restored after the error
  expect_error([&] { mean_token_loss(model, {{1, 50}}); }, {"token id 50", "vocab_size 50"});
  expect_error([&] { mean_token_loss(model, {{7}}); }, {"no token to predict"});
  EXPECT_GT(mean_token_loss(model, samples), 0.0);
  EXPECT_TRUE(model->is_training());
}

// ---------------------------------------------------------------------------------------
// (d) unsupported configs

TEST(LlamaConfig, UnsupportedModelTypeNamesItAndTheFile) {
  TempDir tmp("badtype");
  auto cfg = json::parse(read_text(fixture("mistral") + "/config.json"));
  cfg["model_type"] = "gpt2";
  write_text(tmp.path / "config.json", cfg.dump());
  expect_error([&] { read_hf_config(tmp.str()); }, {"model_type 'gpt2'", (tmp.path / "config.json").string()});
  expect_error([&] { load_hf_model(tmp.str()); }, {"model_type 'gpt2'"});
}

TEST(LlamaConfig, UnsupportedFieldsAreNamed) {
  expect_error([] { tiny_config(R"(, "rope_scaling": {"rope_type": "longrope", "factor": 4.0})"); },
               {"rope_scaling type 'longrope'", "tiny config"});
  expect_error([] { tiny_config(R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"); },
               {"rope_scaling type 'dynamic'"});
  expect_error([] { tiny_config(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0})"); },
               {"low_freq_factor"});
  expect_error([] { tiny_config(R"(, "hidden_act": "gelu")"); }, {"hidden_act 'gelu'"});
  expect_error([] { tiny_config(R"(, "quantization_config": {"bits": 4})"); }, {"quantization_config"});
  expect_error([] { tiny_config(R"(, "architectures": ["LlamaForSequenceClassification"])"); },
               {"LlamaForSequenceClassification"});
  expect_error([] { tiny_config(R"(, "num_key_value_heads": 3)"); }, {"num_key_value_heads 3"});
  expect_error([] { tiny_config(R"(, "torch_dtype": "int8")"); }, {"torch_dtype 'int8'"});
  expect_error([] { parse_llama_config(R"({"model_type": "llama", "vocab_size": 8})", "c.json"); },
               {"hidden_size", "c.json"});
  expect_error([] { tiny_config(R"(, "rms_norm_eps": "small")"); }, {"rms_norm_eps"});
  // A rope_scaling of type "default" (or null) is plain RoPE.
  EXPECT_FALSE(tiny_config(R"(, "rope_scaling": {"rope_type": "default"})").rope_scaling.has_value());
}

// A sliding window shorter than the sequence: with one layer, position t sees exactly the
// sliding_window tokens ending at t, so its logits are those of that slice run alone (RoPE is
// relative: the slice's positions start at 0). Mistral slides on every layer, Qwen2 from
// max_window_layers on (use_sliding_window), null never limits. (decoder_family_test.cpp
// checks packed rows and the Olmo 3 / Gemma 3 patterns; the conformance suite transformers.)
TEST(LlamaConfig, SlidingWindowShorterThanTheSequenceSeesOnlyTheWindow) {
  auto cfg = json::parse(read_text(fixture("mistral") + "/config.json"));
  cfg["sliding_window"] = 4;
  cfg["num_hidden_layers"] = 1;
  const LlamaConfig config = parse_llama_config(cfg.dump(), "m.json");
  ASSERT_EQ(config.sliding_window.value_or(-1), 4);
  EXPECT_TRUE(config.layer_slides(0));
  torch::manual_seed(3);
  LlamaForCausalLM model(config);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto ids = torch::randint(0, config.vocab_size, {2, 12}, torch::kInt64);
  const auto logits = model->forward(ids);
  double worst = 0;
  for (int64_t t = 0; t < 12; ++t) {
    const int64_t start = std::max<int64_t>(0, t - 3);
    const auto alone = model->forward(ids.narrow(1, start, t - start + 1)).select(1, -1);
    worst = std::max(worst, max_abs_diff(logits.select(1, t), alone));
  }
  EXPECT_LE(worst, 1e-5);
  // The window matters: full causal attention differs from position 4 on.
  cfg["sliding_window"] = nullptr;
  LlamaForCausalLM full(parse_llama_config(cfg.dump(), "m.json"));
  EXPECT_FALSE(full->config().sliding_window.has_value());
  auto full_params = full->named_parameters();
  for (const auto& item : model->named_parameters()) full_params[item.key()].copy_(item.value());
  const auto full_logits = full->forward(ids);
  EXPECT_LE(max_abs_diff(full_logits.narrow(1, 0, 4), logits.narrow(1, 0, 4)), 1e-6);
  EXPECT_GT(max_abs_diff(full_logits.narrow(1, 4, 8), logits.narrow(1, 4, 8)), 1e-3);

  // Qwen2: only with use_sliding_window, and only the layers from max_window_layers on.
  auto q = json::parse(read_text(fixture("qwen2") + "/config.json"));
  EXPECT_FALSE(parse_llama_config(q.dump(), "q.json").sliding_window.has_value());
  q["use_sliding_window"] = true;
  q["sliding_window"] = 4;
  q["max_window_layers"] = 1;
  const auto qwen = parse_llama_config(q.dump(), "q.json");
  EXPECT_FALSE(qwen.layer_slides(0));
  EXPECT_TRUE(qwen.layer_slides(1));
  q["max_window_layers"] = 2;  // no layer slides
  EXPECT_FALSE(parse_llama_config(q.dump(), "q.json").sliding_window.has_value());
}

TEST(HfModelDir, BadWeightsAreNamed) {
  TempDir tmp("badweights");
  fs::copy(fixture("qwen2"), tmp.path / "m");
  auto file = replica::io::load_safetensors(tmp.str("m/model.safetensors"));
  auto tensors = file.tensors;
  tensors.emplace_back("model.layers.0.self_attn.rel_bias", torch::zeros({2}));
  replica::io::save_safetensors(tmp.str("m/model.safetensors"), tensors);
  expect_error([&] { load_hf_model(tmp.str("m")); }, {"model.layers.0.self_attn.rel_bias", "model.safetensors"});

  tensors = file.tensors;
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const auto& p) { return p.first == "model.layers.1.self_attn.k_proj.bias"; }),
                tensors.end());
  replica::io::save_safetensors(tmp.str("m/model.safetensors"), tensors);
  expect_error([&] { load_hf_model(tmp.str("m")); }, {"model.layers.1.self_attn.k_proj.bias", "missing"});

  fs::remove(tmp.path / "m" / "model.safetensors");
  write_text(tmp.path / "m" / "pytorch_model.bin", "pickle");
  expect_error([&] { load_hf_model(tmp.str("m")); }, {"pytorch_model.bin", "safetensors"});
}

// ---------------------------------------------------------------------------------------
// The embedded default model

TEST(TinyLlama, WritesALoadableHfDirectory) {
  TempDir tmp("tiny");
  TinyLlamaOptions options;
  options.bos_token_id = 1;
  options.eos_token_ids = {2};
  auto config = make_tiny_llama(tmp.str("m"), 1000, options);
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json"}) {
    EXPECT_TRUE(fs::exists(tmp.path / "m" / f)) << f;
  }
  auto cfg = json::parse(read_text(tmp.path / "m" / "config.json"));
  EXPECT_EQ(cfg["model_type"], "llama");
  EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(cfg["hidden_size"], 256);
  EXPECT_EQ(cfg["num_hidden_layers"], 4);
  EXPECT_EQ(cfg["num_attention_heads"], 8);
  EXPECT_EQ(cfg["num_key_value_heads"], 4);
  EXPECT_EQ(cfg["intermediate_size"], 688);
  EXPECT_EQ(cfg["vocab_size"], 1000);
  EXPECT_EQ(cfg["tie_word_embeddings"], true);
  EXPECT_EQ(cfg["torch_dtype"], "float32");
  EXPECT_EQ(cfg["hidden_act"], "silu");
  auto gen = json::parse(read_text(tmp.path / "m" / "generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], 2);

  auto model = load_hf_model(tmp.str("m"));
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  // layers: 4 * (q 256*256 + k,v 256*128 + o 256*256 + 3 * 256*688 + 2 * 256) + norm 256 + embed
  EXPECT_EQ(count, 4 * (65536 + 2 * 32768 + 65536 + 3 * 176128 + 512) + 256 + 1000 * 256);
  const double std = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->mlp->up_proj->weight.std().item<double>();
  EXPECT_NEAR(std, 0.02, 0.001);
  EXPECT_EQ(model->model->norm->weight.min().item<float>(), 1.0f);

  // Same seed, same bytes.
  make_tiny_llama(tmp.str("again"), 1000, options);
  EXPECT_EQ(read_text(tmp.path / "m" / "model.safetensors"), read_text(tmp.path / "again" / "model.safetensors"));
  torch::NoGradGuard no_grad;
  auto ids = torch::randint(0, 1000, {1, 16}, torch::kInt64);
  auto logits = model->forward(ids);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 16, 1000}));
  EXPECT_NEAR(causal_lm_loss(logits, ids).item<double>(), std::log(1000.0), 0.5);
}
