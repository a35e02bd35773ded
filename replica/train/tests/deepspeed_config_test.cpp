// The ZeRO keys (zero_stage, offload_*, nvme_path) and `deepspeed: ds_config.json`: what each
// field becomes, "auto", conflicts with the YAML file, and the errors naming a field.
#include "replica/core/error.h"
#include "replica/testing/program_runner.h"
#include "replica/train/run_config.h"
#include "replica/train/tests/parse_error.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <tuple>

namespace fs = std::filesystem;
using namespace replica::train;
using replica::train::testing::parse_error_of;

namespace {

class DeepSpeedConfig : public replica::testing::ScratchDirTest {
 protected:
  DeepSpeedConfig() : ScratchDirTest("replica-ds") {}
  void SetUp() override {
    ScratchDirTest::SetUp();
    fs::create_directories(dir_ / "data");
  }

  std::string write_json(const std::string& text, const std::string& name = "ds_config.json") const {
    const fs::path file = dir_ / name;
    std::ofstream(file) << text;
    return file.string();
  }

  // An image-classification config; `params_lines` go on from line 6, under params:.
  std::string yaml(const std::string& params_lines) const {
    return fmt::format(
        "task: image-classification\n"
        "project_name: out/run\n"
        "data:\n"
        "  path: {}\n"
        "params:\n"
        "{}",
        (dir_ / "data").string(), params_lines);
  }

