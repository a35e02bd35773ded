// Non-finite losses and weights (train/nonfinite.h): every rank takes the same decision from
// one all-reduce, the run stops naming the step (or skips the step with nonfinite_loss: skip),
// and nothing holding NaN or Inf is saved.
// - The agreement itself, with ranks as threads of this process, where only one rank's loss
//   (or weights) is not finite.
// - Whole runs of the real `replica` program on Fashion-MNIST: an enormous learning rate makes
//   the weights huge after step 1, so step 2's logits overflow and its loss is NaN; at lr 1e300
//   the update itself overflows (the weights are Inf after step 1, with a finite loss).
#include "replica/core/error.h"
#include "replica/distributed/process_group.h"
#include "replica/distributed/tests/loopback.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/nonfinite.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

using replica::testing::Result;

// Runs fn(rank, group) on `size` threads, each rank with its own process group; the error
// text (or "") of each rank.
template <typename F>
std::vector<std::string> run_ranks(int size, F fn) {
  const int port = replica::testing::free_port();
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = replica::distributed::init_process_group(replica::testing::loopback_world(r, size, port));
        fn(r, *pg);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(NonfiniteAgreement, OneRanksNanLossIsSeenByEveryRankWithTheSameWords) {
  std::vector<replica::train::NonfiniteLosses> seen(3), clean(3);
  const auto errors = run_ranks(3, [&](int rank, replica::distributed::ProcessGroup& pg) {
    replica::train::StepLosses finite;
    finite.add(2.5);
    finite.add(2.25);
    clean[rank] = replica::train::agree_on_losses(finite, pg);
    replica::train::StepLosses mine;
    mine.add(2.5);
    mine.add(rank == 1 ? std::nan("") : 2.0);
    seen[rank] = replica::train::agree_on_losses(mine, pg);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_FALSE(clean[r].found) << "rank " << r << ": " << clean[r].where;
    EXPECT_TRUE(seen[r].found) << "rank " << r;
    EXPECT_EQ(seen[r].where, "rank 1: nan in micro-batch 2 of 2") << "rank " << r;
  }
  EXPECT_EQ(replica::train::nonfinite_stop_message(7, "the training loss is not finite (" + seen[0].where + ")")
                .rfind("step 7: the training loss is not finite (rank 1: nan in micro-batch 2 of 2); the run stops", 0),
            0u);
}

TEST(NonfiniteAgreement, InfOnOneRanksShardStopsEveryRankNamingItsTensor) {
  const auto errors = run_ranks(2, [&](int rank, replica::distributed::ProcessGroup& pg) {
    std::vector<torch::Tensor> shards = {torch::ones({4}), torch::ones({3, 2})};
    if (rank == 1) shards[1][2][0] = std::numeric_limits<float>::infinity();
    replica::train::require_finite_weights(shards, {"a.weight", "b.weight"}, pg, 12, "out/checkpoint-12");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r],
              "step 12: the trained weights hold NaN or Inf after the optimizer step (rank 1: 'b.weight'); "
              "out/checkpoint-12 is not written and the run stops (lower lr or max_grad_norm, or check the data)")
        << "rank " << r;
  }
}

// ---------------------------------------------------------------------------------------
// Whole runs.

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

std::vector<nlohmann::json> metrics_of(const fs::path& project) {
  std::vector<nlohmann::json> out;
  std::istringstream in(replica::testing::read_file(project / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

bool all_finite(const fs::path& model_file) {
  for (const auto& [name, t] : replica::testing::load_tensors(model_file)) {
    if (!torch::isfinite(t).all().item<bool>()) return false;
  }
  return true;
}

class NonfiniteRun : public replica::testing::ScratchDirTest {
 protected:
  NonfiniteRun() : ScratchDirTest("replica-nonfinite") {}
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    ASSERT_TRUE(fs::exists(fs::path(kFashionMnist) / "train-labels-idx1-ubyte.gz") ||
                fs::exists(fs::path(kFashionMnist) / "train-labels-idx1-ubyte"))
        << "Fashion-MNIST is not installed at " << kFashionMnist;
    ScratchDirTest::SetUp();
  }

  // A small SGD run on the MLP; `extra` flags over it.
  Result run(const std::string& project, const std::vector<std::string>& extra,
             const std::map<std::string, std::string>& env = {}) {
    std::ofstream(dir_ / "run.yaml") << "task: image-classification\nmodel: mlp\nlog: jsonl\n"
                                     << "data:\n  path: " << kFashionMnist << "\n  valid_split: null\n"
                                     << "params:\n  nproc_per_node: 1\n  batch_size: 16\n  optimizer: sgd\n"
                                     << "  momentum: 0.9\n  scheduler: constant\n  max_grad_norm: 0\n"
                                     << "  seed: 7\n  threads_per_worker: 1\n  checkpoint_every: 0\n"
                                     << "  logging_steps: 1\n  hidden_sizes: [16]\n";
    std::vector<std::string> args = {"--config", (dir_ / "run.yaml").string(), "--project-name",
                                     (dir_ / project).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return replica::testing::run_program(REPLICA_BIN, args, env, std::chrono::seconds(90));
  }
};

TEST_F(NonfiniteRun, NanLossStopsTheRunNamingTheStepAndSavesNothing) {
  const Result r = run("p", {"--lr", "1e30", "--max-steps", "4", "--checkpoint-every", "1"});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("error: step 2: the training loss is not finite (rank 0: nan in micro-batch 1 of 1); the run "
                       "stops before this step's update"),
            std::string::npos)
      << r;
  // Step 1 (finite) was checkpointed and logged; nothing after it.
  EXPECT_TRUE(all_finite(dir_ / "p" / "checkpoint-1" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "p" / "checkpoint-2"));
  EXPECT_FALSE(fs::exists(dir_ / "p" / "final"));
  const auto metrics = metrics_of(dir_ / "p");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_TRUE(std::isfinite(metrics[0].at("loss").get<double>()));
}

// Two workers through the launcher: both stop at the same step with the same message; none
// is left waiting in a collective (the runner's deadline would fail the test).
TEST_F(NonfiniteRun, EveryWorkerStopsAtTheSameStep) {
  const Result r = run("p", {"--lr", "1e30", "--max-steps", "4", "--nproc-per-node", "2", "--batch-size", "8"});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_FALSE(r.timed_out) << r;
  EXPECT_NE(r.all().find("step 2: the training loss is not finite (rank 0: nan in micro-batch 1 of 1; rank 1: nan"),
            std::string::npos)
      << r;
  EXPECT_FALSE(fs::exists(dir_ / "p" / "final"));
}

// The numbers of a step read during the next one (Note [the step's reads, a step late] in
// trainer.cpp; a GPU's default, forced here): the same stop at the same step on every worker,
// the same words but for what happened to the update, nothing of step 2 saved or logged.
TEST_F(NonfiniteRun, ReadingTheStepLateStopsAtTheSameStepAndSavesNothing) {
  const std::map<std::string, std::string> late = {{"REPLICA_STEP_READS", "late"}};
  const Result one = run("one", {"--lr", "1e30", "--max-steps", "4", "--checkpoint-every", "1"}, late);
  EXPECT_NE(one.exit_code, 0) << one;
  EXPECT_NE(one.err.find("error: step 2: the training loss is not finite (rank 0: nan in micro-batch 1 of 1); the "
                         "run stops (this step's update is not saved)"),
            std::string::npos)
      << one;
  EXPECT_TRUE(all_finite(dir_ / "one" / "checkpoint-1" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "one" / "checkpoint-2"));
  EXPECT_FALSE(fs::exists(dir_ / "one" / "final"));
  EXPECT_EQ(metrics_of(dir_ / "one").size(), 1u);
  const Result two = run("two", {"--lr", "1e30", "--max-steps", "4", "--nproc-per-node", "2", "--batch-size", "8"}, late);
  EXPECT_NE(two.exit_code, 0) << two;
  EXPECT_FALSE(two.timed_out) << two;
  EXPECT_NE(two.all().find("step 2: the training loss is not finite (rank 0: nan in micro-batch 1 of 1; rank 1: nan"),
            std::string::npos)
      << two;
  EXPECT_FALSE(fs::exists(dir_ / "two" / "final"));
  const Result bad = run("bad", {"--max-steps", "1"}, {{"REPLICA_STEP_READS", "soon"}});
  EXPECT_NE(bad.exit_code, 0) << bad;
  EXPECT_NE(bad.all().find("REPLICA_STEP_READS=soon is not late or now"), std::string::npos) << bad;
}

// A finite loss whose update overflows: the weights are Inf after step 1, caught before
// checkpoint-1 is written.
TEST_F(NonfiniteRun, AnUpdateThatOverflowsIsNeverSaved) {
  const Result r = run("p", {"--lr", "1e300", "--max-steps", "3", "--checkpoint-every", "1"});
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("error: step 1: the trained weights hold NaN or Inf after the optimizer step (rank 0: '"),
            std::string::npos)
      << r;
  EXPECT_FALSE(fs::exists(dir_ / "p" / "checkpoint-1"));
  EXPECT_FALSE(fs::exists(dir_ / "p" / "final"));
}

// nonfinite_loss: skip: the NaN steps take no update (the weights stay those after step 1,
// bit for bit), are counted and warned about, and their losses stay out of the metrics.
TEST_F(NonfiniteRun, SkipModeSkipsTheUpdateAndCountsTheSteps) {
  const Result one = run("one", {"--lr", "1e30", "--max-steps", "1"});
  ASSERT_EQ(one.exit_code, 0) << one;
  const Result r = run("p", {"--lr", "1e30", "--max-steps", "4", "--nonfinite-loss", "skip"});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("step 2: the training loss is not finite (rank 0: nan in micro-batch 1 of 1); step skipped "
                       "(nonfinite_loss: skip), 1 skipped so far"),
            std::string::npos)
      << r;
  EXPECT_NE(r.all().find("done: 4 steps (3 skipped for a NaN/Inf loss)"), std::string::npos) << r;
  using replica::testing::load_tensors;
  EXPECT_TRUE(replica::testing::bitwise_equal(load_tensors(dir_ / "one" / "final" / "model.safetensors"),
                                              load_tensors(dir_ / "p" / "final" / "model.safetensors")));
  const auto metrics = metrics_of(dir_ / "p");
  ASSERT_EQ(metrics.size(), 4u);
  EXPECT_TRUE(metrics[0].at("loss").is_number());
  EXPECT_FALSE(metrics[0].contains("skipped_steps"));
  for (int i = 1; i < 4; ++i) {
    EXPECT_TRUE(metrics[i].at("loss").is_null()) << metrics[i];
    EXPECT_EQ(metrics[i].at("skipped_steps"), i) << metrics[i];
  }
  EXPECT_EQ(nlohmann::json::parse(replica::testing::read_file(dir_ / "p" / "training_params.json"))
                .at("nonfinite_loss"),
            "skip");
}

}  // namespace
