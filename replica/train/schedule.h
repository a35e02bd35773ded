// Learning-rate schedules with Hugging Face's formulas (transformers' get_scheduler, the
// referee of tests/schedule_conformance_test.cpp): the rate at step k is lr * lambda(k), the
// lambdas of transformers.optimization written out in the same floating-point operations.
//   constant              1 (no warm-up: get_constant_schedule ignores num_warmup_steps)
//   constant_with_warmup  k / warmup during warm-up, then 1
//   linear                warm-up, then linear decay to 0 at `total`
//   cosine                warm-up, then half a cosine to 0 at `total` (0 after it)
//   cosine_with_restarts  warm-up, then get_cosine_with_hard_restarts' num_cycles=1 (0 from `total`)
//   polynomial            warm-up, then get_polynomial_decay's lr_end=1e-7, power=1.0
#pragma once

#include "replica/train/run_config.h"

#include <cstdint>
#include <string>

namespace replica::train {

// transformers' get_polynomial_decay_schedule_with_warmup defaults, which get_scheduler uses.
inline constexpr double kPolynomialLrEnd = 1e-7;
inline constexpr double kPolynomialPower = 1.0;

// The rate for optimizer step `step` (0-based) of `total`.
double learning_rate(SchedulerKind scheduler, double base_lr, int64_t step, int64_t total,
                     int64_t warmup);

// warmup_steps when set, else ceil(warmup_ratio * total).
int64_t warmup_steps(int64_t warmup_steps, double warmup_ratio, int64_t total);

// What transformers refuses too: polynomial decay needs lr > its lr_end (1e-7). `where` prefixes
// the message (the config's location of params.lr).
void check_schedule(SchedulerKind scheduler, double base_lr, const std::string& where = "");

}  // namespace replica::train
