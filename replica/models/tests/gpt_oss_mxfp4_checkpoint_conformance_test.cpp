// Conformance: a GPT-OSS checkpoint whose experts are stored in MXFP4, as the published
// openai/gpt-oss checkpoints store them (uint8 *_blocks / *_scales, quantization_config
// quant_method mxfp4, two shards), read by replica's load_hf_model (hf_model_dir.cpp,
// mxfp4.h) against transformers' own loading of the same directory
// (referee/mxfp4_referee.py: from_pretrained with Mxfp4Config(dequantize=True), what it does
// on a machine without a supported GPU):
//   - every expert tensor replica dequantizes equals transformers' dequantized parameter
//     exactly (and the referee's own dequantization of what it wrote);
//   - logits within 1e-4 of transformers' (fp32), the same argmax at every position, the
//     same greedy tokens;
//   - a scales tensor of the wrong shape, a scales tensor missing, and a blocks/scales pair
//     that does not fit config.json are errors naming the tensor (and the file).
#include "replica/models/tests/hf_conformance.h"

#include "replica/core/error.h"
#include "replica/io/safetensors.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

using namespace replica::models;
using namespace replica::models::conformance;

namespace {

constexpr double kFp32Tolerance = 1e-4;
constexpr int64_t kNewTokens = 8;  // mxfp4_referee.py NEW_TOKENS
const char* kFirstShard = "model-00001-of-00002.safetensors";

// The message of the replica::Error `fn` throws ("" and a failure when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const replica::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a replica::Error";
  return "";
}

// A copy of the checkpoint directory `from` whose first shard is rewritten by `edit`.
std::string edited_copy(const std::string& from, const std::string& to,
                        const std::function<void(replica::io::NamedTensors&)>& edit) {
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(from)) fs::copy_file(entry.path(), fs::path(to) / entry.path().filename());
  const std::string shard = (fs::path(to) / kFirstShard).string();
  auto tensors = replica::io::load_safetensors(shard).tensors;
  for (auto& [name, t] : tensors) t = t.clone();  // off the file's mapping before it is replaced
  edit(tensors);
  fs::remove(shard);
  replica::io::save_safetensors(shard, tensors, {{"format", "pt"}});
  return to;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The referee's checkpoint and reference, made once for the suite's tests.
class GptOssMxfp4Checkpoint : public ::testing::Test {
 protected:
  static void TearDownTestSuite() {
    delete ref_;
    ref_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    REPLICA_REQUIRE_PYTHON("transformers", "safetensors", "torch");
    if (dir_) return;
    dir_ = new ScratchDir("replica-gpt-oss-mxfp4");
    std::string output;
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(run_referee("mxfp4_referee.py", {"--out", model_dir(), "--ref", (*dir_) / "reference.safetensors",
                                                 "--seed", "3"},
                            &output));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto at = output.rfind("{\"transformers\"");
    std::printf("referee (%.1f s): %s", seconds, at == std::string::npos ? output.c_str() : output.c_str() + at);
    ref_ = new std::map<std::string, torch::Tensor>(load_tensors((*dir_) / "reference.safetensors"));
  }
  static std::string model_dir() { return (*dir_) / "model"; }
  static const torch::Tensor& ref(const std::string& name) {
    auto it = ref_->find(name);
    if (it == ref_->end()) throw std::runtime_error("the referee wrote no " + name);
    return it->second;
  }

  static ScratchDir* dir_;
  static std::map<std::string, torch::Tensor>* ref_;
};
ScratchDir* GptOssMxfp4Checkpoint::dir_ = nullptr;
std::map<std::string, torch::Tensor>* GptOssMxfp4Checkpoint::ref_ = nullptr;

