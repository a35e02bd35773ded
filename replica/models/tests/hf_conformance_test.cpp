// Conformance: replica's Llama family (llama.h, hf_model_dir.h) against Hugging Face
// transformers itself (referee/hf_referee.py, run by the project's .venv).
//
// transformers makes tiny random LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
// MistralForCausalLM models from small configs (GQA, tied and untied embeddings, Qwen2's
// q/k/v bias, Qwen3's q/k norm, rope_theta and llama3 rope_scaling, Mistral's
// sliding_window), writes them with save_pretrained (fp32, and bf16), and records its own
// forward's logits and greedy generate() on random ids. replica loads the same directory and
// must give the logits within 1e-4 (fp32), the same greedy tokens and the same loss.
//
// It also checks the committed fixtures of tests/reference/llama_reference.py (a plain-PyTorch
// transcription of transformers, what replica_models_tests compare against) against
// transformers: the transcription is only as good as its agreement with the real thing.
#include "replica/models/tests/hf_conformance.h"
#include "replica/testing/paths.h"

#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

namespace fs = std::filesystem;
using namespace replica::models;
using namespace replica::models::conformance;

namespace {

constexpr double kFp32Tolerance = 1e-4;
constexpr int64_t kNewTokens = 8;  // hf_referee.py logits --new-tokens default

bool is_bf16(const std::string& variant) { return variant.find("bf16") != std::string::npos; }

// What each variant's config.json must parse to in replica (hf_referee.py VARIANTS).
void expect_config(const std::string& variant, const LlamaConfig& c) {
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.torch_dtype, is_bf16(variant) ? "bfloat16" : "float32");
  if (variant == "llama_gqa") {
    EXPECT_EQ(c.model_type, "llama");
    EXPECT_EQ(c.num_key_value_heads, 2);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_EQ(c.rope_theta, 500000.0);
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 64);
  } else if (variant == "llama_tied_bias") {
    EXPECT_EQ(c.num_key_value_heads, 1);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_TRUE(c.qkv_bias && c.o_bias && c.mlp_bias);
  } else if (variant == "llama_tied_bf16") {
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_TRUE(c.qkv_bias && c.o_bias);
  } else if (variant == "qwen2" || variant == "qwen2_tied_bf16") {
    EXPECT_EQ(c.model_type, "qwen2");
    EXPECT_TRUE(c.qkv_bias);
    EXPECT_FALSE(c.o_bias);
    EXPECT_EQ(c.rope_theta, 1e6);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.tie_word_embeddings, variant != "qwen2");
  } else if (variant == "qwen3") {
    EXPECT_EQ(c.model_type, "qwen3");
    EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
    EXPECT_EQ(c.head_dim, 16);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_FALSE(c.sliding_window.has_value());
  } else if (variant == "qwen3_untied") {
    EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
    EXPECT_EQ(c.num_key_value_heads, 4);
    EXPECT_TRUE(c.qkv_bias && c.o_bias);
    EXPECT_FALSE(c.tie_word_embeddings);
  } else if (variant == "mistral") {
    EXPECT_EQ(c.model_type, "mistral");
    ASSERT_TRUE(c.sliding_window.has_value());
    EXPECT_EQ(*c.sliding_window, 64);
  } else {
    ADD_FAILURE() << "unknown variant " << variant;
  }
}

class TransformersModel : public ::testing::TestWithParam<std::string> {};

}  // namespace

