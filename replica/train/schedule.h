// Learning-rate schedules as Hugging Face's get_scheduler builds them: linear warm-up from 0
// to the base rate over `warmup` steps, then constant, linear decay to 0, or half-cosine
// decay to 0 at `total` steps.
#pragma once

#include "replica/train/run_config.h"

#include <cstdint>

namespace replica::train {

// The rate for optimizer step `step` (0-based) of `total`.
double learning_rate(SchedulerKind scheduler, double base_lr, int64_t step, int64_t total,
                     int64_t warmup);

// warmup_steps when set, else ceil(warmup_ratio * total).
int64_t warmup_steps(int64_t warmup_steps, double warmup_ratio, int64_t total);

}  // namespace replica::train
