// Dynamic loss scaling for fp16 mixed precision (PyTorch's torch.amp.GradScaler, same defaults:
// initial scale 2^16, x2 after 2000 steps without overflow, x0.5 and the step skipped after one).
//
// Why: float16 has 5 exponent bits, so small gradients underflow to zero. The loss is multiplied
// by the scale before backward (gradients scaled alike), the gradients divided by it before
// clipping and the step; a step whose gradients hold an inf or NaN on any rank is skipped on
// every rank (the ranks agree through one all-reduce) and the scale halved.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace replica::distributed {
class ProcessGroup;
}

namespace replica::train {

class LossScaler {
 public:
  static constexpr double kInitialScale = 65536.0;
  static constexpr double kGrowthFactor = 2.0;
  static constexpr double kBackoffFactor = 0.5;
  static constexpr int64_t kGrowthInterval = 2000;

  // Disabled: scale() is 1 and nothing is checked (fp32, bf16).
  explicit LossScaler(bool enabled) : enabled_(enabled), scale_(enabled ? kInitialScale : 1.0) {}

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }
  // A resumed run continues with the scale it had (trainer_state.json).
  void restore(double scale, int64_t good_steps) {
    if (!enabled_ || scale <= 0) return;
    scale_ = scale;
    good_steps_ = good_steps;
  }

  // After the step's backward passes: divides the gradients of `params` by the scale and says
  // whether every rank's are finite. `loss_nonfinite`: this rank's loss of the step was NaN or
  // Inf, an overflow too (its gradients are not to be trusted even where they look finite).
  // Collective (one all-reduce of a flag, which carries both).
  bool unscale_and_check(const std::vector<torch::Tensor>& params, distributed::ProcessGroup& pg,
                         bool loss_nonfinite = false);

  // After the step (finite) or instead of it (not): grows or halves the scale.
  void update(bool finite);

 private:
  bool enabled_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace replica::train
