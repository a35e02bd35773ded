// DeepSpeed's memory knobs through `replica --config` at world 2: every ZeRO stage trains the
// run plain DDP trains; offloading the optimizer state (and ZeRO-3's parameters) to files
// under nvme_path changes where the bytes live and nothing else; a DeepSpeed JSON config runs
// what the same keys run.
#include "replica/testing/program_runner.h"
#include "replica/testing/paths.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using replica::testing::bitwise_equal;
using replica::testing::load_tensors;
using replica::testing::max_abs_diff;
using replica::testing::Result;

namespace {

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

class ZeroStages : public replica::testing::ScratchDirTest {
 protected:
  ZeroStages() : ScratchDirTest("replica-zero") {}

  // An MLP run whose first layer (125,600 elements) is above stage3_param_persistence_threshold,
  // so ZeRO-3 gathers and frees it; AdamW with clipping and accumulation, so the optimizer state
  // and the global norm are both exercised. `params` adds or replaces params: keys.
  fs::path write_config(const std::string& name, const std::map<std::string, std::string>& params = {}) {
    std::map<std::string, std::string> p = {
        {"nproc_per_node", "2"},       {"max_steps", "12"},          {"batch_size", "8"},
        {"gradient_accumulation", "2"}, {"optimizer", "adamw"},      {"lr", "0.002"},
        {"scheduler", "constant"},     {"warmup_steps", "0"},        {"max_grad_norm", "1.0"},
        {"seed", "7"},                 {"threads_per_worker", "1"},  {"checkpoint_every", "6"},
        {"logging_steps", "1"},        {"hidden_sizes", "[160, 32]"}, {"shard_optimizer", "auto"},
    };
    for (const auto& [k, v] : params) p[k] = v;
    std::ostringstream y;
    y << "task: image-classification\nmodel: mlp\nlog: jsonl\nproject_name: " << (dir_ / name).string() << "\n"
      << "data:\n  path: " << kFashionMnist << "\n  train_split: train\n  valid_split: null\nparams:\n";
    for (const auto& [k, v] : p) y << "  " << k << ": " << v << "\n";
    const fs::path file = dir_ / (name + ".yaml");
    std::ofstream(file) << y.str();
    return file;
  }