  static std::string error_of(const std::string& text) { return parse_error_of(text); }
};

// The ZeRO-3 config of the transformers documentation (with offload), as users have it.
constexpr const char* kTransformersZero3 = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

TEST_F(DeepSpeedConfig, ZeroStageFollowsTheBackendUnlessGiven) {
  EXPECT_EQ(zero_stage_of(parse_config(yaml("  distributed_backend: ddp\n"), "run.yaml").params), 0);
  EXPECT_EQ(zero_stage_of(parse_config(yaml("  distributed_backend: deepspeed\n"), "run.yaml").params), 3);
  EXPECT_EQ(zero_stage_of(parse_config(yaml("  distributed_backend: deepspeed\n  zero_stage: 2\n"), "run.yaml").params), 2);
  EXPECT_EQ(zero_stage_of(parse_config(yaml("  zero_stage: 1\n"), "run.yaml").params), 1);
  EXPECT_EQ(parse_config(yaml("  zero_stage: auto\n"), "run.yaml").params.zero_stage, -1);
}

TEST_F(DeepSpeedConfig, ContradictoryZeroKeysAreErrorsNamingThem) {
  EXPECT_NE(error_of(yaml("  zero_stage: 4\n")).find("run.yaml:6: key 'params.zero_stage' must be 0, 1, 2, 3 or 'auto'"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("  distributed_backend: ddp\n  zero_stage: 3\n")).find("distributed_backend: deepspeed"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("  zero_stage: 2\n  shard_optimizer: false\n"))
                .find("run.yaml:7: key 'params.shard_optimizer' is false but zero_stage 2 shards"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("  zero_stage: 2\n  offload_param_device: cpu\n"))
                .find("run.yaml:7: key 'params.offload_param_device' needs zero_stage 3"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("  offload_optimizer_device: cpu\n")).find("needs zero_stage 1, 2 or 3"), std::string::npos);
  EXPECT_NE(error_of(yaml("  zero_stage: 1\n  offload_optimizer_device: nvme\n")).find("needs params.nvme_path"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("  nvme_path: /tmp\n")).find("'params.nvme_path' is used only with"), std::string::npos);
  EXPECT_NE(error_of(yaml("  zero_stage: 1\n  offload_optimizer_device: disk\n"))
                .find("key 'params.offload_optimizer_device' must be one of none, cpu, nvme, got 'disk'"),
            std::string::npos);
}

TEST_F(DeepSpeedConfig, TheTransformersZero3ExampleReadsIntoTheKeys) {
  const std::string file = write_json(kTransformersZero3);
  const RunConfig c = parse_config(yaml(fmt::format("  deepspeed: {}\n  lr: 0.002\n", file)), "run.yaml");
  const RunConfig plain = parse_config(yaml("  lr: 0.002\n"), "run.yaml");
  EXPECT_EQ(c.params.distributed_backend, DistributedBackend::Zero3);
  EXPECT_EQ(zero_stage_of(c.params), 3);
  EXPECT_EQ(c.params.offload_optimizer_device, OffloadDevice::Cpu);
  EXPECT_EQ(c.params.offload_param_device, OffloadDevice::Cpu);
  EXPECT_EQ(c.params.stage3_max_live_parameters, 1e9);
  EXPECT_EQ(c.params.stage3_max_reuse_distance, 1e9);
  // "auto" leaves replica's values.
  EXPECT_EQ(c.params.lr, 0.002);
  EXPECT_EQ(c.params.batch_size, plain.params.batch_size);
  EXPECT_EQ(c.params.gradient_accumulation, plain.params.gradient_accumulation);
  EXPECT_EQ(c.params.max_grad_norm, plain.params.max_grad_norm);
  EXPECT_EQ(c.params.mixed_precision, Precision::Fp32);
  EXPECT_EQ(c.params.stage3_prefetch_bucket_size, plain.params.stage3_prefetch_bucket_size);
  EXPECT_EQ(c.params.scheduler, SchedulerKind::ConstantWithWarmup);  // WarmupLR
  EXPECT_EQ(c.params.optimizer, OptimizerKind::AdamW);
  // config.yaml (to_yaml) reads back to the same run, the JSON read again.
  EXPECT_EQ(parse_config(to_yaml(c), "config.yaml"), c);
}

TEST_F(DeepSpeedConfig, NumbersBecomeTheKeys) {
  const std::string file = write_json(R"({
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "train_batch_size": 64,
    "gradient_clipping": 0.5, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                          "reduce_bucket_size": 2e8, "overlap_comm": false}})");
  const RunConfig c = parse_config(yaml(fmt::format("  deepspeed: {}\n", file)), "run.yaml");
  EXPECT_EQ(c.params.batch_size, 8);
  EXPECT_EQ(c.params.gradient_accumulation, 4);
  EXPECT_EQ(c.params.deepspeed_train_batch_size, 64);
  EXPECT_EQ(c.params.max_grad_norm, 0.5);
  EXPECT_EQ(c.params.mixed_precision, Precision::Bf16);
  EXPECT_EQ(c.params.lr, 3e-4);
  EXPECT_EQ(c.params.weight_decay, 0.01);
  EXPECT_EQ(c.params.scheduler, SchedulerKind::Linear);
  EXPECT_EQ(c.params.warmup_steps, 10);
  EXPECT_EQ(zero_stage_of(c.params), 2);
  EXPECT_EQ(c.params.distributed_backend, DistributedBackend::Ddp);
  EXPECT_EQ(c.params.offload_optimizer_device, OffloadDevice::Nvme);
  EXPECT_EQ(c.params.nvme_path, "/local_nvme");
  EXPECT_EQ(c.params.reduce_bucket_size, 2e8);
  EXPECT_FALSE(c.params.overlap_comm);
}

TEST_F(DeepSpeedConfig, UnimplementedFieldsAreErrorsNamingThem) {
  const auto error_for = [&](const std::string& json) {
    return error_of(yaml(fmt::format("  deepspeed: {}\n", write_json(json))));
  };
  EXPECT_NE(error_for(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x",
                          "buffer_count": 5}}})")
                .find("field 'zero_optimization.offload_param.buffer_count' is not implemented by replica"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"activation_checkpointing": {"partition_activations": true}})")
                .find("field 'activation_checkpointing' is not implemented"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"optimizer": {"type": "Lamb"}})").find("optimizer.type 'Lamb' is not implemented"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}})")
                .find("field 'optimizer.params.betas' is [0.9, 0.95]; replica supports only [0.9, 0.999]"),
            std::string::npos);
  EXPECT_NE(error_for(R"({"zero_optimization": {"stage": 5}})").find("must be 0, 1, 2 or 3, got 5"), std::string::npos);
  EXPECT_NE(error_for(R"({"train_micro_batch_size_per_gpu": "eight"})")
                .find("field 'train_micro_batch_size_per_gpu' must be a number or \"auto\""),
            std::string::npos);
  EXPECT_NE(error_for(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})").find("both true"),
            std::string::npos);
  // The fp16 scaler's fields matter when fp16 is on: replica's scaler is not DeepSpeed's default.
  EXPECT_NE(error_for(R"({"fp16": {"enabled": true, "loss_scale_window": 1000}})")
                .find("field 'fp16.loss_scale_window' is 1000; replica supports only 2000"),
            std::string::npos);
  EXPECT_NE(error_for("{ not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(yaml("  deepspeed: /no/such/ds.json\n")).find("run.yaml:6: key 'params.deepspeed'"),
            std::string::npos);
}

