// The two-tower and ResNet workloads through the real `replica` program (REPLICA_BIN):
// synthetic recommender data written as MDS by `replica mds synthetic`, then training runs
// started as child processes (bounded by program_runner's deadline).
#include "replica/testing/program_runner.h"
#include "replica/testing/paths.h"
#include "replica/train/tests/tensor_files.h"
#include "replica/io/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using replica::testing::Result;
using replica::testing::run_program;

namespace {

using replica::testing::load_tensors;
using replica::testing::max_abs_diff;

Result replica_run(const std::vector<std::string>& args, std::chrono::seconds limit = std::chrono::seconds(120)) {
  return run_program(REPLICA_BIN, args, {}, limit);
}

std::vector<nlohmann::json> metrics_of(const fs::path& project) {
  std::vector<nlohmann::json> out;
  std::ifstream in(project / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

class Workloads : public replica::testing::ScratchDirTest {
 protected:
  Workloads() : ScratchDirTest("replica-workloads") {}
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    ScratchDirTest::SetUp();
  }

  // Writes the planted-cluster data set: 400 items in 20 clusters (random recall@10 = 0.025),
  // as MDS split directories or as <split>.jsonl files (the same interactions).
  fs::path synthetic_data(const std::string& format = "mds") {
    const fs::path data = dir_ / ("recsys-" + format);
    const Result r = replica_run({"mds", "synthetic", "--out", data.string(), "--users", "600", "--items", "400",
                                  "--clusters", "20", "--train", "12000", "--valid", "1000", "--seed", "3",
                                  "--format", format});
    EXPECT_EQ(r.exit_code, 0) << r;
    return data;
  }

  fs::path write_config(const std::string& name, const std::string& body) {
    const fs::path file = dir_ / (name + ".yaml");
    std::ofstream(file) << body;
    return file;
  }

  // A 2-worker ResNet-18 run on Fashion-MNIST without evaluation; `params` adds params: lines.
  std::string resnet_yaml(const std::string& params) {
    return "task: image-classification\nmodel: resnet18\nlog: jsonl\nproject_name: " + (dir_ / "u").string() +
           "\ndata:\n  path: /usr/share/datasets/fashion-mnist\n  valid_split: null\nparams:\n"
           "  nproc_per_node: 2\n  threads_per_worker: 1\n  seed: 1\n" +
           params;
  }

  std::string two_tower_yaml(const fs::path& data, const std::string& params,
                             const std::string& valid_split = "valid") {
    return "task: two-tower\nlog: jsonl\nproject_name: " + (dir_ / "unused").string() + "\ndata:\n  path: " +
           data.string() + "\n  train_split: train\n  valid_split: " + valid_split +
           "\nparams:\n  threads_per_worker: 1\n  checkpoint_every: 0\n"
           "  logging_steps: 1\n  seed: 5\n  lr: 0.005\n  scheduler: constant\n  embedding_dim: 16\n" +
           params;
  }

  Result train(const fs::path& config, const fs::path& project, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--config", config.string(), "--project-name", project.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = replica_run(args);
    EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  }

};

}  // namespace

// Trained on the planted clusters, the towers retrieve the held-out item far better than chance.
TEST_F(Workloads, TwoTowerRecallAt10IsFarAboveRandom) {
  const fs::path data = synthetic_data();
  const fs::path cfg = write_config("tt", two_tower_yaml(data, "  nproc_per_node: 2\n  batch_size: 64\n"
                                                                "  max_steps: 150\n  eval_every: 150\n"));
  train(cfg, dir_ / "tt", {});
  if (HasFailure()) return;
  double recall = -1, ndcg = -1;
  for (const auto& j : metrics_of(dir_ / "tt")) {
    if (j.contains("eval_recall_at_10")) {
      recall = j["eval_recall_at_10"].get<double>();
      ndcg = j["eval_ndcg_at_10"].get<double>();
      EXPECT_EQ(j["eval_samples"], 1000);
    }
  }
  const double random_recall = 10.0 / 400;
  EXPECT_GE(recall, 5 * random_recall) << "recall@10 " << recall;
  EXPECT_GT(ndcg, 0);
  EXPECT_LE(ndcg, recall);
  auto config = nlohmann::json::parse(std::ifstream(dir_ / "tt" / "final" / "config.json"));
  EXPECT_EQ(config["model_type"], "two-tower");
  EXPECT_EQ(config["user_features"], nlohmann::json({"user_segment"}));
  EXPECT_EQ(config["item_features"], nlohmann::json({"item_category"}));
}

// In-batch negatives span the global batch: 2 workers x 32 train exactly as 1 worker x 64.
TEST_F(Workloads, TwoTowerWorld2EqualsWorld1AtTheSameGlobalBatch) {
  const fs::path data = synthetic_data();
  const fs::path cfg = write_config("tt", two_tower_yaml(data, "  max_steps: 10\n  eval_every: 0\n"));
  train(cfg, dir_ / "one", {"--nproc-per-node", "1", "--batch-size", "64"});
  train(cfg, dir_ / "two", {"--nproc-per-node", "2", "--batch-size", "32"});
  if (HasFailure()) return;
  const auto a = load_tensors(dir_ / "one" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "two" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  // Summing the batch's gradient as 64 rows or as 2 x 32 rounds differently, and AdamW turns a
  // rounding difference in a near-zero gradient into one of up to lr (5e-3) per step. With the
  // MKL inside PyTorch's wheel that reaches 1.35e-5 after 10 steps (1.13's OpenBLAS: < 1e-5); a
  // negative set that did not span the global batch differs by > 1e-3.
  EXPECT_LE(max_abs_diff(a, b), 2e-5);
  // And the runs trained (the comparison is not between two untouched initialisations).
  std::vector<double> losses;
  for (const auto& j : metrics_of(dir_ / "two")) {
    if (j.contains("loss")) losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 10u);
  EXPECT_LT(losses.back(), losses.front());
}

TEST_F(Workloads, TwoTowerMissingSplitIsAnErrorNamingIt) {
  const fs::path data = dir_ / "empty";
  fs::create_directories(data);
  const fs::path cfg = write_config("tt", two_tower_yaml(data, "  max_steps: 1\n"));
  const Result r = replica_run({"--config", cfg.string(), "--project-name", (dir_ / "p").string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("split 'train'"), std::string::npos) << r;
}

// The CI version of the ResNet-18 run: 2 workers, SyncBatchNorm, augmentation; the loss falls.
TEST_F(Workloads, ResNet18LossFallsWithSyncBatchNormOnTwoWorkers) {
  const fs::path cfg = write_config(
      "resnet", resnet_yaml("  batch_size: 32\n  max_steps: 24\n  lr: 0.002\n  scheduler: constant\n"
                            "  sync_batchnorm: true\n  augment: true\n  checkpoint_every: 0\n  logging_steps: 1\n"));
  const Result r = train(cfg, dir_ / "resnet", {});
  if (HasFailure()) return;
  EXPECT_NE(r.all().find("2 workers"), std::string::npos) << r;
  std::vector<double> losses;
  for (const auto& j : metrics_of(dir_ / "resnet")) {
    if (j.contains("loss")) losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 24u);
  double first = 0, last = 0;
  for (int i = 0; i < 6; ++i) {
    first += losses[i] / 6;
    last += losses[losses.size() - 1 - i] / 6;
  }
  EXPECT_LT(last, 0.8 * first) << "first steps " << first << ", last steps " << last;
  auto config = nlohmann::json::parse(std::ifstream(dir_ / "resnet" / "final" / "config.json"));
  EXPECT_EQ(config["model_type"], "resnet18");
  const auto model = load_tensors(dir_ / "resnet" / "final" / "model.safetensors");
  EXPECT_TRUE(model.count("layer4.1.bn2.running_mean"));
}

// ZeRO-3 on ResNet-18 with SyncBatchNorm: sharded gradients and optimizer state, the same
// weights and BatchNorm statistics as DDP after 10 steps at the same global batch.
TEST_F(Workloads, ResNet18UnderZero3EqualsDdp) {
  const fs::path cfg = write_config(
      "resnet_z3", resnet_yaml("  batch_size: 16\n  max_steps: 10\n  optimizer: sgd\n  lr: 0.05\n"
                               "  scheduler: constant\n  max_grad_norm: 0\n  sync_batchnorm: true\n  augment: false\n"
                               "  checkpoint_every: 0\n  logging_steps: 5\n"));
  const Result ddp = train(cfg, dir_ / "ddp", {"--distributed-backend", "ddp"});
  const Result zero3 = train(cfg, dir_ / "zero3", {"--distributed-backend", "zero3"});
  if (HasFailure()) return;
  EXPECT_NE(zero3.all().find("backend zero3"), std::string::npos) << zero3;
  const auto a = load_tensors(dir_ / "ddp" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "zero3" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_LE(max_abs_diff(a, b), 1e-5);
  EXPECT_TRUE(a.count("layer4.1.bn2.running_mean"));
}

// gradient_checkpointing on ResNet-18 (every stage recomputed in backward), 2 workers with
// SyncBatchNorm: the same weights and BatchNorm statistics as without it.
TEST_F(Workloads, ResNet18GradientCheckpointingTrainsAsWithout) {
  const fs::path cfg = write_config(
      "resnet_ckpt", resnet_yaml("  batch_size: 16\n  max_steps: 5\n  optimizer: sgd\n  lr: 0.05\n"
                                 "  scheduler: constant\n  max_grad_norm: 0\n  sync_batchnorm: true\n  augment: false\n"
                                 "  checkpoint_every: 0\n  logging_steps: 5\n"));
  train(cfg, dir_ / "plain", {});
  train(cfg, dir_ / "ckpt", {"--gradient-checkpointing", "true"});
  if (HasFailure()) return;
  const auto params = nlohmann::json::parse(std::ifstream(dir_ / "ckpt" / "training_params.json"));
  EXPECT_EQ(params.at("gradient_checkpointing"), true);
  const auto a = load_tensors(dir_ / "plain" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "ckpt" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_LE(max_abs_diff(a, b), 1e-6);
  ASSERT_TRUE(b.count("layer2.0.bn1.num_batches_tracked"));
  EXPECT_EQ(b.at("layer2.0.bn1.num_batches_tracked").item<int64_t>(), 5);  // once per step
}

// Mid-epoch resume on MDS data: a run stopped at its step-6 checkpoint and started again ends
// exactly where the straight run ends (same samples from the same place in the epoch).
TEST_F(Workloads, TwoTowerResumesMidEpochExactly) {
  const fs::path data = synthetic_data();
  const fs::path cfg = write_config("tt", two_tower_yaml(data, "  nproc_per_node: 2\n  batch_size: 32\n"
                                                                "  eval_every: 0\n"));
  train(cfg, dir_ / "a", {"--max-steps", "12", "--checkpoint-every", "6"});
  train(cfg, dir_ / "b", {"--max-steps", "6", "--checkpoint-every", "6"});
  const Result resumed = train(cfg, dir_ / "b", {"--max-steps", "12", "--checkpoint-every", "6"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  const auto a = load_tensors(dir_ / "a" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "b" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
}

// The same interactions as JSONL (`replica mds synthetic --format jsonl`) and as MDS: the
// two runs see the same columns, shards and batches, so they log the same losses and
// evaluation and end with the same weights, bit for bit.
TEST_F(Workloads, TwoTowerOnJsonlTrainsExactlyAsOnMds) {
  const fs::path mds = synthetic_data("mds");
  const fs::path jsonl = synthetic_data("jsonl");
  ASSERT_TRUE(fs::exists(jsonl / "train.jsonl"));
  ASSERT_TRUE(fs::exists(jsonl / "valid.jsonl"));
  const std::string params = "  nproc_per_node: 2\n  batch_size: 32\n  max_steps: 8\n  eval_every: 8\n";
  train(write_config("mds", two_tower_yaml(mds, params)), dir_ / "mds", {});
  train(write_config("jsonl", two_tower_yaml(jsonl, params)), dir_ / "jsonl", {});
  if (HasFailure()) return;
  const auto a = load_tensors(dir_ / "mds" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "jsonl" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
  auto logged = [](const fs::path& project) {
    std::vector<nlohmann::json> out;
    for (auto j : metrics_of(project)) {
      for (const char* timing : {"samples_per_s", "tokens_per_s", "time_compute_s", "time_comm_wait_s",
                                 "time_data_wait_s", "time_optimizer_s"}) {
        j.erase(timing);
      }
      out.push_back(j);
    }
    return out;
  };
  const auto ma = logged(dir_ / "mds"), mb = logged(dir_ / "jsonl");
  ASSERT_EQ(ma.size(), mb.size());
  int losses = 0, evals = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i], mb[i]) << "metrics line " << i + 1;
    losses += ma[i].contains("loss");
    evals += ma[i].contains("eval_recall_at_10");
  }
  EXPECT_EQ(losses, 8);
  EXPECT_EQ(evals, 1);
  auto config = nlohmann::json::parse(std::ifstream(dir_ / "jsonl" / "final" / "config.json"));
  EXPECT_EQ(config["user_features"], nlohmann::json({"user_segment"}));
  EXPECT_EQ(config["item_features"], nlohmann::json({"item_category"}));
}

// data.path may be one .jsonl file: the training split, with evaluation off.
TEST_F(Workloads, TwoTowerTrainsOnOneJsonlFile) {
  const fs::path file = dir_ / "events.jsonl";
  std::ofstream out(file);
  for (int i = 0; i < 64; ++i) {
    out << nlohmann::json{{"user_id", i % 16}, {"item_id", (i * 7) % 24}, {"item_category", i % 3}}.dump() << "\n";
  }
  out.close();
  const std::string params = "  nproc_per_node: 2\n  batch_size: 8\n  max_steps: 3\n";
  const Result with_valid = replica_run({"--config", write_config("v", two_tower_yaml(file, params)).string(),
                                         "--project-name", (dir_ / "v").string()});
  EXPECT_NE(with_valid.exit_code, 0);
  EXPECT_NE(with_valid.err.find("events.jsonl' is one file"), std::string::npos) << with_valid;
  EXPECT_NE(with_valid.err.find("data.valid_split: null"), std::string::npos) << with_valid;
  train(write_config("file", two_tower_yaml(file, params, "null")), dir_ / "file", {});
  if (HasFailure()) return;
  auto config = nlohmann::json::parse(std::ifstream(dir_ / "file" / "final" / "config.json"));
  EXPECT_EQ(config["num_users"], 16);
  EXPECT_EQ(config["num_items"], 24);
  EXPECT_EQ(config["item_features"], nlohmann::json({"item_category"}));
}

// Each bad line of a JSONL split stops the run before any worker starts, with an error
// naming the file, the line and the key.
TEST_F(Workloads, TwoTowerBadJsonlLinesAreErrorsNamingFileLineAndKey) {
  const fs::path data = dir_ / "bad";
  fs::create_directories(data);
  const std::string good = "{\"user_id\": 1, \"item_id\": 2, \"user_segment\": 0}\n"
                           "{\"user_id\": 3, \"item_id\": 4, \"user_segment\": 1}\n";
  std::ofstream(data / "valid.jsonl") << good;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"user_id": "u7", "item_id": 2, "user_segment": 0})",
       "train.jsonl:4: key 'user_id': \"u7\" is not an integer id"},
      {R"({"user_id": 1.5, "item_id": 2, "user_segment": 0})", "train.jsonl:4: key 'user_id': 1.5 is not an integer id"},
      {R"({"user_id": 1, "user_segment": 0})",
       "train.jsonl:4: key 'item_id' (data.column_mapping.item_column) is missing"},
      {R"({"user_id": 1, "item_id": 2})", "train.jsonl:4: key 'user_segment' (a feature column of the training split) "
                                          "is missing"},
      {R"({"user_id": -3, "item_id": 2, "user_segment": 0})", "train.jsonl:4: key 'user_id': id -3 is out of range"},
      {R"({"user_id": 1, "item_id": 99999999999, "user_segment": 0})",
       "train.jsonl:4: key 'item_id': id 99999999999 is out of range"},
  };
  const fs::path cfg = write_config("bad", two_tower_yaml(data, "  nproc_per_node: 2\n  max_steps: 1\n"));
  for (const auto& [line, expected] : cases) {
    std::ofstream(data / "train.jsonl") << good << "\n" << line << "\n";
    const Result r = replica_run({"--config", cfg.string(), "--project-name", (dir_ / "p").string()});
    EXPECT_NE(r.exit_code, 0) << line;
    EXPECT_NE(r.err.find((data / expected).string()), std::string::npos) << "expected: " << expected << "\n" << r;
    EXPECT_EQ(r.all().find("rank 0"), std::string::npos) << "a worker started\n" << r;
  }
  // The validation split is read with the training split's columns.
  std::ofstream(data / "train.jsonl") << good;
  std::ofstream(data / "valid.jsonl") << "{\"user_id\": 1, \"item_id\": 2}\n";
  const Result r = replica_run({"--config", cfg.string(), "--project-name", (dir_ / "p").string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find((data / "valid.jsonl").string() + ":1: key 'user_segment'"), std::string::npos) << r;
}

// Augmentation draws are checkpointed: a ResNet-18 run with random crops and flips, stopped
// at its step-3 checkpoint mid-epoch and started again, ends bit for bit where the straight
// run ends, and logs the same losses after the resume.
TEST_F(Workloads, ResNet18AugmentedResumesMidEpochExactly) {
  const fs::path cfg = write_config(
      "resnet_resume", resnet_yaml("  batch_size: 8\n  lr: 0.002\n  scheduler: constant\n  augment: true\n"
                                   "  deterministic: true\n  checkpoint_every: 3\n  logging_steps: 1\n"));
  train(cfg, dir_ / "a", {"--max-steps", "6"});
  train(cfg, dir_ / "b", {"--max-steps", "3"});
  const Result resumed = train(cfg, dir_ / "b", {"--max-steps", "6"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  const auto a = load_tensors(dir_ / "a" / "final" / "model.safetensors");
  const auto b = load_tensors(dir_ / "b" / "final" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  auto losses = [](const fs::path& project) {
    std::vector<double> out;
    for (const auto& j : metrics_of(project)) {
      if (j.contains("loss")) out.push_back(j["loss"].get<double>());
    }
    return out;
  };
  const auto la = losses(dir_ / "a"), lb = losses(dir_ / "b");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
}
