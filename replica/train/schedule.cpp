#include "replica/train/schedule.h"

#include "replica/core/error.h"

#include <algorithm>
#include <cmath>

namespace replica::train {

double learning_rate(SchedulerKind scheduler, double base_lr, int64_t step, int64_t total,
                     int64_t warmup) {
  if (warmup > 0 && step < warmup) return base_lr * static_cast<double>(step) / warmup;
  if (scheduler == SchedulerKind::Constant) return base_lr;
  const double span = std::max<int64_t>(1, total - warmup);
  const double progress = std::clamp((step - warmup) / span, 0.0, 1.0);
  if (scheduler == SchedulerKind::Linear) return base_lr * (1.0 - progress);
  return base_lr * 0.5 * (1.0 + std::cos(M_PI * progress));  // cosine
}

int64_t warmup_steps(int64_t warmup_steps, double warmup_ratio, int64_t total) {
  if (warmup_steps > 0) return warmup_steps;
  return static_cast<int64_t>(std::ceil(warmup_ratio * total));
}

}  // namespace replica::train
