// torch_dtype: bfloat16 through the program (Note [bf16 weights] in llm_sft.cpp): the weights
// held in bf16 with fp32 masters stepped by the optimizer, the masters in every checkpoint so
// that a resumed run ends bit for bit where the straight one does (DDP with its sharded step,
// and ZeRO-3 with its own master shards), LoRA over the bf16 base with fp32 adapters, and the
// settings refused with their reasons.
#include <gtest/gtest.h>

#include "replica/testing/llm_demo.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::testing::bitwise_equal;
using replica::testing::load_tensors;
using replica::testing::max_abs_diff;
using replica::testing::Result;

namespace {

Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(300));
}

fs::path runs() {
  static const fs::path dir = replica::testing::llm_demo().run_dir("bf16-weights");
  return dir;
}

std::vector<std::string> base_args(const fs::path& project, const std::string& world) {
  const auto& demo = replica::testing::llm_demo().demo;
  return {"llm", "--train", "--model", demo.model_dir, "--data-path", demo.data_dir, "--project-name",
          project.string(), "--torch-dtype", "bfloat16", "--nproc-per-node", world, "--threads-per-worker", "1",
          "--lr", "2e-3", "--block-size", "64", "--batch-size", "2", "--gradient-accumulation", "1",
          "--warmup-ratio", "0", "--scheduler", "constant", "--logging-steps", "1", "--deterministic"};
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::vector<double> losses_of(const fs::path& project) {
  std::vector<double> out;
  std::istringstream in(replica::testing::read_file(project / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// Full fine-tuning in bf16 weights, straight to step 6 and in two runs (3, then resumed to 6):
// the same final weights bit for bit; the checkpoint holds bf16 weights and their fp32 masters.
void expect_resume_bit_for_bit(const std::string& name, const std::vector<std::string>& engine) {
  const fs::path a = runs() / (name + "-straight"), b = runs() / (name + "-resumed");
  auto args = [&](const fs::path& p, const char* steps) {
    return with(with(base_args(p, "2"), engine), {"--max-steps", steps, "--checkpoint-every", "3"});
  };
  const Result straight = replica_run(args(a, "6"));
  ASSERT_EQ(straight.exit_code, 0) << straight;
  const Result first = replica_run(args(b, "3"));
  ASSERT_EQ(first.exit_code, 0) << first;
  const Result second = replica_run(args(b, "6"));
  ASSERT_EQ(second.exit_code, 0) << second;
  EXPECT_NE(second.all().find("resuming from"), std::string::npos) << second;

  const auto fa = load_tensors(a / "final" / "model.safetensors");
  const auto fb = load_tensors(b / "final" / "model.safetensors");
  // final/ is in the base checkpoint's dtype (the demo's is fp32), holding the bf16 weights.
  for (const auto& [n, t] : fa) EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16).to(t.scalar_type()), t)) << n;
  EXPECT_TRUE(bitwise_equal(fa, fb)) << "max abs diff " << max_abs_diff(fa, fb);
  // A checkpoint holds the weights as trained, in bf16, and says so.
  EXPECT_EQ(json::parse(replica::testing::read_file(b / "checkpoint-6" / "config.json"))["torch_dtype"], "bfloat16");
  // It trained: the weights moved from the base's (rounded) and the losses are finite.
  const auto base = load_tensors(fs::path(replica::testing::llm_demo().demo.model_dir) / "model.safetensors");
  EXPECT_GT(max_abs_diff(fa, base), 1e-3);
  const auto losses = losses_of(a);
  ASSERT_EQ(losses.size(), 6u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
}

TEST(Bf16Weights, DdpResumesBitForBitWithTheMastersInTheCheckpoint) {
  expect_resume_bit_for_bit("ddp", {});
  if (HasFailure()) return;
  // DDP's checkpoint: the full optimizer state, the fp32 masters among it, each rounding to the
  // checkpoint's bf16 weight (on CPU workers the step is sharded: the masters were gathered).
  const fs::path c = runs() / "ddp-resumed" / "checkpoint-6";
  const auto weights = load_tensors(c / "model.safetensors");
  const auto state = load_tensors(c / "optimizer.safetensors");
  int masters = 0;
  bool holds_more = false;
  for (const auto& [name, w] : weights) {
    auto it = state.find(name + ".master");
    if (it == state.end()) continue;
    ++masters;
    EXPECT_EQ(it->second.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(it->second.to(torch::kBFloat16), w)) << name << ": the weight is not its master rounded";
    holds_more = holds_more || !torch::equal(it->second, w.to(torch::kFloat32));
  }
  EXPECT_EQ(masters, static_cast<int>(weights.size())) << "a weight without its master in optimizer.safetensors";
  EXPECT_TRUE(holds_more) << "the masters hold nothing below a bf16 ulp";
}

TEST(Bf16Weights, Zero3ResumesBitForBitFromItsMasterShards) {
  expect_resume_bit_for_bit("zero3", {"--distributed-backend", "deepspeed"});
  if (HasFailure()) return;
  for (const char* rank : {"rank-0.safetensors", "rank-1.safetensors"}) {
    for (const auto& [name, t] : load_tensors(runs() / "zero3-resumed" / "checkpoint-6" / "zero" / rank)) {
      // "group.G": a master shard ("group.G.<field>": its optimizer state).
      const bool master = name.rfind("group.", 0) == 0 && name.find('.', 6) == std::string::npos;
      if (master) EXPECT_EQ(t.scalar_type(), torch::kFloat32) << rank << " " << name;
    }
  }
}

// World 2 against world 1 at the same global batch: the same run up to bf16's rounding of the
// reduced gradients (each worker's gradient is rounded to bf16 before the average).
TEST(Bf16Weights, WorldTwoFollowsWorldOneAtTheSameGlobalBatch) {
  auto run = [&](const std::string& name, const char* world, const char* batch) {
    const fs::path p = runs() / name;
    const Result r = replica_run(with(base_args(p, world), {"--max-steps", "4", "--batch-size", batch,
                                                             "--optimizer", "sgd", "--lr", "0.05"}));
    EXPECT_EQ(r.exit_code, 0) << r;
    return p;
  };
  const fs::path one = run("world1", "1", "4"), two = run("world2", "2", "2");
  if (HasFailure()) return;
  const auto l1 = losses_of(one), l2 = losses_of(two);
  ASSERT_EQ(l1.size(), 4u);
  ASSERT_EQ(l2.size(), 4u);
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 2e-2 * std::abs(l1[i])) << "step " << i + 1;
  const auto w1 = load_tensors(one / "final" / "model.safetensors");
  const auto w2 = load_tensors(two / "final" / "model.safetensors");
  // A few bf16 ulps of weights of order 0.1: the runs agree far closer than training moved them.
  const auto base = load_tensors(fs::path(replica::testing::llm_demo().demo.model_dir) / "model.safetensors");
  EXPECT_LT(max_abs_diff(w1, w2), 0.25 * max_abs_diff(w1, base));
}

TEST(Bf16Weights, LoraOverABf16BaseTrainsFp32Adapters) {
  const fs::path p = runs() / "lora";
  const Result r = replica_run(with(base_args(p, "1"), {"--peft", "--max-steps", "4"}));
  ASSERT_EQ(r.exit_code, 0) << r;
  for (const auto& [name, t] : load_tensors(p / "final" / "adapter_model.safetensors")) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
  }
  const auto losses = losses_of(p);
  ASSERT_EQ(losses.size(), 4u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
}

TEST(Bf16Weights, SettingsThatCannotWorkAreRefusedWithTheReason) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : {Case{{"--torch-dtype", "float16"}, "torch_dtype float16 is not supported"},
                        Case{{"--torch-dtype", "bf16", "--mixed-precision", "fp16"},
                             "torch_dtype bfloat16 (bf16 weights) with mixed_precision fp16"},
                        Case{{"--torch-dtype", "int8"}, "int8"}}) {
    const Result r = replica_run(with(base_args(runs() / "refused", "1"), with(c.args, {"--max-steps", "1"})));
    EXPECT_NE(r.exit_code, 0) << r;
    EXPECT_NE(r.all().find(c.message), std::string::npos) << r;
  }
  EXPECT_FALSE(fs::exists(runs() / "refused" / "final"));
}

}  // namespace
