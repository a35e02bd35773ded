// The 8-bit AdamW (optim_8bit.h) and Adafactor (adafactor.h) beyond their referees
// (optimizers_conformance_test.cpp): state size, the paged choice, checkpoint round trips that
// continue bit for bit, re-cut 8-bit state, and the config keys that name them.
#include "replica/core/error.h"
#include "replica/testing/referee.h"
#include "replica/train/adafactor.h"
#include "replica/train/optim.h"
#include "replica/train/optim_8bit.h"
#include "replica/train/run_config.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using replica::train::OptimizerKind;
using replica::train::OptimizerSpec;

namespace {

std::vector<torch::Tensor> leaves(const std::vector<torch::Tensor>& values) {
  std::vector<torch::Tensor> out;
  for (const auto& v : values) out.push_back(v.detach().clone().set_requires_grad(true));
  return out;
}

// `steps` steps with gradients drawn from `seed`.
void run_steps(torch::optim::Optimizer& opt, std::vector<torch::Tensor>& params, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int s = 0; s < steps; ++s) {
    for (auto& p : params) p.mutable_grad() = torch::randn(p.sizes()) * (1.0 + s);
    opt.step();
  }
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

TEST(Optim8bit, StateIsAQuarterOfAdamWs) {
  const auto w = torch::randn({1024, 1024});
  auto a = leaves({w}), b = leaves({w});
  auto adamw = replica::train::make_optimizer({OptimizerKind::AdamW, 1e-3, 0.9, 0.0}, a);
  auto eight = replica::train::make_optimizer({OptimizerKind::AdamW8bit, 1e-3, 0.9, 0.0}, b);
  run_steps(*adamw, a, 1, 1);
  run_steps(*eight, b, 1, 1);
  const int64_t n = w.numel();
  const int64_t fp32 = replica::train::optimizer_state_bytes(*adamw);
  const int64_t bytes = replica::train::optimizer_state_bytes(*eight);
  EXPECT_EQ(fp32, 8 * n);
  // One byte per element per moment, one float per 256 elements per moment.
  EXPECT_EQ(bytes, 2 * n + 2 * 4 * (n / 256));
  const double ratio = static_cast<double>(bytes) / static_cast<double>(fp32);
  std::cout << "8-bit AdamW state / fp32 AdamW state: " << bytes << " / " << fp32 << " = " << ratio << "\n";
  EXPECT_LT(ratio, 0.26);
  EXPECT_GT(ratio, 0.25);
}

TEST(Optim8bit, PagedStateOnlyForLargeTensorsOnAGpu) {
  const torch::Device gpu(torch::kCUDA, 0), cpu(torch::kCPU);
  EXPECT_TRUE(replica::train::paged_state(true, gpu, replica::train::kPagedMinNumel));
  EXPECT_FALSE(replica::train::paged_state(true, gpu, replica::train::kPagedMinNumel - 1));
  EXPECT_FALSE(replica::train::paged_state(true, cpu, 10'000'000));  // bitsandbytes falls back the same way
  EXPECT_FALSE(replica::train::paged_state(false, gpu, 10'000'000));
  // On the CPU paged_adamw_8bit is adamw_bnb_8bit, bit for bit.
  const auto w = torch::randn({400, 300});
  auto a = leaves({w}), b = leaves({w});
  auto plain = replica::train::make_optimizer({OptimizerKind::AdamW8bit, 1e-2, 0.9, 0.01}, a);
  auto paged = replica::train::make_optimizer({OptimizerKind::PagedAdamW8bit, 1e-2, 0.9, 0.01}, b);
  run_steps(*plain, a, 3, 2);
  run_steps(*paged, b, 3, 2);
  EXPECT_TRUE(same(a, b));
}

TEST(Optim8bit, QuantizationKeepsValuesWithinTheMapsResolution) {
  torch::manual_seed(3);
  auto x = torch::randn({5000});
  x.narrow(0, 256, 256).zero_();  // an all-zero block
  for (const bool is_signed : {true, false}) {
    const auto v = is_signed ? x : x.abs();
    const auto code = replica::train::dynamic_map(is_signed);
    const auto q = replica::train::quantize_blockwise(v, code);
    ASSERT_EQ(q.codes.scalar_type(), torch::kUInt8);
    ASSERT_EQ(q.absmax.numel(), (5000 + 255) / 256);
    EXPECT_EQ(q.absmax[1].item<float>(), 0.0f);
    EXPECT_EQ(q.codes.narrow(0, 256, 256).max().item<int64_t>(), 0);
    const auto back = replica::train::dequantize_blockwise(q.codes, q.absmax, code);
    EXPECT_EQ(back.narrow(0, 256, 256).abs().max().item<float>(), 0.0f);
    // Block maxima are exact; every value within ~1.5 % of its block's maximum.
    EXPECT_TRUE(torch::equal(q.absmax.narrow(0, 0, 19), v.narrow(0, 0, 19 * 256).view({19, 256}).abs().amax(1)));
    EXPECT_LE(((back - v).abs() / q.absmax.repeat_interleave(256).narrow(0, 0, 5000).clamp_min(1e-30)).max().item<double>(),
              0.015);
  }
}

// Saved after 3 steps and loaded into a fresh optimizer (through a safetensors file, as a
// checkpoint), 3 more steps give what 6 straight steps give.
void check_round_trip(OptimizerKind kind, const std::vector<torch::Tensor>& init) {
  const std::vector<std::string> names = [&] {
    std::vector<std::string> n;
    for (size_t i = 0; i < init.size(); ++i) n.push_back("layer" + std::to_string(i) + ".weight");
    return n;
  }();
  const OptimizerSpec spec{kind, 1e-2, 0.9, 0.01};
  auto straight = leaves(init);
  auto opt = replica::train::make_optimizer(spec, straight);
  run_steps(*opt, straight, 3, 4);
  const replica::testing::ScratchDir dir("replica-optim-kinds");
  // Exported tensors may be the live state: written before the optimizer steps on.
  replica::io::save_safetensors(dir / "optimizer.safetensors",
                                replica::train::optimizer_state(*opt, kind, straight, names));
  run_steps(*opt, straight, 3, 5);
  const auto loaded = replica::io::load_safetensors(dir / "optimizer.safetensors").tensors;
  const auto& saved = loaded;
  std::vector<torch::Tensor> resumed;
  {
    // The parameters as they were at the checkpoint.
    auto before = leaves(init);
    auto again = replica::train::make_optimizer(spec, before);
    run_steps(*again, before, 3, 4);
    resumed = leaves(std::vector<torch::Tensor>(before.begin(), before.end()));
  }
  auto opt2 = replica::train::make_optimizer(spec, resumed);
  replica::train::load_optimizer_state(*opt2, kind, resumed, names, loaded);
  // What was loaded exports as what was saved.
  const auto reexported = replica::train::optimizer_state(*opt2, kind, resumed, names);
  ASSERT_EQ(reexported.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_EQ(reexported[i].first, saved[i].first);
    EXPECT_TRUE(torch::equal(reexported[i].second, saved[i].second)) << saved[i].first;
  }
  run_steps(*opt2, resumed, 3, 5);
  EXPECT_TRUE(same(straight, resumed));
  // A state of one optimizer is refused by another.
  auto sgd = replica::train::make_optimizer({OptimizerKind::Sgd, 0.1, 0.9, 0.0}, resumed);
  EXPECT_THROW(replica::train::load_optimizer_state(*sgd, OptimizerKind::Sgd, resumed, names, loaded), replica::Error);
}

TEST(Optim8bit, CheckpointRoundTripContinuesBitForBit) {
  check_round_trip(OptimizerKind::AdamW8bit, {torch::randn({64, 100}), torch::randn({100}), torch::randn({4500})});
  check_round_trip(OptimizerKind::PagedAdamW8bit, {torch::randn({70, 70})});
}

TEST(Adafactor, CheckpointRoundTripContinuesBitForBit) {
  check_round_trip(OptimizerKind::Adafactor, {torch::randn({16, 24}), torch::randn({10}), torch::randn({3, 4, 5})});
}

TEST(Adafactor, SecondMomentIsFactoredForMatrices) {
  auto params = leaves({torch::randn({100, 200}), torch::randn({300})});
  auto opt = replica::train::make_optimizer({OptimizerKind::Adafactor, 1e-2, 0.9, 0.0}, params);
  run_steps(*opt, params, 1, 6);
  EXPECT_EQ(replica::train::optimizer_state_bytes(*opt), (100 + 200 + 300) * 4);
}

// State saved for one cut of a tensor and loaded into another (a checkpoint resumed at another
// world size): the moments come back within the quantization's resolution, and float32 state
// exactly.
TEST(Optim8bit, StateCutDifferentlyIsQuantizedAgain) {
  auto params = leaves({torch::randn({8192})});
  const OptimizerSpec spec{OptimizerKind::AdamW8bit, 1e-2, 0.9, 0.0};
  auto opt = replica::train::make_optimizer(spec, params);
  run_steps(*opt, params, 2, 7);
  const auto saved = replica::train::optimizer_state(*opt, spec.kind, params, {"w"});
  std::map<std::string, torch::Tensor> by_field;
  for (const auto& [name, t] : saved) by_field[name.substr(2)] = t;
  const auto value = [&](int k) {  // the saved moment per element
    const auto code = replica::train::dynamic_map(k == 1);
    const auto& codes = by_field.at("state" + std::to_string(k));
    return code.index({codes.to(torch::kLong)}) * by_field.at("absmax" + std::to_string(k));
  };
  for (const auto& [begin, length] : std::vector<std::pair<int64_t, int64_t>>{{100, 5000}, {0, 3000}}) {
    replica::io::NamedTensors cut;
    for (const auto& [field, t] : by_field) cut.emplace_back("c." + field, t.dim() == 0 ? t : t.narrow(0, begin, length).clone());
    auto piece = leaves({torch::zeros({length})});
    auto opt2 = replica::train::make_optimizer(spec, piece);
    replica::train::load_optimizer_state(*opt2, spec.kind, piece, {"c"}, cut);
    const auto& st = static_cast<const replica::train::AdamW8bitParamState&>(
        *opt2->state().at(piece[0].unsafeGetTensorImpl()));
    EXPECT_EQ(st.step, 2);
    for (int k = 1; k <= 2; ++k) {
      const auto want = value(k).narrow(0, begin, length);
      torch::Tensor got;
      if (st.eight_bit()) {
        got = replica::train::dequantize_blockwise(k == 1 ? st.state1 : st.state2, k == 1 ? st.absmax1 : st.absmax2,
                                                   replica::train::dynamic_map(k == 1));
        EXPECT_LE((got - want).abs().max().item<double>(), 0.015 * want.abs().max().item<double>()) << k;
      } else {
        EXPECT_TRUE(torch::equal(k == 1 ? st.state1 : st.state2, want)) << k;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// The keys: AutoTrain's (transformers') names, and what cannot work refused by key.

class OptimizerConfig : public ::testing::Test {
 protected:
  void SetUp() override { fs::create_directories(dir_.path / "data"); }
  std::string yaml(const std::string& params_lines) const {
    return "task: image-classification\nproject_name: out/run\ndata:\n  path: " + (dir_ / "data") +
           "\nparams:\n  epochs: 2\n" + params_lines;
  }
  std::string error_of(const std::string& params_lines) const {
    try {
      replica::train::parse_config(yaml(params_lines), "run.yaml");
    } catch (const replica::Error& e) {
      return e.what();
    }
    return "";
  }
  replica::testing::ScratchDir dir_{"replica-optimizer-config"};
};

TEST_F(OptimizerConfig, AutoTrainOptimizerAndSchedulerNames) {
  const auto optimizer = [&](const std::string& v) {
    return replica::train::parse_config(yaml("  optimizer: " + v + "\n"), "run.yaml").params.optimizer;
  };
  EXPECT_EQ(optimizer("adamw_bnb_8bit"), OptimizerKind::AdamW8bit);
  EXPECT_EQ(optimizer("adamw_8bit"), OptimizerKind::AdamW8bit);
  EXPECT_EQ(optimizer("paged_adamw_8bit"), OptimizerKind::PagedAdamW8bit);
  EXPECT_EQ(optimizer("adafactor"), OptimizerKind::Adafactor);
  EXPECT_EQ(optimizer("adamw_hf"), OptimizerKind::AdamW);
  EXPECT_EQ(optimizer("adamw_torch"), OptimizerKind::AdamW);
  EXPECT_EQ(optimizer("adamw_torch_fused"), OptimizerKind::AdamW);
  using replica::train::SchedulerKind;
  const auto scheduler = [&](const std::string& v) {
    return replica::train::parse_config(yaml("  scheduler: " + v + "\n"), "run.yaml").params.scheduler;
  };
  EXPECT_EQ(scheduler("cosine_with_restarts"), SchedulerKind::CosineWithRestarts);
  EXPECT_EQ(scheduler("polynomial"), SchedulerKind::Polynomial);
  EXPECT_EQ(scheduler("constant_with_warmup"), SchedulerKind::ConstantWithWarmup);
  EXPECT_EQ(scheduler("constant"), SchedulerKind::Constant);
  // set_param (the flags' and Python's path) reads the same names.
  auto c = replica::train::parse_config(yaml(""), "run.yaml");
  replica::train::set_param(c, "optimizer", "paged_adamw_8bit");
  replica::train::set_param(c, "scheduler", "polynomial");
  EXPECT_EQ(c.params.optimizer, OptimizerKind::PagedAdamW8bit);
  EXPECT_EQ(c.params.scheduler, SchedulerKind::Polynomial);
}

TEST_F(OptimizerConfig, AdafactorWithAShardedStepIsRefusedByKey) {
  for (const std::string lines : {"  optimizer: adafactor\n  shard_optimizer: true\n",
                                  "  optimizer: adafactor\n  zero_stage: 1\n",
                                  "  optimizer: adafactor\n  distributed_backend: deepspeed\n"}) {
    const std::string e = error_of(lines);
    EXPECT_NE(e.find("key 'params.optimizer' is adafactor"), std::string::npos) << lines << e;
    EXPECT_NE(e.find("run.yaml:"), std::string::npos) << e;
  }
  EXPECT_EQ(error_of("  optimizer: adafactor\n  shard_optimizer: false\n"), "");
  EXPECT_EQ(error_of("  optimizer: paged_adamw_8bit\n  distributed_backend: deepspeed\n"), "");
}

TEST_F(OptimizerConfig, PolynomialBelowItsEndRateIsRefusedByKey) {
  const std::string e = error_of("  scheduler: polynomial\n  lr: 1e-8\n");
  EXPECT_NE(e.find("key 'params.lr'"), std::string::npos) << e;
  EXPECT_NE(e.find("lr_end"), std::string::npos) << e;
  EXPECT_EQ(error_of("  scheduler: polynomial\n  lr: 1e-4\n"), "");
}

}  // namespace