TEST_F(GptOssMxfp4Checkpoint, LoadsPublishedLayoutLikeTransformers) {
  // The directory is in the published layout: no float expert weights, only uint8 halves.
  ASSERT_NE(ref_, nullptr);
  const auto shard = load_tensors((*dir_) / (std::string("model/") + kFirstShard));
  ASSERT_TRUE(shard.count("model.layers.0.mlp.experts.gate_up_proj_blocks"));
  EXPECT_EQ(shard.at("model.layers.0.mlp.experts.gate_up_proj_blocks").scalar_type(), torch::kUInt8);
  EXPECT_EQ(shard.at("model.layers.0.mlp.experts.gate_up_proj_blocks").sizes(),
            (std::vector<int64_t>{4, 128, 2, 16}));
  EXPECT_EQ(shard.at("model.layers.0.mlp.experts.down_proj_scales").sizes(), (std::vector<int64_t>{4, 64, 2}));
  EXPECT_FALSE(shard.count("model.layers.0.mlp.experts.gate_up_proj"));

  const auto config = read_hf_config(model_dir());
  EXPECT_EQ(config.model_type, "gpt_oss");
  EXPECT_TRUE(config.mxfp4_experts);
  EXPECT_EQ(config.num_local_experts, 4);
  EXPECT_EQ(config.num_experts_per_tok, 2);

  const auto start = std::chrono::steady_clock::now();
  auto model = load_hf_model(model_dir(), torch::kFloat32);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  model->eval();
  EXPECT_EQ(model->checkpoint_dtype(), torch::kBFloat16);  // the non-expert tensors' dtype

  // The experts: bit for bit transformers' dequantized parameters.
  double expert_diff = 0, quantization_error = 0;
  for (int layer = 0; layer < 2; ++layer) {
    auto* experts = model->model->layers[layer]->as<LlamaDecoderLayerImpl>()->moe->experts.get();
    for (const std::string proj : {"gate_up_proj", "down_proj"}) {
      const auto& ours = proj == "gate_up_proj" ? experts->gate_up_proj : experts->down_proj;
      const std::string key = std::to_string(layer) + "." + proj;
      const auto& theirs = ref("experts." + key);
      ASSERT_EQ(ours.sizes(), theirs.sizes()) << key;
      EXPECT_TRUE(torch::equal(ours, theirs)) << key << ": max |diff| " << max_abs_diff(ours, theirs);
      EXPECT_TRUE(torch::equal(ours, ref("quantized." + key))) << key;
      expert_diff = std::max(expert_diff, max_abs_diff(ours, theirs));
      // Not a trivial checkpoint: the FP4 weights approximate the random ones.
      const double q = max_abs_diff(ours, ref("original." + key));
      EXPECT_GT(q, 0.0) << key;
      EXPECT_LT(q, 0.5) << key;
      quantization_error = std::max(quantization_error, q);
      EXPECT_GT(ours.abs().max().item<double>(), 0.3) << key;
    }
  }

  const auto& ids = ref("input_ids");
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(ids);
  }
  const auto& expected = ref("logits");
  const double d = expect_logits_match(logits, expected, kFp32Tolerance);
  const double spread = (expected.amax(-1) - expected.amin(-1)).min().item<double>();
  const auto tokens = greedy(model, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref("greedy"))) << "replica " << tokens << "\ntransformers " << ref("greedy");
  std::printf("mxfp4 checkpoint: experts max|diff| replica vs transformers %.3g (FP4 vs the random weights: %.3g), "
              "logits max|diff| %.3g over %lld positions (spread >= %.3g), argmax mismatches %lld, greedy %lld tokens "
              "equal; replica load %.3f s\n",
              expert_diff, quantization_error, d, static_cast<long long>(ids.numel()), spread,
              static_cast<long long>(argmax_mismatches(logits, expected)), static_cast<long long>(kNewTokens),
              load_s);
}

