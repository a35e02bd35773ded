// Conformance: TensorBoard's own reader (tensorboard.backend.event_processing's
// EventAccumulator) reads the event file of a real short training run of the `replica` program
// (the two-tower example on a small synthetic data set, 2 workers, log: tensorboard) and finds
// exactly the scalars of the run's metrics.jsonl: tags, steps and values (float32).
#include "replica/testing/referee.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct TempDir : replica::testing::ScratchDir {
  TempDir() : ScratchDir("replica-tensorboard-conformance") {}
};

replica::testing::Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(180));
}

int count_lines_with(const fs::path& file, const std::string& needle) {
  std::ifstream in(file);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

}  // namespace

TEST(TensorboardConformance, EventAccumulatorReadsTheScalarsOfMetricsJsonl) {
  REPLICA_REQUIRE_PYTHON("tensorboard", "numpy");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  TempDir dir;
  const fs::path data = dir.path / "recsys", project = dir.path / "run";
  const auto synth = replica_run({"mds", "synthetic", "--out", data.string(), "--users", "200", "--items", "100",
                                  "--clusters", "5", "--train", "2000", "--valid", "200"});
  ASSERT_EQ(synth.exit_code, 0) << synth;
  // 12 steps, a training line every 2 and an evaluation every 6 (so training and evaluation
  // lines share steps 6 and 12), on 2 workers.
  const auto run = replica_run({"--config", std::string(REPLICA_SOURCE_DIR) + "/examples/two_tower_synthetic.yaml",
                                "--data-path", data.string(), "--project-name", project.string(), "--log",
                                "tensorboard", "--nproc-per-node", "2", "--threads-per-worker", "1", "--batch-size",
                                "32", "--max-steps", "12", "--logging-steps", "2", "--eval-every", "6",
                                "--checkpoint-every", "0"});
  ASSERT_EQ(run.exit_code, 0) << run;
  // The run logged what the referee is to compare: training lines and evaluations.
  ASSERT_GE(count_lines_with(project / "metrics.jsonl", "\"loss\""), 6);
  ASSERT_GE(count_lines_with(project / "metrics.jsonl", "\"eval_loss\""), 2);

  const auto referee = replica::testing::run_python(
      fs::path(REPLICA_SOURCE_DIR) / "replica/obs/tests/referee/tensorboard_referee.py", {project.string()});
  EXPECT_EQ(referee.exit_code, 0) << referee.output;
  std::cerr << referee.output;
}
