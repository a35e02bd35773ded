// Conformance: what `replica llm --train` and `replica merge-adapter` write, read back by
// Hugging Face transformers and PEFT (referee/hf_referee.py, referee/peft_referee.py, run by
// the project's .venv).
//
// The base models are made by transformers (tiny random Llama / Qwen2 / Qwen3, fp32 and bf16,
// save_pretrained) with the tokenizer of `replica llm init-demo` copied in; each test trains
// a few steps on a tiny JSONL data set through the real program (REPLICA_BIN) and then:
//   full fine-tuning: transformers' from_pretrained(final/) gives the logits (within 1e-4)
//     and greedy tokens that replica computes from the same final/;
//   LoRA: PeftModel.from_pretrained(base, final/) takes the adapter as written and gives
//     replica's logits (base + adapter, within 1e-4; also for adapters trained over an int4 or
//     int8 quantized base, loaded over the unquantized one); `replica merge-adapter` (and the run's
//     merge_adapter: true) writes the weights of PEFT's merge_and_unload() (within 1e-6 in
//     fp32; bit for bit in bf16) with the same logits;
//   and the other way: an adapter that PEFT made and saved loads into replica with PeftModel's
//     logits, and merge-adapter gives merge_and_unload()'s weights.
#include "replica/models/tests/hf_conformance.h"
#include "replica/testing/paths.h"

#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace replica::models;
using namespace replica::models::conformance;
using replica::testing::Result;

namespace {

constexpr double kFp32Tolerance = 1e-4;
constexpr double kMergeTolerance = 1e-6;
constexpr int64_t kNewTokens = 8;  // the referees' --new-tokens default

// The demo tokenizer (SentencePiece BPE, ~1000 ids, bos 1 / eos 2 like the referee's
// configs), written once per process and removed at exit.
struct Demo {
  fs::path root;
  replica::train::LlmDemo demo;
};

const Demo& demo() {
  static const Demo* d = [] {
    auto* out = new Demo;
    std::string tmpl = (fs::temp_directory_path() / "replica-peft-conformance-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    out->root = tmpl;
    out->demo = replica::train::write_llm_demo((out->root / "demo").string());
    return out;
  }();
  return *d;
}

class RemoveDemo : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!made_) return;  // no test needed it (demo() would make it now)
    std::error_code ignored;
    fs::remove_all(demo().root, ignored);
  }
  static bool made_;
};
bool RemoveDemo::made_ = false;
[[maybe_unused]] ::testing::Environment* const remove_demo = ::testing::AddGlobalTestEnvironment(new RemoveDemo);

// A tiny text data set: every token trained (BOS added by the tokenizer, EOS appended).
void write_data(const std::string& path) {
  std::ofstream out(path);
  const char* texts[] = {
      "What is 2 + 3? 2 + 3 = 5",          "Reverse the word \"cat\". \"cat\" reversed is \"tac\".",
      "What is 40 - 11? 40 - 11 = 29",     "Write \"moon\" in capital letters. MOON",
      "How many letters are in \"river\"? \"river\" has 5 letters.",
      "Continue the sequence: 3, 5, 7. 9", "What is 12 + 30? 12 + 30 = 42",
      "Reverse the word \"tree\". \"tree\" reversed is \"eert\".",
  };
  for (const char* t : texts) out << json({{"text", t}}).dump() << "\n";
}

Result replica_program(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(300));
}

// A base model made by transformers, with the demo's tokenizer.
::testing::AssertionResult make_base(const std::string& variant, const std::string& dir) {
  RemoveDemo::made_ = true;
  const auto& d = demo().demo;
  return run_referee("hf_referee.py", {"make", "--variant", variant, "--out", dir, "--vocab-size",
                                       std::to_string(d.vocab_size), "--tokenizer-from", d.model_dir});
}

