// fp16's dynamic loss scaling (train/loss_scale.h): the gradients come back to their true size,
// an inf or NaN anywhere skips the step and halves the scale, and the scale doubles after
// kGrowthInterval finite steps, as torch.amp.GradScaler does.
#include "replica/train/loss_scale.h"

#include "replica/distributed/process_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

using replica::train::LossScaler;

namespace {

torch::Tensor param_with_grad(std::vector<float> grad) {
  auto p = torch::zeros({static_cast<int64_t>(grad.size())}, torch::requires_grad());
  p.mutable_grad() = torch::tensor(grad);
  return p;
}

TEST(LossScaler, DisabledIsScaleOneAndTouchesNothing) {
  replica::distributed::ProcessGroup pg{replica::distributed::WorldInfo{}};
  LossScaler s(false);
  EXPECT_EQ(s.scale(), 1.0);
  auto p = param_with_grad({std::numeric_limits<float>::infinity()});
  EXPECT_TRUE(s.unscale_and_check({p}, pg));
  EXPECT_TRUE(std::isinf(p.grad()[0].item<float>()));
}

TEST(LossScaler, UnscalesFiniteGradientsAndGrowsAfterTheInterval) {
  replica::distributed::ProcessGroup pg{replica::distributed::WorldInfo{}};
  LossScaler s(true);
  EXPECT_EQ(s.scale(), 65536.0);
  auto p = param_with_grad({65536.0f * 2, -65536.0f * 0.25f});
  auto q = torch::zeros({2}, torch::requires_grad());  // no gradient: left alone
  ASSERT_TRUE(s.unscale_and_check({p, q}, pg));
  EXPECT_FLOAT_EQ(p.grad()[0].item<float>(), 2.0f);
  EXPECT_FLOAT_EQ(p.grad()[1].item<float>(), -0.25f);
  for (int64_t i = 0; i < LossScaler::kGrowthInterval - 1; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, AnOverflowSkipsAndHalves) {
  replica::distributed::ProcessGroup pg{replica::distributed::WorldInfo{}};
  LossScaler s(true);
  s.update(true);
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    auto p = param_with_grad({1.0f, bad});
    EXPECT_FALSE(s.unscale_and_check({p}, pg));
    const double before = s.scale();
    s.update(false);
    EXPECT_EQ(s.scale(), before * 0.5);
    EXPECT_EQ(s.good_steps(), 0);
  }
  // A resumed run continues from its saved scale.
  LossScaler resumed(true);
  resumed.restore(1024.0, 17);
  EXPECT_EQ(resumed.scale(), 1024.0);
  EXPECT_EQ(resumed.good_steps(), 17);
}

}  // namespace
