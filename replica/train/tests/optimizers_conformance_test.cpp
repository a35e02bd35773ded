// Conformance: the optimizers and schedules AutoTrain configs name, against what Hugging Face's
// Trainer runs for them (referee/optim_referee.py, in the project's .venv):
//   adamw_bnb_8bit, paged_adamw_8bit  bitsandbytes 0.50.2's AdamW (optim_bits 8) on its CPU
//       backend, as Trainer.get_optimizer_cls_and_kwargs makes it: the parameters, the state
//       bytes, the block maxima and the quantization maps after every step;
//   adafactor  transformers.optimization.Adafactor with the Trainer's arguments: parameters and
//       factored state within 1e-6 after every step, matrices (factored), a 3-D tensor and vectors;
//   every scheduler  transformers' get_scheduler's rate at every step within 1e-12 (relative).
#include "replica/io/safetensors.h"
#include "replica/testing/paths.h"
#include "replica/testing/referee.h"
#include "replica/train/adafactor.h"
#include "replica/train/optim.h"
#include "replica/train/optim_8bit.h"
#include "replica/train/schedule.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using replica::testing::ScratchDir;
using replica::train::OptimizerKind;

namespace {

const fs::path kReferee = fs::path(REPLICA_SOURCE_DIR) / "replica/train/tests/referee/optim_referee.py";

struct Problem {
  std::vector<torch::Tensor> params;             // initial values
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]
};

Problem make_problem(const std::vector<std::vector<int64_t>>& shapes, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  Problem p;
  for (const auto& s : shapes) p.params.push_back(torch::randn(s));
  for (int k = 0; k < steps; ++k) {
    std::vector<torch::Tensor> g;
    // Gradients of changing scale, and some rows far larger than others: blocks with very
    // different maxima.
    for (const auto& s : shapes) {
      auto t = torch::randn(s) * (0.5 + k);
      if (t.dim() >= 2) t.select(0, 0).mul_(20.0);
      g.push_back(t);
    }
    p.grads.push_back(g);
  }
  return p;
}

// Runs the referee; its tensors by name.
std::map<std::string, torch::Tensor> referee(const std::string& optim, const Problem& problem, double lr,
                                             double weight_decay, const ScratchDir& dir) {
  replica::io::NamedTensors in;
  for (size_t i = 0; i < problem.params.size(); ++i) in.emplace_back("p." + std::to_string(i), problem.params[i]);
  for (size_t s = 0; s < problem.grads.size(); ++s) {
    for (size_t i = 0; i < problem.grads[s].size(); ++i) {
      in.emplace_back("g." + std::to_string(i) + "." + std::to_string(s), problem.grads[s][i]);
    }
  }
  const std::string src = dir / (optim + "-in.safetensors"), dst = dir / (optim + "-out.safetensors");
  replica::io::save_safetensors(src, in);
  const auto run = replica::testing::run_python(
      kReferee, {"optimizer", optim, src, dst, std::to_string(lr), std::to_string(weight_decay),
                 std::to_string(problem.grads.size())});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::map<std::string, torch::Tensor> out;
  if (run.exit_code != 0) return out;
  for (auto& [name, t] : replica::io::load_safetensors(dst).tensors) out[name] = t;
  return out;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

std::string key(const std::string& field, size_t i, int s) {
  return field + "." + std::to_string(i) + "." + std::to_string(s);
}

// The 8-bit AdamW against bitsandbytes: tensors of 8-bit state (whole blocks, a partial last
// block) and one under min_8bit_size (float32 state), over five steps.
void check_8bit(OptimizerKind kind, const std::string& optim) {
  REPLICA_REQUIRE_PYTHON("bitsandbytes", "transformers", "safetensors");
  const ScratchDir dir("replica-optim-8bit");
  constexpr double kLr = 0.01, kDecay = 0.01;
  constexpr int kSteps = 5;
  const Problem problem = make_problem({{64, 100}, {70, 70}, {4095}, {3, 1500}}, kSteps, 11);
  const auto ref = referee(optim, problem, kLr, kDecay, dir);
  if (ref.empty()) return;
  std::vector<torch::Tensor> params;
  for (const auto& p : problem.params) params.push_back(p.clone().set_requires_grad(true));
  auto opt = replica::train::make_optimizer({kind, kLr, 0.9, kDecay}, params);
  auto& eight = dynamic_cast<replica::train::AdamW8bit&>(*opt);
  // The quantization maps are bitsandbytes' create_dynamic_map.
  EXPECT_TRUE(torch::equal(replica::train::dynamic_map(true), ref.at(key("qmap1", 0, 0))));
  EXPECT_TRUE(torch::equal(replica::train::dynamic_map(false), ref.at(key("qmap2", 0, 0))));
  double worst_param = 0.0, worst_absmax = 0.0;
  int64_t code_mismatches = 0, codes = 0;
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = problem.grads[s][i].clone();
    opt->step();
    for (size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(s) + ", tensor " + std::to_string(i));
      worst_param = std::max(worst_param, max_abs_diff(params[i], ref.at(key("p", i, s))));
      const auto& st = static_cast<const replica::train::AdamW8bitParamState&>(
          *eight.state().at(params[i].unsafeGetTensorImpl()));
      ASSERT_EQ(st.eight_bit(), params[i].numel() >= replica::train::kMin8bitSize);
      EXPECT_EQ(st.step, s + 1);
      if (!st.eight_bit()) {
        worst_param = std::max(worst_param, max_abs_diff(st.state1, ref.at(key("state1", i, s))));
        worst_param = std::max(worst_param, max_abs_diff(st.state2, ref.at(key("state2", i, s))));
        continue;
      }
      for (const char* f : {"state1", "state2"}) {
        const auto& mine = std::string(f) == "state1" ? st.state1 : st.state2;
        code_mismatches += mine.ne(ref.at(key(f, i, s))).sum().item<int64_t>();
        codes += mine.numel();
      }
      worst_absmax = std::max(worst_absmax, max_abs_diff(st.absmax1, ref.at(key("absmax1", i, s))));
      worst_absmax = std::max(worst_absmax, max_abs_diff(st.absmax2, ref.at(key("absmax2", i, s))));
    }
  }
  std::cout << optim << " vs bitsandbytes over " << kSteps << " steps: max |param diff| " << worst_param
            << ", state bytes differing " << code_mismatches << " of " << codes << ", max |absmax diff| "
            << worst_absmax << "\n";
  EXPECT_LE(worst_param, 1e-7);
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_LE(worst_absmax, 0.0);
}

