// Learning-rate schedules, properties of Hugging Face's get_scheduler formulas (0-based steps):
// warm-up lr * step / warmup; then constant, linear decay to 0, or half-cosine decay to 0
// at `total`. transformers' own rates at every step: schedule_conformance_test.cpp.
#include "replica/train/schedule.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>

#include <cmath>

using replica::train::learning_rate;
using replica::train::warmup_steps;

namespace {

constexpr double kLr = 0.4;

TEST(Schedule, WarmupIsLinearFromZeroForEveryScheduler) {
  using replica::train::SchedulerKind;
  for (const SchedulerKind s : {SchedulerKind::ConstantWithWarmup, SchedulerKind::Linear, SchedulerKind::Cosine,
                                SchedulerKind::CosineWithRestarts, SchedulerKind::Polynomial}) {
    SCOPED_TRACE(replica::train::name_of(s));
    EXPECT_DOUBLE_EQ(learning_rate(s, kLr, 0, 100, 10), 0.0);
    EXPECT_DOUBLE_EQ(learning_rate(s, kLr, 1, 100, 10), kLr * 0.1);
    EXPECT_DOUBLE_EQ(learning_rate(s, kLr, 5, 100, 10), kLr * 0.5);
    EXPECT_DOUBLE_EQ(learning_rate(s, kLr, 9, 100, 10), kLr * 0.9);
    // The first step after warm-up runs at the full rate.
    EXPECT_DOUBLE_EQ(learning_rate(s, kLr, 10, 100, 10), kLr);
    // Monotone during warm-up.
    for (int64_t step = 1; step < 10; ++step) {
      EXPECT_GT(learning_rate(s, kLr, step, 100, 10), learning_rate(s, kLr, step - 1, 100, 10));
    }
  }
}

TEST(Schedule, CosineDecaysToZeroAtTotal) {
  const int64_t total = 110, warmup = 10;
  EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Cosine, kLr, warmup, total, warmup), kLr);
  // Half way through the decay: half the rate.
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Cosine, kLr, warmup + 50, total, warmup), kLr * 0.5, 1e-12);
  // HF: lr * 0.5 * (1 + cos(pi * progress)).
  for (int64_t step = warmup; step <= total; ++step) {
    const double progress = static_cast<double>(step - warmup) / (total - warmup);
    EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Cosine, kLr, step, total, warmup),
                kLr * 0.5 * (1.0 + std::cos(M_PI * progress)), 1e-12)
        << "step " << step;
  }
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Cosine, kLr, total, total, warmup), 0.0, 1e-12);
  EXPECT_LT(learning_rate(replica::train::SchedulerKind::Cosine, kLr, total - 1, total, warmup), kLr * 1e-3);
  EXPECT_GT(learning_rate(replica::train::SchedulerKind::Cosine, kLr, total - 1, total, warmup), 0.0);
  // Beyond the end it stays at 0 rather than climbing back up the cosine.
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Cosine, kLr, total + 30, total, warmup), 0.0, 1e-12);
  // Without warm-up the first step runs at the full rate.
  EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Cosine, kLr, 0, 20, 0), kLr);
}

TEST(Schedule, LinearDecaysToZeroAtTotal) {
  const int64_t total = 50, warmup = 10;
  for (int64_t step = warmup; step <= total; ++step) {
    EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Linear, kLr, step, total, warmup),
                kLr * static_cast<double>(total - step) / (total - warmup), 1e-12)
        << "step " << step;
  }
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Linear, kLr, 30, total, warmup), kLr * 0.5, 1e-12);
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Linear, kLr, total, total, warmup), 0.0, 1e-12);
  EXPECT_NEAR(learning_rate(replica::train::SchedulerKind::Linear, kLr, total + 5, total, warmup), 0.0, 1e-12);  // never negative
  EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Linear, kLr, 0, 4, 0), kLr);
  EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Linear, kLr, 1, 4, 0), kLr * 0.75);
}

TEST(Schedule, ConstantStaysAtTheBaseRate) {
  for (int64_t step : {0, 1, 7, 99, 100, 1000}) {
    EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Constant, kLr, step, 100, 0), kLr) << "step " << step;
  }
  // transformers' get_scheduler("constant") has no warm-up: the warm-up steps change nothing.
  for (int64_t step : {0, 1, 4, 50, 100}) {
    EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::Constant, kLr, step, 100, 4), kLr) << "step " << step;
  }
  for (int64_t step : {4, 50, 100}) {
    EXPECT_DOUBLE_EQ(learning_rate(replica::train::SchedulerKind::ConstantWithWarmup, kLr, step, 100, 4), kLr)
        << "step " << step;
  }
}

TEST(Schedule, PolynomialNeedsARateAboveItsEnd) {
  EXPECT_NO_THROW(replica::train::check_schedule(replica::train::SchedulerKind::Polynomial, 1e-5));
  EXPECT_NO_THROW(replica::train::check_schedule(replica::train::SchedulerKind::Linear, 1e-8));
  try {
    replica::train::check_schedule(replica::train::SchedulerKind::Polynomial, 1e-7);
    FAIL() << "lr 1e-7 accepted";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("params.lr"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("lr_end"), std::string::npos) << e.what();
  }
}

TEST(Schedule, DegenerateSpansDoNotDivideByZero) {
  // warmup == total: the decay span is clamped to 1 step.
  const double lr = learning_rate(replica::train::SchedulerKind::Cosine, kLr, 10, 10, 10);
  EXPECT_TRUE(std::isfinite(lr));
  EXPECT_NEAR(lr, kLr, 1e-12);
  EXPECT_TRUE(std::isfinite(learning_rate(replica::train::SchedulerKind::Linear, kLr, 0, 0, 0)));
}

// An unknown name never reaches the schedule: it is refused where the key is read (the
// config's message is tested in run_config_test.cpp).
TEST(Schedule, UnknownSchedulerNamesAreNotSchedulers) {
  EXPECT_FALSE(replica::train::enum_from<replica::train::SchedulerKind>("exponential").has_value());
  EXPECT_FALSE(replica::train::enum_from<replica::train::SchedulerKind>("cosin").has_value());
  EXPECT_EQ(replica::train::enum_from<replica::train::SchedulerKind>("cosine"), replica::train::SchedulerKind::Cosine);
}

TEST(Schedule, WarmupStepsFromRatioRoundUp) {
  // Explicit steps win over the ratio.
  EXPECT_EQ(warmup_steps(5, 0.5, 100), 5);
  EXPECT_EQ(warmup_steps(7, 0.0, 100), 7);
  // Otherwise ceil(ratio * total), as HF TrainingArguments.get_warmup_steps.
  EXPECT_EQ(warmup_steps(0, 0.0, 100), 0);
  EXPECT_EQ(warmup_steps(0, 0.25, 8), 2);    // exact
  EXPECT_EQ(warmup_steps(0, 0.25, 10), 3);   // 2.5 -> 3
  EXPECT_EQ(warmup_steps(0, 0.5, 7), 4);     // 3.5 -> 4
  EXPECT_EQ(warmup_steps(0, 0.125, 1), 1);   // any warm-up at all is at least one step
  EXPECT_EQ(warmup_steps(0, 0.5, 1000), 500);
  EXPECT_EQ(warmup_steps(0, 0.25, 0), 0);
}

}  // namespace
