// The trainer's two ways of reading a step's numbers (Note [the step's reads, a step late] in
// train/trainer.cpp): read during the next step (a GPU's default) or before the update (the
// CPU's), forced with REPLICA_STEP_READS. The same LoRA SFT run both ways, at world 2 with
// gradient accumulation, clipping, evaluations and checkpoints between steps: the same
// metrics.jsonl numbers and the same adapter, bit for bit.
#include <gtest/gtest.h>

#include "replica/testing/llm_demo.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::vector<json> metrics_without_times(const fs::path& project) {
  std::vector<json> out;
  std::istringstream in(replica::testing::read_file(project / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    json j = json::parse(line);
    for (auto it = j.begin(); it != j.end();) {
      const std::string& k = it.key();
      const bool timing = k.find("per_s") != std::string::npos || k.find("time") != std::string::npos ||
                          k.rfind("split", 0) == 0 || k.find("seconds") != std::string::npos;
      it = timing ? j.erase(it) : std::next(it);
    }
    out.push_back(j);
  }
  return out;
}

TEST(StepReads, LateAndNowGiveTheSameRunBitForBit) {
  const auto& demo = replica::testing::llm_demo();
  const fs::path runs = demo.run_dir("step-reads");
  auto run = [&](const std::string& mode) {
    const fs::path p = runs / mode;
    const auto r = replica::testing::run_program(
        REPLICA_BIN,
        {"llm", "--train", "--model", demo.demo.model_dir, "--data-path", demo.demo.data_dir, "--project-name",
         p.string(), "--peft", "--nproc-per-node", "2", "--threads-per-worker", "1", "--lr", "3e-3", "--block-size",
         "64", "--batch-size", "2", "--gradient-accumulation", "2", "--max-grad-norm", "0.5", "--max-steps", "6",
         "--warmup-ratio", "0", "--logging-steps", "1", "--valid-split", "valid", "--eval-strategy", "steps",
         "--eval-every", "2", "--checkpoint-every", "3", "--deterministic"},
        {{"REPLICA_STEP_READS", mode}}, std::chrono::seconds(300));
    EXPECT_EQ(r.exit_code, 0) << r;
    return p;
  };
  const fs::path late = run("late"), now = run("now");
  if (HasFailure()) return;
  const auto ml = metrics_without_times(late), mn = metrics_without_times(now);
  ASSERT_EQ(ml.size(), mn.size());
  ASSERT_GE(ml.size(), 9u);  // 6 steps and 3 evaluations
  for (size_t i = 0; i < ml.size(); ++i) EXPECT_EQ(ml[i], mn[i]) << "line " << i + 1;
  EXPECT_TRUE(replica::testing::bitwise_equal(
      replica::testing::load_tensors(late / "final" / "adapter_model.safetensors"),
      replica::testing::load_tensors(now / "final" / "adapter_model.safetensors")));
}

}  // namespace
