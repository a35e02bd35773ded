// The trainer on a GPU (CTest label `gpu`), through the real `replica` program. Every test
// skips, saying why, where this process sees no GPU (CI): the suite is compiled and linked on
// every machine and runs where one is (scripts/gpu_check.sh).
//   - DDP at world 1 on cuda:0 (two-tower) ends with the CPU run's weights, within
//     float tolerance (different kernels, same arithmetic);
//   - LoRA SFT of the demo Llama in bf16 on CUDA trains: the loss falls;
//   - `replica env` names the GPU.
#include "replica/core/cuda.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using replica::testing::Result;
using replica::testing::run_program;

namespace {

#define REPLICA_SKIP_WITHOUT_GPU()                                                                       \
  if (replica::visible_gpu_count() == 0) {                                                               \
    GTEST_SKIP() << "no GPU visible to this process (CUDA_VISIBLE_DEVICES, driver): GPU tests run where " \
                    "one is (scripts/gpu_check.sh)";                                                     \
  }

class Gpu : public replica::testing::ScratchDirTest {
 protected:
  Gpu() : ScratchDirTest("replica-gpu") {}
  // REPLICA_TEST_BIN: the binary to run where the tests run from a bundle on another machine
  // (scripts/gpu_check.sh); else the build tree's.
  Result replica(const std::vector<std::string>& args) {
    const char* bin = std::getenv("REPLICA_TEST_BIN");
    return run_program(bin != nullptr ? bin : REPLICA_BIN, args, {}, std::chrono::seconds(300));
  }
};

TEST_F(Gpu, DdpOnCudaEndsWithTheCpuRunsWeights) {
  REPLICA_SKIP_WITHOUT_GPU();
  // The two-tower recommender on synthetic shards: data made here, nothing to carry.
  const fs::path data = dir_ / "recsys";
  ASSERT_EQ(replica({"mds", "synthetic", "--out", data.string(), "--users", "300", "--items", "200", "--clusters",
                     "10", "--train", "4000", "--valid", "200", "--seed", "3"})
                .exit_code,
            0);
  const fs::path yaml = dir_ / "tt.yaml";
  std::ofstream(yaml) << "task: two-tower\nlog: jsonl\nproject_name: unused\ndata:\n  path: " << data.string()
                      << "\n  valid_split: null\nparams:\n  optimizer: sgd\n  lr: 0.05\n  scheduler: constant\n"
                         "  seed: 3\n  max_steps: 20\n  batch_size: 64\n  checkpoint_every: 0\n";
  for (const char* device : {"cpu", "cuda"}) {
    const Result r = replica({"--config", yaml.string(), "--device", device, "--nproc-per-node", "1",
                              "--project-name", (dir_ / device).string()});
    ASSERT_EQ(r.exit_code, 0) << r;
  }
  const auto cpu = replica::testing::load_tensors(dir_ / "cpu" / "final" / "model.safetensors");
  const auto cuda = replica::testing::load_tensors(dir_ / "cuda" / "final" / "model.safetensors");
  ASSERT_EQ(cpu.size(), cuda.size());
  for (const auto& [name, t] : cpu) {
    EXPECT_TRUE(torch::allclose(t, cuda.at(name), 1e-4, 1e-5)) << name;
  }
}

TEST_F(Gpu, LoraSftInBf16OnCudaTrains) {
  REPLICA_SKIP_WITHOUT_GPU();
  const fs::path demo = dir_ / "demo";
  ASSERT_EQ(replica({"llm", "init-demo", demo.string()}).exit_code, 0);
  const fs::path project = dir_ / "sft";
  const Result r = replica({"llm", "--train", "--model", (demo / "model").string(), "--data-path",
                            (demo / "data").string(), "--project-name", project.string(), "--trainer", "sft",
                            "--peft", "--mixed-precision", "bf16", "--device", "cuda", "--nproc-per-node", "1",
                            "--lr", "2e-3", "--max-steps", "30", "--logging-steps", "1", "--block-size", "128"});
  ASSERT_EQ(r.exit_code, 0) << r;
  std::vector<double> losses;
  std::ifstream in(project / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses.push_back(j["loss"].get<double>());
  }
  ASSERT_GE(losses.size(), 10u);
  EXPECT_LT(losses.back(), 0.8 * losses.front()) << "the loss did not fall";
}

TEST_F(Gpu, EnvNamesEachGpu) {
  REPLICA_SKIP_WITHOUT_GPU();
  const Result r = replica({"env", "--format", "json"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["gpus"]["device_count"].get<int>(), replica::visible_gpu_count());
  ASSERT_FALSE(j["gpus"]["devices"].empty());
  EXPECT_FALSE(j["gpus"]["devices"][0]["name"].get<std::string>().empty());
  EXPECT_FALSE(j["gpus"]["nccl"].get<std::string>().empty());
}

}  // namespace