// What a full fine-tune's final/ (or merge_adapter's merged/) writes from an MXFP4 base: the
// experts dequantized, config.json without quantization_config, a directory transformers
// loads with the same logits (FP4 values times powers of two are exact in bf16).
TEST_F(GptOssMxfp4Checkpoint, SavedModelIsADequantizedDirectoryTransformersLoads) {
  ASSERT_NE(ref_, nullptr);
  auto model = load_hf_model(model_dir(), torch::kFloat32);
  const std::string saved = (*dir_) / "saved";
  save_hf_model_dir(model, saved, model_dir());
  const auto config = nlohmann::json::parse(std::ifstream(std::filesystem::path(saved) / "config.json"));
  EXPECT_FALSE(config.contains("quantization_config")) << config.dump(2);
  const auto tensors = load_tensors(std::filesystem::path(saved) / "model.safetensors");
  ASSERT_TRUE(tensors.count("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(tensors.count("model.layers.0.mlp.experts.gate_up_proj_blocks"));
  const std::string out = (*dir_) / "saved_logits.safetensors";
  ASSERT_TRUE(run_referee("hf_referee.py", {"logits", "--model", saved, "--out", out, "--ids",
                                            (*dir_) / "reference.safetensors", "--new-tokens", "0"}));
  const double d = max_abs_diff(load_tensors(out).at("logits.float32"), ref("logits"));
  EXPECT_LE(d, kFp32Tolerance);
  std::printf("mxfp4 checkpoint saved by replica, loaded by transformers: logits max|diff| %.3g\n", d);
}

TEST_F(GptOssMxfp4Checkpoint, MisshapenOrMissingScalesAreErrorsNamingTensorAndFile) {
  ASSERT_NE(ref_, nullptr);
  const std::string down = "model.layers.0.mlp.experts.down_proj";
  const std::string shard = std::string("/") + kFirstShard;

  // Scales with one block per row fewer than the blocks have: dequantize_mxfp4's check,
  // naming the file and the expert tensor.
  const auto narrow = edited_copy(model_dir(), (*dir_) / "narrow_scales", [&](replica::io::NamedTensors& ts) {
    for (auto& [name, t] : ts) {
      if (name == down + "_scales") t = t.narrow(-1, 0, 1).contiguous();
    }
  });
  auto message = error_of([&] { load_hf_model(narrow, torch::kFloat32); });
  EXPECT_NE(message.find(narrow + shard), std::string::npos) << message;
  EXPECT_NE(message.find(down), std::string::npos) << message;
  EXPECT_NE(message.find("scales [4, 64, 1]"), std::string::npos) << message;
  EXPECT_NE(message.find("blocks [4, 64, 2, 16]"), std::string::npos) << message;
  std::printf("wrong scales shape: %s\n", message.c_str());

  // Blocks and scales that fit each other but not config.json (one block per row: 32 rows
  // where intermediate_size says 64).
  const auto small = edited_copy(model_dir(), (*dir_) / "small_pair", [&](replica::io::NamedTensors& ts) {
    for (auto& [name, t] : ts) {
      if (name == down + "_scales" || name == down + "_blocks") t = t.narrow(2, 0, 1).contiguous();
    }
  });
  message = error_of([&] { load_hf_model(small, torch::kFloat32); });
  EXPECT_NE(message.find(small + shard), std::string::npos) << message;
  EXPECT_NE(message.find(down), std::string::npos) << message;
  EXPECT_NE(message.find("[4, 32, 64]"), std::string::npos) << message;
  EXPECT_NE(message.find("[4, 64, 64]"), std::string::npos) << message;
  std::printf("pair unlike config.json: %s\n", message.c_str());

  // A scales tensor gone (and from the index): the weight's blocks without their scales, by name.
  const auto missing = edited_copy(model_dir(), (*dir_) / "missing_scales", [&](replica::io::NamedTensors& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const auto& item) { return item.first == down + "_scales"; }),
             ts.end());
  });
  {
    const std::string index_path = missing + "/model.safetensors.index.json";
    auto index = nlohmann::json::parse(read_text(index_path));
    index["weight_map"].erase(down + "_scales");
    std::FILE* f = std::fopen(index_path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(index.dump(2).c_str(), f);
    std::fclose(f);
  }
  message = error_of([&] { load_hf_model(missing, torch::kFloat32); });
  EXPECT_NE(message.find(down), std::string::npos) << message;
  EXPECT_NE(message.find("has its _blocks but no _scales"), std::string::npos) << message;
  std::printf("scales missing: %s\n", message.c_str());
}

}  // namespace
