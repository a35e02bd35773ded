// Adafactor as transformers.optimization.Adafactor runs it for Trainer's optim="adafactor"
// (scale_parameter=False, relative_step=False, the learning rate given; eps (1e-30, 1e-3),
// clip_threshold 1.0, decay_rate -0.8, no first moment): written here because LibTorch has no
// Adafactor (torch.optim.Adafactor, PyTorch's own, is a different variant and Python-only too).
// Same operations in the same order as transformers' step, so the parameters agree with it
// (tests/adafactor_conformance_test.cpp, within 1e-6).
//
// Per parameter of two or more dimensions the second moment is factored: a running mean of the
// squared gradient over the last dimension (one value per row) and over the second-to-last
// (one per column); a vector keeps it per element. The update is the gradient divided by the
// root of that estimate, scaled down so that its RMS is at most clip_threshold.
//
// Note [Adafactor needs whole parameters]
// The row and column means and the update's RMS are over the whole parameter, so a sharded
// optimizer step (DDP's shard_optimizer, zero_stage 1-2, ZeRO-3), which hands the optimizer
// flat slices of parameters, would run a different algorithm (every slice a vector). The config
// refuses adafactor with them (run_config.cpp, check_zero_keys), and DDP's automatic choice does
// not shard for it (engine.cpp).
#pragma once

#include "replica/io/safetensors.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace replica::train {

struct AdafactorOptions : public torch::optim::OptimizerCloneableOptions<AdafactorOptions> {
  explicit AdafactorOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, eps1) = 1e-30;  // added to the squared gradient
  TORCH_ARG(double, clip_threshold) = 1.0;
  TORCH_ARG(double, decay_rate) = -0.8;  // beta2 at step t: 1 - t^decay_rate
  TORCH_ARG(double, weight_decay) = 0.0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdafactorParamState : public torch::optim::OptimizerCloneableParamState<AdafactorParamState> {
  int64_t step = 0;
  torch::Tensor exp_avg_sq_row, exp_avg_sq_col;  // factored (2+ dimensions)
  torch::Tensor exp_avg_sq;                      // otherwise
};

class Adafactor : public torch::optim::Optimizer {
 public:
  Adafactor(std::vector<torch::Tensor> params, AdafactorOptions options);
  torch::Tensor step(LossClosure closure = nullptr) override;
  // Zeroed state shaped for `p` (transformers' state initialisation).
  static AdafactorParamState fresh_state(const torch::Tensor& p);
};

// The state as checkpoint tensors "<name>.<field>", transformers' names: step, and
// exp_avg_sq_row with exp_avg_sq_col, or exp_avg_sq.
io::NamedTensors adafactor_state(Adafactor& optimizer, const std::vector<torch::Tensor>& params,
                                 const std::vector<std::string>& names);
// Restores it (shapes checked against the parameters); returns the number of entries used.
size_t load_adafactor_state(Adafactor& optimizer, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names, const io::NamedTensors& state);
int64_t adafactor_state_bytes(Adafactor& optimizer);

}  // namespace replica::train