TEST(OptimizersConformance, AdamW8bitStepsAsBitsandbytes) { check_8bit(OptimizerKind::AdamW8bit, "adamw_bnb_8bit"); }

TEST(OptimizersConformance, PagedAdamW8bitStepsAsBitsandbytesOnTheCpu) {
  check_8bit(OptimizerKind::PagedAdamW8bit, "paged_adamw_8bit");
}

TEST(OptimizersConformance, AdafactorStepsAsTransformers) {
  REPLICA_REQUIRE_PYTHON("transformers", "safetensors");
  const ScratchDir dir("replica-optim-adafactor");
  constexpr double kLr = 0.01;
  constexpr int kSteps = 5;
  for (const double decay : {0.0, 0.01}) {
    SCOPED_TRACE("weight_decay " + std::to_string(decay));
    const Problem problem = make_problem({{32, 48}, {7, 5, 6}, {50}, {1}}, kSteps, 5);
    const auto ref = referee("adafactor", problem, kLr, decay, dir);
    if (ref.empty()) return;
    std::vector<torch::Tensor> params;
    for (const auto& p : problem.params) params.push_back(p.clone().set_requires_grad(true));
    auto opt = replica::train::make_optimizer({OptimizerKind::Adafactor, kLr, 0.9, decay}, params);
    auto& factor = dynamic_cast<replica::train::Adafactor&>(*opt);
    double worst = 0.0;
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = problem.grads[s][i].clone();
      opt->step();
      for (size_t i = 0; i < params.size(); ++i) {
        SCOPED_TRACE("step " + std::to_string(s) + ", tensor " + std::to_string(i));
        worst = std::max(worst, max_abs_diff(params[i], ref.at(key("p", i, s))));
        const auto& st = static_cast<const replica::train::AdafactorParamState&>(
            *factor.state().at(params[i].unsafeGetTensorImpl()));
        // Matrices and higher: factored (rows and columns); vectors: per element.
        if (params[i].dim() >= 2) {
          ASSERT_TRUE(ref.count(key("exp_avg_sq_row", i, s)));
          EXPECT_FALSE(st.exp_avg_sq.defined());
          const auto& row = ref.at(key("exp_avg_sq_row", i, s));
          const auto& col = ref.at(key("exp_avg_sq_col", i, s));
          ASSERT_EQ(st.exp_avg_sq_row.sizes(), row.sizes());
          ASSERT_EQ(st.exp_avg_sq_col.sizes(), col.sizes());
          EXPECT_LE(max_abs_diff(st.exp_avg_sq_row, row) / row.abs().max().item<double>(), 1e-6);
          EXPECT_LE(max_abs_diff(st.exp_avg_sq_col, col) / col.abs().max().item<double>(), 1e-6);
        } else {
          const auto& sq = ref.at(key("exp_avg_sq", i, s));
          ASSERT_EQ(st.exp_avg_sq.sizes(), sq.sizes());
          EXPECT_LE(max_abs_diff(st.exp_avg_sq, sq) / sq.abs().max().item<double>(), 1e-6);
        }
      }
    }
    std::cout << "adafactor (weight_decay " << decay << ") vs transformers over " << kSteps
              << " steps: max |param diff| " << worst << "\n";
    EXPECT_LE(worst, 1e-6);
  }
}

TEST(OptimizersConformance, SchedulesAreTransformersGetScheduler) {
  REPLICA_REQUIRE_PYTHON("transformers");
  const ScratchDir dir("replica-schedule");
  const auto run = replica::testing::run_python(kReferee, {"schedule", dir / "rates.json"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  nlohmann::json rates;
  std::ifstream(dir / "rates.json") >> rates;
  constexpr double kBase = 0.4;  // the referee's
  double worst = 0.0;
  std::set<std::string> names;
  for (const auto& [k, v] : rates.items()) {
    const auto first = k.find('/'), second = k.rfind('/');
    const std::string name = k.substr(0, first);
    const int64_t total = std::stoll(k.substr(first + 1, second - first - 1));
    const int64_t warmup = std::stoll(k.substr(second + 1));
    const auto kind = replica::train::enum_from<replica::train::SchedulerKind>(name);
    ASSERT_TRUE(kind.has_value()) << name;
    names.insert(name);
    for (int64_t step = 0; step <= total; ++step) {
      const double want = v.at(static_cast<size_t>(step)).get<double>();
      const double got = replica::train::learning_rate(*kind, kBase, step, total, warmup);
      const double rel = want == 0.0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, 1e-12) << k << " step " << step << ": " << got << " vs " << want;
    }
  }
  std::cout << "schedules vs transformers.get_scheduler: max relative difference " << worst << "\n";
  EXPECT_EQ(names.size(), replica::train::EnumNames<replica::train::SchedulerKind>::names.size());
}

}  // namespace