  Result run(const fs::path& config, const std::vector<std::string>& extra = {}, bool expect_ok = true,
             const std::map<std::string, std::string>& env = {}) {
    std::vector<std::string> args = {"--config", config.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = replica::testing::run_program(REPLICA_BIN, args, env, std::chrono::seconds(120));
    if (expect_ok) EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  }

  std::map<std::string, torch::Tensor> final_model(const std::string& name) {
    return load_tensors(dir_ / name / "final" / "model.safetensors");
  }
};

TEST_F(ZeroStages, EveryStageTrainsWhatPlainDdpTrains) {
  run(write_config("ddp", {{"zero_stage", "0"}}));
  const Result one = run(write_config("stage1", {{"zero_stage", "1"}}));
  const Result two = run(write_config("stage2", {{"zero_stage", "2"}}));
  const Result three = run(write_config("stage3", {{"distributed_backend", "deepspeed"}}));
  if (HasFailure()) return;
  const auto ddp = final_model("ddp");
  EXPECT_LE(max_abs_diff(ddp, final_model("stage1")), 1e-6);
  EXPECT_LE(max_abs_diff(ddp, final_model("stage2")), 1e-6);
  EXPECT_LE(max_abs_diff(ddp, final_model("stage3")), 1e-5);
  // Each run says what it sharded.
  EXPECT_NE(one.all().find(" ZeRO stage 1,"), std::string::npos) << one;
  EXPECT_NE(two.all().find(" ZeRO stage 2,"), std::string::npos) << two;
  EXPECT_NE(three.all().find("backend zero3"), std::string::npos) << three;
  // Stages 1 and 2 write plain DDP's checkpoints: the full optimizer state.
  const auto state_ddp = load_tensors(dir_ / "ddp" / "checkpoint-12" / "optimizer.safetensors");
  const auto state_one = load_tensors(dir_ / "stage1" / "checkpoint-12" / "optimizer.safetensors");
  EXPECT_LE(max_abs_diff(state_ddp, state_one), 1e-6);
}

// Over Gloo (no shared-memory transport: how workers on different hosts talk) the sharded step
// and ZeRO-3 use the backend's own reduce-scatter and all-gather (Note [native reduce-scatter
// and all-gather] in c10d_compat.cpp): the same training as plain DDP.
TEST_F(ZeroStages, OverGlooTheNativeReduceScatterAndAllGatherTrainAsPlainDdp) {
  const std::map<std::string, std::string> gloo = {{"REPLICA_TRANSPORT", "gloo"}};
  run(write_config("ddp", {{"zero_stage", "0"}}), {}, true, gloo);
  run(write_config("stage2", {{"zero_stage", "2"}}), {}, true, gloo);
  run(write_config("stage3", {{"distributed_backend", "deepspeed"}}), {}, true, gloo);
  if (HasFailure()) return;
  const auto ddp = final_model("ddp");
  EXPECT_LE(max_abs_diff(ddp, final_model("stage2")), 1e-6);
  EXPECT_LE(max_abs_diff(ddp, final_model("stage3")), 1e-5);
}

// Note [optimizer offload] (optim.cpp): the same kernel on the same values, the state in files.
TEST_F(ZeroStages, NvmeOffloadEqualsTheInMemoryRun) {
  const fs::path swap = dir_ / "nvme";
  run(write_config("memory2", {{"zero_stage", "2"}}));
  const Result nvme2 = run(write_config("nvme2", {{"zero_stage", "2"}, {"offload_optimizer_device", "nvme"},
                                                  {"nvme_path", swap.string()}}));
  run(write_config("memory3", {{"distributed_backend", "deepspeed"}}));
  run(write_config("nvme3", {{"distributed_backend", "deepspeed"}, {"offload_optimizer_device", "nvme"},
                             {"offload_param_device", "nvme"}, {"nvme_path", swap.string()}}));
  if (HasFailure()) return;
  EXPECT_TRUE(bitwise_equal(final_model("memory2"), final_model("nvme2")))
      << max_abs_diff(final_model("memory2"), final_model("nvme2"));
  EXPECT_LE(max_abs_diff(final_model("memory3"), final_model("nvme3")), 1e-6);
  // Checkpoints are unchanged in format: the same optimizer state file.
  EXPECT_TRUE(bitwise_equal(load_tensors(dir_ / "memory2" / "checkpoint-12" / "optimizer.safetensors"),
                            load_tensors(dir_ / "nvme2" / "checkpoint-12" / "optimizer.safetensors")));
  // The swap files are unlinked once mapped: nothing is left behind.
  ASSERT_TRUE(fs::is_directory(swap));
  EXPECT_TRUE(fs::is_empty(swap));
  // And the nvme run resumes from its checkpoint to the same end.
  const fs::path cfg = write_config("resumed", {{"zero_stage", "2"}, {"offload_optimizer_device", "nvme"},
                                                {"nvme_path", swap.string()}, {"max_steps", "6"}});
  run(cfg);
  const Result resumed = run(cfg, {"--max-steps", "12"});
  if (HasFailure()) return;
  EXPECT_NE(resumed.all().find("resuming from"), std::string::npos) << resumed;
  EXPECT_TRUE(bitwise_equal(final_model("memory2"), final_model("resumed")));
}

TEST_F(ZeroStages, ADeepSpeedJsonConfigRunsWhatItsKeysRun) {
  const fs::path json = dir_ / "ds_config.json";
  std::ofstream(json) << R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
    "train_batch_size": "auto", "gradient_clipping": 1.0, "bf16": {"enabled": false},
    "zero_optimization": {"stage": 2, "contiguous_gradients": true, "overlap_comm": true}})";
  run(write_config("keys", {{"zero_stage", "2"}}));
  run(write_config("json", {{"deepspeed", json.string()}}));
  if (HasFailure()) return;
  EXPECT_TRUE(bitwise_equal(final_model("keys"), final_model("json")));

  // train_batch_size is checked once the number of workers is known: 8 x 2 x 2 = 32.
  std::ofstream(json) << R"({"train_micro_batch_size_per_gpu": 8, "train_batch_size": 64})";
  const Result r = run(write_config("mismatch", {{"deepspeed", json.string()}}), {}, false);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.all().find("train_batch_size is 64, but train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                         "x workers is 8 x 2 x 2 = 32"),
            std::string::npos)
      << r;
}

}  // namespace