// A model transformers made and saved loads into replica with transformers' logits and
// greedy tokens.
TEST_P(TransformersModel, LoadsWithTransformersLogitsAndGreedyTokens) {
  REPLICA_REQUIRE_PYTHON("transformers", "safetensors");
  const std::string variant = GetParam();
  const bool bf16 = is_bf16(variant);
  ScratchDir dir("replica-hf-" + variant);
  const std::string model_dir = dir / "model", ref_file = dir / "reference.safetensors";
  ASSERT_TRUE(run_referee("hf_referee.py", {"make", "--variant", variant, "--out", model_dir, "--logits", ref_file,
                                            "--dtype", bf16 ? "float32,bfloat16" : "float32", "--seed", "7"}));
  const auto ref = load_tensors(ref_file);
  const auto& ids = ref.at("input_ids");
  expect_config(variant, read_hf_config(model_dir));

  torch::NoGradGuard no_grad;
  auto model = load_hf_model(model_dir, torch::kFloat32);
  model->eval();
  EXPECT_EQ(model->checkpoint_dtype(), bf16 ? torch::kBFloat16 : torch::kFloat32);
  const auto logits = model->forward(ids);
  const auto& expected = ref.at("logits.float32");
  const double d = expect_logits_match(logits, expected, kFp32Tolerance);
  const auto tokens = greedy(model, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref.at("greedy.float32")))
      << "replica " << tokens << "\ntransformers " << ref.at("greedy.float32");
  // The training loss: transformers' ForCausalLMLoss on the same labels.
  const double loss = causal_lm_loss(logits, ref.at("labels")).item<double>();
  const double ref_loss = ref.at("loss.float32").item<double>();
  EXPECT_LE(std::fabs(loss - ref_loss), 1e-5 * ref_loss);
  std::printf("[%s] fp32: logits max|diff| %.3g (max|logit| %.3g), greedy %s, loss %.7g vs %.7g\n", variant.c_str(), d,
              expected.abs().max().item<double>(), torch::equal(tokens, ref.at("greedy.float32")) ? "equal" : "DIFFER",
              loss, ref_loss);

  if (bf16) {
    // bf16 compute on both sides (parameters and activations bf16; RMSNorm and rotary in
    // fp32 and cast back). replica's attention is transformers' default (sdpa; Note [attention
    // kernel] in llama.cpp); transformers' eager path rounds the probabilities to bf16 before
    // multiplying by v and differs from both by ~1 bf16 ulp of the largest logit (enough to
    // flip a near tie).
    auto model16 = load_hf_model(model_dir, torch::kBFloat16);
    model16->eval();
    const auto logits16 = model16->forward(ids);
    EXPECT_EQ(logits16.scalar_type(), torch::kBFloat16);
    const auto& eager16 = ref.at("logits.bfloat16.eager");
    const auto& sdpa16 = ref.at("logits.bfloat16");
    const double scale = sdpa16.abs().max().item<double>();
    const double d_eager = max_abs_diff(logits16, eager16), d_sdpa = max_abs_diff(logits16, sdpa16);
    const double ulp = scale / 128;  // one bf16 ulp at the largest logit (2^-7 relative)
    EXPECT_LE(d_sdpa, ulp) << "max|logit| " << scale;
    EXPECT_LE(d_eager, 2 * ulp) << "max|logit| " << scale;
    // The same argmax as transformers wherever its top two are further apart than the gap.
    const int64_t mismatches = clear_argmax_mismatches(logits16, sdpa16, 2 * d_sdpa);
    EXPECT_EQ(mismatches, 0);
    std::printf("[%s] bf16: logits max|diff| vs transformers eager %.3g, vs sdpa %.3g (max|logit| %.3g; "
                "transformers' eager vs sdpa %.3g, bf16 vs fp32 %.3g); argmax mismatches where sdpa's top-2 gap "
                "exceeds 2 x the diff: %lld, anywhere: %lld\n",
                variant.c_str(), d_eager, d_sdpa, scale, max_abs_diff(eager16, sdpa16), max_abs_diff(sdpa16, expected),
                static_cast<long long>(mismatches), static_cast<long long>(argmax_mismatches(logits16, sdpa16)));
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, TransformersModel,
                         ::testing::Values("llama_gqa", "llama_tied_bias", "llama_tied_bf16", "qwen2",
                                           "qwen2_tied_bf16", "qwen3", "qwen3_untied", "mistral"));

// The fixtures replica_models_tests compare against come from a transcription of
// transformers (tests/reference/llama_reference.py); transformers on the same directories
// gives the fixtures' logits, and so does replica.
TEST(TransformersReferenceFixtures, AgreeWithTransformers) {
  REPLICA_REQUIRE_PYTHON("transformers", "safetensors");
  ScratchDir dir("replica-hf-fixtures");
  const fs::path fixtures = fs::path(REPLICA_SOURCE_DIR) / "replica" / "models" / "tests" / "reference" / "fixtures";
  const std::string out = dir / "transformers.safetensors";
  ASSERT_TRUE(run_referee("hf_referee.py", {"fixtures", "--dir", fixtures.string(), "--out", out}));
  const auto hf = load_tensors(out);
  int checked = 0;
  torch::NoGradGuard no_grad;
  for (const auto& entry : fs::directory_iterator(fixtures)) {
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    const auto expected = load_tensors((entry.path() / "expected.safetensors").string());
    const auto& ids = expected.at("input_ids");
    auto model = load_hf_model(entry.path().string(), torch::kFloat32);
    model->eval();
    const auto& hf_logits = hf.at(name + ".logits");
    const auto& hf_pos = hf.at(name + ".logits_pos");
    const double d_fixture = max_abs_diff(expected.at("logits"), hf_logits);
    const double d_fixture_pos = max_abs_diff(expected.at("logits_pos"), hf_pos);
    const double d_replica = max_abs_diff(model->forward(ids), hf_logits);
    const double d_replica_pos = max_abs_diff(model->forward(ids, expected.at("position_ids")), hf_pos);
    EXPECT_LE(d_fixture, kFp32Tolerance);
    EXPECT_LE(d_fixture_pos, kFp32Tolerance);
    EXPECT_LE(d_replica, kFp32Tolerance);
    EXPECT_LE(d_replica_pos, kFp32Tolerance);
    // bf16: the fixture's transcription follows eager attention; replica follows transformers'
    // default (sdpa), which rounds differently in bf16.
    const auto& hf16 = hf.at(name + ".logits_bf16_eager");
    const auto& hf16_sdpa = hf.at(name + ".logits_bf16");
    const double scale = hf16.abs().max().item<double>();
    const double d16 = max_abs_diff(expected.at("logits_bf16"), hf16);
    const double d16_sdpa = max_abs_diff(expected.at("logits_bf16"), hf16_sdpa);
    auto model16 = load_hf_model(entry.path().string(), torch::kBFloat16);
    model16->eval();
    const double d16_replica = max_abs_diff(model16->forward(ids), hf16_sdpa);
    EXPECT_LE(d16, scale / 64);
    EXPECT_LE(d16_replica, scale / 128);
    std::printf("[fixture %s] transformers vs fixture: logits %.3g, with position_ids %.3g, bf16 %.3g (sdpa %.3g; "
                "max|logit| %.3g); transformers vs replica: %.3g, with position_ids %.3g, bf16 (sdpa) %.3g\n",
                name.c_str(), d_fixture, d_fixture_pos, d16, d16_sdpa, scale, d_replica, d_replica_pos, d16_replica);
    ++checked;
  }
  EXPECT_EQ(checked, 5);
}
