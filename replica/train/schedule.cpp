#include "replica/train/schedule.h"

#include "replica/core/error.h"

#include <algorithm>
#include <cmath>

namespace replica::train {

namespace {

// The lambdas of transformers/optimization.py, operation for operation (so that the rates agree
// to the last bit where the C library's cos and pow do).
double warmup_factor(int64_t step, int64_t warmup) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
}

double decay_progress(int64_t step, int64_t total, int64_t warmup) {
  return static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
}

double factor(SchedulerKind scheduler, double base_lr, int64_t step, int64_t total, int64_t warmup) {
  switch (scheduler) {
    case SchedulerKind::Constant:
      return 1.0;
    case SchedulerKind::ConstantWithWarmup:
      if (step < warmup) return static_cast<double>(step) / std::max(1.0, static_cast<double>(warmup));
      return 1.0;
    case SchedulerKind::Linear:
      if (step < warmup) return warmup_factor(step, warmup);
      return std::max(0.0, static_cast<double>(total - step) /
                               static_cast<double>(std::max<int64_t>(1, total - warmup)));
    case SchedulerKind::Cosine: {
      if (step < warmup) return warmup_factor(step, warmup);
      // Past `total` transformers' cosine rises again; a run never gets there, and 0 is safer.
      const double progress = std::min(1.0, decay_progress(step, total, warmup));
      return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));  // num_cycles 0.5
    }
    case SchedulerKind::CosineWithRestarts: {
      if (step < warmup) return warmup_factor(step, warmup);
      const double progress = decay_progress(step, total, warmup);
      if (progress >= 1.0) return 0.0;
      return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * std::fmod(1.0 * progress, 1.0))));  // num_cycles 1
    }
    case SchedulerKind::Polynomial: {
      if (step < warmup) return warmup_factor(step, warmup);
      if (step > total) return kPolynomialLrEnd / base_lr;
      const double lr_range = base_lr - kPolynomialLrEnd;
      // transformers divides by total - warmup unguarded (ZeroDivisionError when they are equal).
      const int64_t decay_steps = std::max<int64_t>(1, total - warmup);
      const double pct_remaining = 1.0 - static_cast<double>(step - warmup) / static_cast<double>(decay_steps);
      const double decay = lr_range * std::pow(pct_remaining, kPolynomialPower) + kPolynomialLrEnd;
      return decay / base_lr;
    }
  }
  return 1.0;
}

}  // namespace

double learning_rate(SchedulerKind scheduler, double base_lr, int64_t step, int64_t total,
                     int64_t warmup) {
  return base_lr * factor(scheduler, base_lr, step, total, warmup);  // LambdaLR: base_lr * lambda(step)
}

int64_t warmup_steps(int64_t warmup_steps, double warmup_ratio, int64_t total) {
  if (warmup_steps > 0) return warmup_steps;
  return static_cast<int64_t>(std::ceil(warmup_ratio * total));
}

void check_schedule(SchedulerKind scheduler, double base_lr, const std::string& where) {
  if (scheduler == SchedulerKind::Polynomial && !(base_lr > kPolynomialLrEnd)) {
    fail("{}key 'params.lr' is {} but scheduler polynomial decays to lr_end {} (transformers' default), which "
         "must be smaller than lr",
         where, base_lr, kPolynomialLrEnd);
  }
}

}  // namespace replica::train