TEST_F(DeepSpeedConfig, AValueTheYamlFileAlsoGivesMustAgree) {
  const std::string file = write_json(R"({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}})");
  // The same value twice is fine.
  EXPECT_EQ(parse_config(yaml(fmt::format("  deepspeed: {}\n  batch_size: 8\n", file)), "run.yaml").params.batch_size, 8);
  const std::string e = error_of(yaml(fmt::format("  deepspeed: {}\n  batch_size: 16\n", file)));
  EXPECT_NE(e.find("field 'train_micro_batch_size_per_gpu' is 8 but run.yaml:7: key 'params.batch_size' is 16"),
            std::string::npos)
      << e;
  EXPECT_NE(error_of(yaml(fmt::format("  deepspeed: {}\n  zero_stage: 1\n", file))).find("zero_optimization.stage"),
            std::string::npos);
}


// Every number the file gives is range-checked as a double before it is narrowed, and the
// message names the field and the file (before: "key 'params.batch_size' must be >= 1, got
// -1486618624", naming neither).
TEST_F(DeepSpeedConfig, NumbersOutOfRangeAreRefusedNamingTheFieldAndTheFile) {
  const auto error_for = [&](const std::string& json) {
    const std::string file = write_json(json);
    return std::make_pair(error_of(yaml(fmt::format("  deepspeed: {}\n", file))), file);
  };
  auto [e, file] = error_for(R"({"train_micro_batch_size_per_gpu": 1e18})");
  EXPECT_EQ(e, file + ": field 'train_micro_batch_size_per_gpu' must be an integer from 1 to 2147483647, got "
                      "1e+18");
  std::tie(e, file) = error_for(R"({"gradient_accumulation_steps": 4294967297})");
  EXPECT_EQ(e, file + ": field 'gradient_accumulation_steps' must be an integer from 1 to 2147483647, got 4294967297");
  std::tie(e, file) = error_for(R"({"train_batch_size": 18446744073709551615})");
  EXPECT_EQ(e.rfind(file + ": field 'train_batch_size' must be an integer from 1 to 9007199254740992, got ", 0), 0u)
      << e;
  std::tie(e, file) = error_for(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e300}}})");
  EXPECT_EQ(e.rfind(file + ": field 'scheduler.params.warmup_num_steps' must be an integer from 0 to ", 0), 0u) << e;
  std::tie(e, file) = error_for(R"({"zero_optimization": {"stage": 1e18}})");
  EXPECT_EQ(e, file + ": field 'zero_optimization.stage' must be an integer from 0 to 2147483647, got 1e+18");
}

TEST_F(DeepSpeedConfig, AFileNestedAMillionDeepOrAFifoIsRefusedNamingIt) {
  const std::string deep = write_json(R"({"optimizer": )" + std::string(1000000, '[') + std::string(1000000, ']') + "}");
  EXPECT_EQ(error_of(yaml(fmt::format("  deepspeed: {}\n", deep))), deep + ": JSON nested more than 128 levels deep");
  // A FIFO: refused at once (before: read_file's open waited for a writer).
  const std::string fifo = (dir_ / "fifo.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of(yaml(fmt::format("  deepspeed: {}\n", fifo))).find("is a FIFO (named pipe), not a regular file"),
            std::string::npos);
  // A long or deep value in a message is an excerpt.
  const std::string long_value = write_json(R"({"optimizer": {"type": ")" + std::string(1 << 20, 'x') + R"("}})");
  EXPECT_LT(error_of(yaml(fmt::format("  deepspeed: {}\n", long_value))).size(), 400u);
}

}  // namespace
