// The alignment trainers through the program, on `llm init-demo`'s model and preference data:
// the same adapter at world 1, at world 2, with gradient accumulation and under ZeRO-3; full
// fine-tuning in bf16 resuming bit for bit; what final/ holds; clear errors.
#include <gtest/gtest.h>

#include "replica/testing/llm_demo.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/train/tests/tensor_files.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::testing::Result;
using replica::testing::bitwise_equal;
using replica::testing::load_tensors;
using replica::testing::max_abs_diff;

namespace {

Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(300));
}

struct PreferenceDemo {
  fs::path root;
  replica::train::LlmDemo demo;
};

const PreferenceDemo& demo() {
  static const PreferenceDemo d{replica::testing::llm_demo().run_dir("preference"), replica::testing::llm_demo().demo};
  return d;
}

std::vector<json> metrics_of(const fs::path& project) {
  std::vector<json> out;
  std::ifstream in(project / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

std::vector<std::string> base_args(const std::string& trainer, const fs::path& project) {
  return {"llm",         "--train",        "--model",          demo().demo.model_dir,
          "--data-path", demo().demo.preference_dir, "--project-name", project.string(),
          "--trainer",   trainer,          "--block-size",     "96",
          "--max-prompt-length", "48",     "--shuffle",        "false",
          "--warmup-ratio", "0",           "--logging-steps",  "1",
          "--threads-per-worker", "1",     "--valid-split",    "valid"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class PreferenceEndToEnd : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built"; }
};

TEST_P(PreferenceEndToEnd, LoraAtWorldTwoEqualsWorldOneAccumulationAndZero3) {
  // Global batch 4 pairs: 1 worker x 4, 2 workers x 2, 2 workers x 1 x 2 accumulation steps, and
  // ZeRO-3 at 2 x 2: each step's loss is the mean over the global batch's pairs, so SGD ends at the
  // same adapter (and, for reward, score head).
  const std::string trainer = GetParam();
  const fs::path root = demo().root / ("lora-" + trainer);
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    const Result r = replica_run(with(with(base_args(trainer, root / name),
                                           {"--peft", "--lora-dropout", "0", "--lora-r", "8", "--lora-alpha", "16",
                                            "--optimizer", "sgd", "--lr", "0.5", "--max-steps", "6",
                                            "--checkpoint-every", "0", "--mixed-precision", "fp32", "--eval-every", "6"}),
                                      extra));
    EXPECT_EQ(r.exit_code, 0) << r;
    return load_tensors(root / name / "final" / "adapter_model.safetensors");
  };
  const auto one = run("w1", {"--nproc-per-node", "1", "--batch-size", "4", "--gradient-accumulation", "1"});
  const auto two = run("w2", {"--nproc-per-node", "2", "--batch-size", "2", "--gradient-accumulation", "1"});
  const auto acc = run("w2acc", {"--nproc-per-node", "2", "--batch-size", "1", "--gradient-accumulation", "2"});
  const auto z3 = run("z3", {"--nproc-per-node", "2", "--batch-size", "2", "--gradient-accumulation", "1",
                             "--distributed-backend", "zero3"});
  if (HasFailure()) return;
  ASSERT_EQ(one.size(), two.size());
  if (trainer == "reward") EXPECT_TRUE(one.count("base_model.model.score.weight")) << "the score head is saved with the adapter";
  const double d2 = max_abs_diff(one, two), dacc = max_abs_diff(one, acc), dz3 = max_abs_diff(one, z3);
  std::cerr << trainer << " LoRA SGD, adapter max abs diff after 6 steps against world 1: world 2 " << d2
            << ", world 2 with accumulation " << dacc << ", ZeRO-3 " << dz3 << "\n";
  // ORPO's NLL term is, as in TRL, the mean over the tokens of each micro-batch's chosen
  // sequences: another split of the same global batch weighs tokens differently (TRL's ORPO at
  // world 2 is not its world 1 either). Only ZeRO-3 at the same split must equal DDP.
  if (trainer == "orpo") {
    EXPECT_LE(max_abs_diff(two, z3), 1e-5);
  } else {
    EXPECT_LE(d2, 1e-5);
    EXPECT_LE(dacc, 1e-5);
    EXPECT_LE(dz3, 1e-5);
  }
  double moved = 0;
  for (const auto& [name, t] : one) {
    if (name.find("lora_B") != std::string::npos) moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-4) << "the adapters did not train";

  // TRL's metrics in metrics.jsonl, every step, equal across the ways of splitting the batch.
  const auto m1 = metrics_of(root / "w1"), m2 = metrics_of(root / "w2");
  const std::vector<std::string> names =
      trainer == "reward" ? std::vector<std::string>{"accuracy", "margin"}
                          : std::vector<std::string>{"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                     "rewards/margins", "logps/chosen", "logps/rejected"};
  int steps = 0;
  for (size_t i = 0; i < m1.size() && i < m2.size(); ++i) {
    if (!m1[i].contains("loss")) continue;
    ++steps;
    for (const auto& n : names) {
      ASSERT_TRUE(m1[i].contains(n)) << n << " not logged: " << m1[i].dump();
      ASSERT_TRUE(m2[i].contains(n)) << n << " not logged: " << m2[i].dump();
      if (trainer != "orpo") EXPECT_NEAR(m1[i][n].get<double>(), m2[i][n].get<double>(), 1e-4) << n << " at step " << m1[i]["step"];
    }
  }
  EXPECT_EQ(steps, 6);
  // An evaluation at the end, with its accuracy.
  bool evaluated = false;
  for (const auto& j : m1) evaluated = evaluated || j.contains("eval_accuracy");
  EXPECT_TRUE(evaluated);
}

TEST_P(PreferenceEndToEnd, FullFineTuningInBf16ResumesExactly) {
  // Full fine-tuning at world 2 with bf16 autocast and accumulation, checkpointed after step 2:
  // stopped there and resumed, it ends where the uninterrupted run ends, bit for bit.
  const std::string trainer = GetParam();
  const fs::path root = demo().root / ("full-" + trainer);
  auto run = [&](const std::string& name, const std::string& steps) {
    const Result r = replica_run(with(base_args(trainer, root / name),
                                      {"--nproc-per-node", "2", "--batch-size", "1", "--gradient-accumulation", "2",
                                       "--mixed-precision", "bf16", "--lr", "1e-4", "--scheduler", "constant",
                                       "--max-steps", steps, "--checkpoint-every", "2"}));
    EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  };
  run("straight", "4");
  run("resumed", "2");
  const Result second = run("resumed", "4");
  if (HasFailure()) return;
  EXPECT_NE(second.err.find("resuming from"), std::string::npos) << second;
  const auto a = load_tensors(root / "straight" / "final" / "model.safetensors");
  const auto b = load_tensors(root / "resumed" / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(a, b));
  const json config = json::parse(replica::testing::read_file(root / "straight" / "final" / "config.json"));
  if (trainer == "reward") {
    EXPECT_EQ(config["architectures"][0], "LlamaForSequenceClassification");
    EXPECT_EQ(config["num_labels"], 1);
    EXPECT_TRUE(a.count("score.weight"));
    EXPECT_FALSE(a.count("lm_head.weight"));
  } else {
    EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  }
  const auto base = load_tensors(fs::path(demo().demo.model_dir) / "model.safetensors");
  double moved = 0;
  for (const auto& [name, t] : a) {
    if (base.count(name)) moved = std::max(moved, (t.to(torch::kDouble) - base.at(name).to(torch::kDouble)).abs().max().item<double>());
  }
  EXPECT_GT(moved, 0.0) << "nothing trained";
}

TEST_P(PreferenceEndToEnd, LoraResumesExactly) {
  // The checkpoint holds the adapter (and the reward model's score head beside it, PEFT's
  // base_model.model.score.weight) and every rank's generator (LoRA dropout at world 2: the ranks'
  // draws part as soon as their batches differ in length; with rank 0's state alone rank 1 resumed
  // on the wrong stream): stopped after step 3 and resumed, the run ends where the uninterrupted
  // one ends, bit for bit.
  const std::string trainer = GetParam();
  const fs::path root = demo().root / ("resume-" + trainer);
  auto run = [&](const std::string& name, const std::string& steps) {
    const Result r = replica_run(with(base_args(trainer, root / name),
                                      {"--peft", "--lora-dropout", "0.05", "--nproc-per-node", "2", "--batch-size", "2",
                                       "--gradient-accumulation", "1", "--lr", "2e-3", "--scheduler", "constant", "--max-steps", steps,
                                       "--checkpoint-every", "3"}));
    EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  };
  run("straight", "6");
  run("resumed", "3");
  const Result second = run("resumed", "6");
  if (HasFailure()) return;
  EXPECT_NE(second.err.find("resuming from"), std::string::npos) << second;
  const auto a = load_tensors(root / "straight" / "final" / "adapter_model.safetensors");
  const auto b = load_tensors(root / "resumed" / "final" / "adapter_model.safetensors");
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_EQ(a.count("base_model.model.score.weight"), trainer == "reward" ? 1u : 0u);
  const auto checkpoint = load_tensors(root / "resumed" / "checkpoint-6" / "adapter_model.safetensors");
  EXPECT_EQ(checkpoint.count("base_model.model.score.weight"), trainer == "reward" ? 1u : 0u);
  EXPECT_EQ(load_tensors(root / "resumed" / "checkpoint-6" / "rng_state.safetensors").count("cpu.rank1"), 1u);
}

INSTANTIATE_TEST_SUITE_P(Trainers, PreferenceEndToEnd, ::testing::Values("dpo", "orpo", "reward"));

TEST(PreferenceErrors, BadSettingsAndRowsAreNamed) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN));
  const fs::path root = demo().root / "errors";
  fs::create_directories(root / "data");
  auto expect_error = [&](const std::vector<std::string>& extra, const std::string& what) {
    const Result r = replica_run(with(base_args("dpo", root / "p"), with({"--max-steps", "1", "--nproc-per-node", "1"}, extra)));
    EXPECT_NE(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find(what), std::string::npos) << "wanted '" << what << "' in:\n" << r;
  };
  expect_error({"--trainer", "orpo", "--model-ref", demo().demo.model_dir}, "model_ref is DPO's reference model");
  expect_error({"--dpo-beta", "0"}, "dpo_beta");
  expect_error({"--model-ref", (root / "nowhere").string()}, "is not a model directory");
  // A row without its rejected completion names the file, the record and the column.
  {
    std::ofstream f(root / "data" / "train.jsonl");
    f << R"({"prompt": "a", "chosen": " b", "rejected": " c"})" << "\n"
      << R"({"prompt": "a", "chosen": " b"})" << "\n";
  }
  const Result r = replica_run({"llm", "--train", "--model", demo().demo.model_dir, "--data-path",
                                (root / "data").string(), "--project-name", (root / "q").string(), "--trainer", "dpo",
                                "--max-steps", "1", "--nproc-per-node", "1"});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("train.jsonl record 2: column 'rejected' is missing"), std::string::npos) << r;
}

}  // namespace
