// linear_cross_entropy_sum (chunked_cross_entropy.h) against the plain head + cross-entropy:
// the loss and the gradients of hidden states, weight and bias, with ignored targets, chunks
// that do not divide the tokens, and bf16 hidden states.
#include "replica/models/chunked_cross_entropy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using replica::models::linear_cross_entropy_sum;

namespace {

struct Result {
  torch::Tensor loss, grad_h, grad_w, grad_b;
};

Result run(bool chunked, torch::ScalarType dtype, int64_t chunk) {
  torch::manual_seed(5);
  auto h = (torch::randn({37, 24}) * 2).to(dtype).set_requires_grad(true);
  auto w = torch::randn({101, 24}).set_requires_grad(true);
  auto b = torch::randn({101}).set_requires_grad(true);
  auto targets = torch::randint(0, 101, {37}, torch::kInt64);
  targets.index_put_({torch::tensor({0, 5, 36})}, -100);
  torch::Tensor loss;
  if (chunked) {
    loss = linear_cross_entropy_sum(h, w, b, targets, chunk);
  } else {
    auto logits = torch::addmm(b.to(dtype), h, w.to(dtype).t()).to(torch::kFloat32);
    loss = torch::nn::functional::cross_entropy(
        logits, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  }
  loss.backward();
  return {loss.detach(), h.grad(), w.grad(), b.grad()};
}

double diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(ChunkedCrossEntropy, EqualsThePlainHeadAndLossInFp32) {
  const Result plain = run(false, torch::kFloat32, 0);
  for (const int64_t chunk : {int64_t{8}, int64_t{37}, int64_t{0}}) {
    const Result c = run(true, torch::kFloat32, chunk);
    EXPECT_NEAR(c.loss.item<double>(), plain.loss.item<double>(), 1e-4 * plain.loss.item<double>()) << chunk;
    EXPECT_LE(diff(c.grad_h, plain.grad_h), 1e-5) << chunk;
    EXPECT_LE(diff(c.grad_w, plain.grad_w), 1e-5) << chunk;
    EXPECT_LE(diff(c.grad_b, plain.grad_b), 1e-5) << chunk;
  }
}

TEST(ChunkedCrossEntropy, Bf16HiddenStatesGiveThePlainPathsNumbers) {
  const Result plain = run(false, torch::kBFloat16, 0);
  const Result c = run(true, torch::kBFloat16, 16);
  EXPECT_NEAR(c.loss.item<double>(), plain.loss.item<double>(), 1e-3 * plain.loss.item<double>());
  EXPECT_EQ(c.grad_h.scalar_type(), torch::kBFloat16);
  EXPECT_LE(diff(c.grad_h, plain.grad_h), 2e-2 * plain.grad_h.abs().max().item<double>());
  EXPECT_LE(diff(c.grad_w, plain.grad_w), 2e-2 * plain.grad_w.abs().max().item<double>());
}

TEST(ChunkedCrossEntropy, AFrozenHeadGetsNoGradientAndAllIgnoredIsZero) {
  auto h = torch::randn({4, 8}).set_requires_grad(true);
  auto w = torch::randn({10, 8});
  auto targets = torch::full({4}, -100, torch::kInt64);
  auto loss = linear_cross_entropy_sum(h, w, {}, targets, 2);
  EXPECT_EQ(loss.item<double>(), 0.0);
  loss.backward();
  EXPECT_TRUE(torch::equal(h.grad(), torch::zeros_like(h)));
  EXPECT_FALSE(w.grad().defined());
}

}  // namespace
