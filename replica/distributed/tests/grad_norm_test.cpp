#include "replica/distributed/grad_norm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

// The norm is summed in float64 in one pass (float32 tensors) or through a float64 copy
// (others); either way it matches a float64 reference to float64 rounding, and clipping scales
// every gradient by max_norm / (norm + 1e-6) only when that is below 1.
TEST(ClipGradNorm, Float64NormOfEverySizeAndClipping) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> grads;
  for (int64_t n : {0, 1, 7, 8, 9, 1001, 100'003}) grads.push_back(torch::randn({n}) * 3);
  grads.push_back(torch::randn({5, 4}).to(torch::kBFloat16));
  grads.push_back(torch::randn({6}).t());   // 1-D, contiguous
  grads.push_back(torch::randn({4, 6}).t());  // not contiguous
  grads.push_back(torch::Tensor());          // undefined: skipped
  double reference = 0;
  for (const auto& g : grads) {
    if (g.defined()) reference += g.to(torch::kDouble).pow(2).sum().item<double>();
  }
  reference = std::sqrt(reference);
  std::vector<torch::Tensor> before;
  for (const auto& g : grads) before.push_back(g.defined() ? g.clone() : g);

  const double measured =
      replica::distributed::clip_grad_norm(grads, std::numeric_limits<double>::infinity(), nullptr).item<double>();
  EXPECT_NEAR(measured, reference, reference * 1e-14);
  for (size_t i = 0; i + 1 < grads.size(); ++i) EXPECT_TRUE(torch::equal(grads[i], before[i])) << "unclipped " << i;

  const double max_norm = reference / 4;
  EXPECT_NEAR(replica::distributed::clip_grad_norm(grads, max_norm, nullptr).item<double>(), reference,
              reference * 1e-14);
  const double coef = max_norm / (reference + 1e-6);
  for (size_t i = 0; i + 1 < grads.size(); ++i) {
    if (grads[i].scalar_type() != torch::kFloat) continue;
    EXPECT_TRUE(torch::allclose(grads[i], before[i] * coef, 1e-6, 1e-7)) << "clipped " << i;
  }
}

// The path gradients on a GPU take (Note [the gradient norm stays on the GPU]), on CPU tensors:
// per-tensor norms accumulated in fp32 by one multi-tensor kernel, squared and summed in
// float64: the float64 reference to fp32's relative rounding, bf16 and non-contiguous ones too.
TEST(ClipGradNorm, DevicePathSumMatchesTheFloat64Reference) {
  torch::manual_seed(6);
  std::vector<torch::Tensor> grads;
  for (int64_t n : {1, 7, 1001, 100'003}) grads.push_back(torch::randn({n}) * 3);
  grads.push_back(torch::randn({5, 4}).to(torch::kBFloat16));
  grads.push_back(torch::randn({4, 6}).t());
  double reference = 0;
  for (const auto& g : grads) reference += g.to(torch::kDouble).pow(2).sum().item<double>();
  const torch::Tensor total = replica::distributed::sum_of_squares_on_device(grads);
  EXPECT_EQ(total.dim(), 0);
  EXPECT_EQ(total.scalar_type(), torch::kDouble);
  EXPECT_NEAR(total.item<double>(), reference, reference * 1e-5);
  EXPECT_EQ(replica::distributed::sum_of_squares_on_device({}).item<double>(), 0.0);
}