// `replica llm --train` on one worker, a few steps, no checkpoints.
std::vector<std::string> train_args(const std::string& base, const std::string& data, const std::string& project,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"llm", "--train", "--model", base, "--data-path", data, "--project-name", project,
                                   "--trainer", "sft", "--nproc-per-node", "1", "--threads-per-worker", "1",
                                   "--block-size", "64", "--batch-size", "2", "--gradient-accumulation", "1",
                                   "--max-steps", "4", "--warmup-ratio", "0", "--checkpoint-every", "0",
                                   "--logging-steps", "1", "--seed", "5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The largest difference between two model.safetensors with the same names, shapes and dtypes.
double max_weight_diff(const std::string& ours_file, const std::string& theirs_file) {
  const auto ours = load_tensors(ours_file), theirs = load_tensors(theirs_file);
  std::vector<std::string> ours_names, their_names;
  for (const auto& [n, t] : ours) ours_names.push_back(n);
  for (const auto& [n, t] : theirs) their_names.push_back(n);
  EXPECT_EQ(ours_names, their_names);
  if (ours_names != their_names) return 1e30;
  double worst = 0;
  for (const auto& [name, t] : theirs) {
    EXPECT_EQ(ours.at(name).scalar_type(), t.scalar_type()) << name;
    worst = std::max(worst, max_abs_diff(ours.at(name), t));
  }
  return worst;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Full fine-tuning: final/ is a model directory transformers loads with replica's logits.

class FullFineTuneFinal : public ::testing::TestWithParam<std::string> {};

TEST_P(FullFineTuneFinal, LoadsIntoTransformersWithReplicasLogits) {
  REPLICA_REQUIRE_PYTHON("transformers", "safetensors");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const std::string variant = GetParam();
  const bool bf16 = variant.find("bf16") != std::string::npos;
  ScratchDir dir("replica-fullft-" + variant);
  const std::string base = dir / "base", data = dir / "data.jsonl", project = dir / "run";
  ASSERT_TRUE(make_base(variant, base));
  write_data(data);
  const Result r = replica_program(train_args(base, data, project, {"--lr", "2e-3", "--mixed-precision", "fp32"}));
  ASSERT_EQ(r.exit_code, 0) << r;
  const std::string final_dir = (fs::path(project) / "final").string();
  ASSERT_TRUE(fs::exists(fs::path(final_dir) / "model.safetensors")) << r;

  // Training moved the weights; the directory keeps the base's architecture and dtype.
  const auto tuned = load_tensors(final_dir + "/model.safetensors");
  const auto before = load_tensors(base + "/model.safetensors");
  ASSERT_EQ(tuned.size(), before.size());
  double moved = 0;
  for (const auto& [name, t] : before) {
    ASSERT_TRUE(tuned.count(name)) << name;
    EXPECT_EQ(tuned.at(name).scalar_type(), t.scalar_type()) << name;
    moved = std::max(moved, max_abs_diff(tuned.at(name), t));
  }
  EXPECT_GT(moved, 1e-3);
  const auto base_config = read_hf_config(base), final_config = read_hf_config(final_dir);
  EXPECT_EQ(final_config.model_type, base_config.model_type);
  EXPECT_EQ(final_config.tie_word_embeddings, base_config.tie_word_embeddings);
  EXPECT_EQ(final_config.torch_dtype, base_config.torch_dtype);

  // transformers' from_pretrained(final/) against replica's load of final/.
  const std::string ref_file = dir / "reference.safetensors";
  ASSERT_TRUE(run_referee("hf_referee.py", {"logits", "--model", final_dir, "--out", ref_file, "--seed", "3"}));
  const auto ref = load_tensors(ref_file);
  torch::NoGradGuard no_grad;
  auto model = load_hf_model(final_dir, torch::kFloat32);
  model->eval();
  const auto& ids = ref.at("input_ids");
  const auto logits = model->forward(ids);
  const double d = max_abs_diff(logits, ref.at("logits.float32"));
  EXPECT_LE(d, kFp32Tolerance);
  EXPECT_EQ(argmax_mismatches(logits, ref.at("logits.float32")), 0);
  const auto tokens = greedy(model, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref.at("greedy.float32")))
      << "replica " << tokens << "\ntransformers " << ref.at("greedy.float32");
  std::printf("[full fine-tune %s%s] weights moved %.3g; final/ logits max|diff| replica vs transformers %.3g "
              "(max|logit| %.3g); training %.1f s\n",
              variant.c_str(), bf16 ? ", bf16 checkpoint" : "", moved, d,
              ref.at("logits.float32").abs().max().item<double>(), r.seconds);
}

INSTANTIATE_TEST_SUITE_P(Transformers, FullFineTuneFinal,
                         ::testing::Values("llama_tied_bias", "qwen3", "qwen2_tied_bf16"));

// ---------------------------------------------------------------------------------------
// LoRA: PEFT loads the adapter; merge-adapter equals merge_and_unload().

struct LoraCase {
  std::string name, variant, targets;
  int r, alpha;
  std::string dropout, mixed_precision;
  std::string quantization = "none";  // int4 / int8: trained over a quantized base (QLoRA)
};

std::ostream& operator<<(std::ostream& os, const LoraCase& c) { return os << c.name; }

class PeftAdapter : public ::testing::TestWithParam<LoraCase> {};

TEST_P(PeftAdapter, LoadsIntoPeftAndMergesLikeMergeAndUnload) {
  REPLICA_REQUIRE_PYTHON("transformers", "peft", "safetensors");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const LoraCase c = GetParam();
  ScratchDir dir("replica-peft-" + c.name);
  const std::string base = dir / "base", data = dir / "data.jsonl", project = dir / "run";
  ASSERT_TRUE(make_base(c.variant, base));
  write_data(data);
  // A QLoRA run trains over the quantized base; everything below checks its adapter over the
  // unquantized base, as PEFT users load one.
  const Result r = replica_program(train_args(
      base, data, project,
      {"--peft", "--lora-r", std::to_string(c.r), "--lora-alpha", std::to_string(c.alpha), "--lora-dropout",
       c.dropout, "--target-modules", c.targets, "--lr", "1e-2", "--mixed-precision", c.mixed_precision,
       "--merge-adapter", "--quantization", c.quantization}));
  ASSERT_EQ(r.exit_code, 0) << r;
  if (c.quantization != "none") EXPECT_NE(r.err.find("llm-sft: base quantized to"), std::string::npos) << r;
  const std::string adapter = (fs::path(project) / "final").string();
  ASSERT_TRUE(fs::exists(fs::path(adapter) / "adapter_model.safetensors")) << r;
  const auto adapter_config = json::parse(read_text(fs::path(adapter) / "adapter_config.json"));
  EXPECT_EQ(adapter_config.at("r"), c.r);
  EXPECT_EQ(adapter_config.at("lora_alpha"), c.alpha);
  // The adapters trained (B starts at zero).
  double moved = 0;
  for (const auto& [name, t] : load_tensors(adapter + "/adapter_model.safetensors")) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
    if (name.find("lora_B") != std::string::npos) moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-3);

  // replica merge-adapter, next to the run's own merged/.
  const std::string merged = dir / "merged";
  const Result m = replica_program({"merge-adapter", "--model", base, "--adapter", adapter, "--out", merged});
  ASSERT_EQ(m.exit_code, 0) << m;

  const bool bf16 = read_hf_config(base).torch_dtype == "bfloat16";
  const std::string ref_file = dir / "reference.safetensors", peft_merged = dir / "peft_merged";
  std::string referee_output;
  ASSERT_TRUE(run_referee("peft_referee.py",
                          {"load", "--base", base, "--adapter", adapter, "--out", ref_file, "--merged-out", peft_merged,
                           "--merge-dtype", bf16 ? "bfloat16" : "float32", "--seed", "9"},
                          &referee_output));
  const auto ref = load_tensors(ref_file);
  const auto& ids = ref.at("input_ids");
  torch::NoGradGuard no_grad;

  // Base + adapter: replica's forward against PeftModel's.
  auto adapted = load_hf_model(base, torch::kFloat32);
  load_adapter(*adapted, adapter);
  adapted->eval();
  const auto logits = adapted->forward(ids);
  const double d_adapter = max_abs_diff(logits, ref.at("logits.peft"));
  EXPECT_LE(d_adapter, kFp32Tolerance);
  EXPECT_EQ(argmax_mismatches(logits, ref.at("logits.peft")), 0);
  const auto tokens = greedy(adapted, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref.at("greedy.peft"))) << "replica " << tokens << "\npeft " << ref.at("greedy.peft");
  // The adapter changes the model (else the comparison would not see it).
  auto plain = load_hf_model(base, torch::kFloat32);
  plain->eval();
  const double adapter_effect = max_abs_diff(plain->forward(ids), ref.at("logits.peft"));
  EXPECT_GT(adapter_effect, 1e-2);

  // The merged weights: merge-adapter's and the run's merged/ against merge_and_unload()'s.
  // fp32: the same fp32 sum up to summation order; bf16: W + delta in fp32, rounded once to
  // bf16 on both sides.
  const std::string peft_weights = peft_merged + "/model.safetensors";
  const double d_merge = max_weight_diff(merged + "/model.safetensors", peft_weights);
  const double d_run_merge = max_weight_diff((fs::path(project) / "merged" / "model.safetensors").string(), peft_weights);
  EXPECT_LE(d_merge, bf16 ? 0.0 : kMergeTolerance);
  EXPECT_LE(d_run_merge, bf16 ? 0.0 : kMergeTolerance);
  auto merged_model = load_hf_model(merged, torch::kFloat32);
  merged_model->eval();
  const auto merged_logits = merged_model->forward(ids);
  const double d_merged_logits = max_abs_diff(merged_logits, ref.at("logits.merged"));
  EXPECT_LE(d_merged_logits, kFp32Tolerance);
  EXPECT_EQ(argmax_mismatches(merged_logits, ref.at("logits.merged")), 0);

  std::printf("[peft %s: %s, targets %s, r %d, alpha %d, dropout %s, %s] max|B| %.3g; logits max|diff| "
              "base+adapter vs PeftModel %.3g (adapter moves logits by %.3g); merged weights vs merge_and_unload "
              "%.3g (run's merged/ %.3g); merged logits %.3g; training %.1f s\n  referee: %s",
              c.name.c_str(), c.variant.c_str(), c.targets.c_str(), c.r, c.alpha, c.dropout.c_str(),
              c.mixed_precision.c_str(), moved, d_adapter, adapter_effect, d_merge, d_run_merge, d_merged_logits,
              r.seconds, referee_output.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Peft, PeftAdapter,
    ::testing::Values(LoraCase{"llama_all_linear", "llama_gqa", "all-linear", 4, 8, "0.05", "fp32"},
                      LoraCase{"qwen2_some_modules", "qwen2", "q,v,o_proj,down_proj", 8, 16, "0.1", "fp32"},
                      LoraCase{"qwen3_all_linear", "qwen3", "all-linear", 2, 6, "0", "fp32"},
                      LoraCase{"qwen2_bf16_all_linear", "qwen2_tied_bf16", "all-linear", 4, 16, "0.05", "bf16"},
                      LoraCase{"llama_qlora_int4", "llama_gqa", "all-linear", 4, 8, "0.05", "fp32", "int4"},
                      LoraCase{"qwen2_qlora_int8_bf16", "qwen2_tied_bf16", "all-linear", 4, 16, "0.05", "bf16",
                               "int8"}),
    [](const ::testing::TestParamInfo<LoraCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------
// The other direction: an adapter PEFT made and saved (its own adapter_config.json, with
// every field PEFT 0.21 writes; all-linear expanded to full module names) loads into
// replica with PEFT's logits, and merge-adapter equals merge_and_unload().

struct PeftMadeCase {
  std::string name, variant, targets;
  int r, alpha;
  bool rslora;
};

std::ostream& operator<<(std::ostream& os, const PeftMadeCase& c) { return os << c.name; }

class PeftMadeAdapter : public ::testing::TestWithParam<PeftMadeCase> {};

TEST_P(PeftMadeAdapter, LoadsIntoReplicaAndMergesLikeMergeAndUnload) {
  REPLICA_REQUIRE_PYTHON("transformers", "peft", "safetensors");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const PeftMadeCase c = GetParam();
  ScratchDir dir("replica-peft-made-" + c.name);
  std::vector<std::string> args = {"make", "--variant", c.variant, "--out", dir.path.string(), "--r",
                                   std::to_string(c.r), "--alpha", std::to_string(c.alpha), "--targets", c.targets,
                                   "--dropout", "0.1", "--seed", "4"};
  if (c.rslora) args.push_back("--rslora");
  std::string referee_output;
  ASSERT_TRUE(run_referee("peft_referee.py", args, &referee_output));
  const std::string base = dir / "base", adapter = dir / "adapter";
  const auto ref = load_tensors(dir / "reference.safetensors");
  const auto& ids = ref.at("input_ids");

  torch::NoGradGuard no_grad;
  auto model = load_hf_model(base, torch::kFloat32);
  const LoraConfig config = load_adapter(*model, adapter);
  EXPECT_EQ(config.r, c.r);
  EXPECT_EQ(config.use_rslora, c.rslora);
  EXPECT_DOUBLE_EQ(config.scaling(), c.rslora ? c.alpha / std::sqrt(double(c.r)) : double(c.alpha) / c.r);
  model->eval();
  const auto logits = model->forward(ids);
  const double d = max_abs_diff(logits, ref.at("logits.peft"));
  EXPECT_LE(d, kFp32Tolerance);
  EXPECT_EQ(argmax_mismatches(logits, ref.at("logits.peft")), 0);
  const auto tokens = greedy(model, ids, kNewTokens);
  EXPECT_TRUE(torch::equal(tokens, ref.at("greedy.peft"))) << "replica " << tokens << "\npeft " << ref.at("greedy.peft");

  const std::string merged = dir / "merged";
  const Result m = replica_program({"merge-adapter", "--model", base, "--adapter", adapter, "--out", merged});
  ASSERT_EQ(m.exit_code, 0) << m;
  const double d_merge = max_weight_diff(merged + "/model.safetensors", dir / "peft_merged/model.safetensors");
  EXPECT_LE(d_merge, kMergeTolerance);
  auto merged_model = load_hf_model(merged, torch::kFloat32);
  merged_model->eval();
  const double d_merged_logits = max_abs_diff(merged_model->forward(ids), ref.at("logits.merged"));
  EXPECT_LE(d_merged_logits, kFp32Tolerance);
  std::printf("[peft-made %s: %s, targets %s, r %d, alpha %d%s] logits max|diff| replica base+adapter vs PeftModel "
              "%.3g; merge-adapter vs merge_and_unload weights %.3g, logits %.3g\n  referee: %s",
              c.name.c_str(), c.variant.c_str(), c.targets.c_str(), c.r, c.alpha, c.rslora ? ", rslora" : "", d,
              d_merge, d_merged_logits, referee_output.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Peft, PeftMadeAdapter,
    ::testing::Values(PeftMadeCase{"llama_all_linear", "llama_tied_bias", "all-linear", 8, 16, false},
                      PeftMadeCase{"qwen3_rslora", "qwen3", "q_proj,k_proj,v_proj,o_proj,gate_proj", 4, 8, true}),
    [](const ::testing::TestParamInfo<PeftMadeCase>& info) { return info.param.name; });
