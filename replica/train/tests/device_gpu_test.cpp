// The trainer on a GPU (CTest label `gpu`), through the real `replica` program. Every test
// skips, saying why, where this process sees no GPU (CI): the suite is compiled and linked on
// every machine and runs where one is (scripts/gpu_check.sh).
//   - DDP and ZeRO-3 (masters on the device, and offloaded to the host) at world 1 on cuda:0
//     (two-tower) end with the CPU run's weights, within float tolerance (different kernels,
//     same arithmetic);
//   - world 2 sharing one GPU over Gloo (ddp_backend gloo) equals world 1 at the same global
//     batch, DDP and ZeRO-3;
//   - LoRA SFT of the demo Llama in bf16 on CUDA trains: the loss falls;
//   - `replica env` names the GPU.
#include "replica/core/cuda.h"
#include "replica/testing/gpu_skip.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace fs = std::filesystem;
using replica::testing::Result;
using replica::testing::run_program;

namespace {

class Gpu : public replica::testing::ScratchDirTest {
 public:
  Gpu() : ScratchDirTest("replica-gpu") {}
  // REPLICA_BIN: the build tree's program, or the bundle's where REPLICA_TEST_BIN names it
  // (replica/testing/paths.cpp). Two minutes bound each run: the longest here takes seconds on
  // a GPU, and a hang must not eat a GPU check's device time.
  Result replica(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {}) {
    return run_program(REPLICA_BIN, args, env, std::chrono::seconds(120));
  }
};

// The two-tower recommender on synthetic shards (data made here, nothing to carry), 20 SGD
// steps, run as `a` and as `b` (extra arguments over the same YAML, each naming device and
// workers): both end with the same weights within float tolerance (different kernels or
// reduction orders, same arithmetic).
void expect_runs_end_alike(Gpu& test, const fs::path& dir, const std::vector<std::string>& a,
                           const std::vector<std::string>& b, const std::map<std::string, std::string>& env = {}) {
  const fs::path data = dir / "recsys";
  if (!fs::exists(data)) {
    ASSERT_EQ(test.replica({"mds", "synthetic", "--out", data.string(), "--users", "300", "--items", "200",
                            "--clusters", "10", "--train", "4000", "--valid", "200", "--seed", "3"})
                  .exit_code,
              0);
  }
  const fs::path yaml = dir / "tt.yaml";
  std::ofstream(yaml) << "task: two-tower\nlog: jsonl\nproject_name: unused\ndata:\n  path: " << data.string()
                      << "\n  valid_split: null\nparams:\n  optimizer: sgd\n  lr: 0.05\n  scheduler: constant\n"
                         "  seed: 3\n  max_steps: 20\n  batch_size: 64\n  checkpoint_every: 0\n";
  std::vector<fs::path> finals;
  for (const auto* extra : {&a, &b}) {
    std::string tag;
    for (const auto& x : *extra) tag += x;
    std::vector<std::string> args{"--config", yaml.string(), "--project-name", (dir / tag).string()};
    args.insert(args.end(), extra->begin(), extra->end());
    const Result r = test.replica(args, env);
    ASSERT_EQ(r.exit_code, 0) << r;
    finals.push_back(dir / tag / "final" / "model.safetensors");
  }
  const auto first = replica::testing::load_tensors(finals[0]);
  const auto second = replica::testing::load_tensors(finals[1]);
  ASSERT_EQ(first.size(), second.size());
  for (const auto& [name, t] : first) {
    EXPECT_TRUE(torch::allclose(t, second.at(name), 1e-4, 1e-5)) << name;
  }
}

// At world 1: the CPU run and the cuda:0 run, with the same extra arguments.
void expect_cuda_run_equals_cpu_run(Gpu& test, const fs::path& dir, std::vector<std::string> extra) {
  extra.insert(extra.end(), {"--nproc-per-node", "1", "--device"});
  auto cpu = extra, cuda = extra;
  cpu.push_back("cpu");
  cuda.push_back("cuda");
  expect_runs_end_alike(test, dir, cpu, cuda);
}

TEST_F(Gpu, DdpOnCudaEndsWithTheCpuRunsWeights) {
  REPLICA_SKIP_WITHOUT_GPU();
  expect_cuda_run_equals_cpu_run(*this, dir_, {});
}

// ZeRO-3 with its flat buffers, gathers and masters on cuda:0 (Note [ZeRO-3 on the device]),
// and with the masters offloaded to pinned host memory (offload_param_device cpu).
TEST_F(Gpu, Zero3OnCudaEndsWithTheCpuRunsWeights) {
  REPLICA_SKIP_WITHOUT_GPU();
  expect_cuda_run_equals_cpu_run(*this, dir_, {"--distributed-backend", "zero3"});
  expect_cuda_run_equals_cpu_run(*this, dir_, {"--distributed-backend", "zero3", "--offload-param-device", "cpu"});
}

// World 2 on one GPU (NCCL refuses two ranks on one device, so ddp_backend gloo: Gloo moves the
// CUDA tensors through the host) equals world 1 at the same global batch, under DDP and ZeRO-3.
TEST_F(Gpu, TwoWorkersSharingOneGpuOverGlooEqualWorldOne) {
  REPLICA_SKIP_WITHOUT_GPU();
  for (const char* backend : {"ddp", "zero3"}) {
    SCOPED_TRACE(backend);
    expect_runs_end_alike(*this, dir_,
                          {"--distributed-backend", backend, "--device", "cuda", "--nproc-per-node", "1",
                           "--batch-size", "64"},
                          {"--distributed-backend", backend, "--device", "cuda", "--nproc-per-node", "2",
                           "--batch-size", "32", "--ddp-backend", "gloo"},
                          {{"CUDA_VISIBLE_DEVICES", "0"}});  // one GPU, whatever the machine has
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
