// linear_cross_entropy_sum (chunked_cross_entropy.h) against the plain head + cross-entropy:
// the loss and the gradients of hidden states, weight and bias, with ignored targets, chunks
// that do not divide the tokens, and bf16 hidden states.
#include "replica/models/chunked_cross_entropy.h"
#include "replica/models/linear.h"

#include <ATen/autocast_mode.h>

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

// Both product paths of a half type: through the fp32 GEMM (CPUs without the type's arithmetic)
// and ATen's kernels of the type; the plain path is ATen's either way. `bound`: the gradients'
// distance, relative to their largest element.
void expect_half_paths_give_the_plain_paths_numbers(torch::ScalarType dtype, double loss_bound, double bound) {
  const auto set = dtype == torch::kHalf ? replica::models::set_cpu_fp16_through_fp32
                                         : replica::models::set_cpu_bf16_through_fp32;
  struct Restore {
    decltype(set) set_;
    bool was;
    ~Restore() { set_(was); }
  } restore{set, set(false)};
  const Result plain = run(false, dtype, 0);
  for (const bool widened : {true, false}) {
    set(widened);
    const Result c = run(true, dtype, 16);
    EXPECT_NEAR(c.loss.item<double>(), plain.loss.item<double>(), loss_bound * plain.loss.item<double>()) << widened;
    EXPECT_EQ(c.grad_h.scalar_type(), dtype);
    EXPECT_LE(diff(c.grad_h, plain.grad_h), bound * plain.grad_h.abs().max().item<double>()) << widened;
    EXPECT_LE(diff(c.grad_w, plain.grad_w), bound * plain.grad_w.abs().max().item<double>()) << widened;
    EXPECT_LE(diff(c.grad_b, plain.grad_b), bound * plain.grad_b.abs().max().item<double>()) << widened;
  }
}

TEST(ChunkedCrossEntropy, Bf16HiddenStatesGiveThePlainPathsNumbers) {
  expect_half_paths_give_the_plain_paths_numbers(torch::kBFloat16, 1e-3, 2e-2);
}

// fp16 (mixed_precision: fp16's head), 8x finer than bf16.
TEST(ChunkedCrossEntropy, Fp16HiddenStatesGiveThePlainPathsNumbers) {
  expect_half_paths_give_the_plain_paths_numbers(torch::kHalf, 2e-4, 3e-3);
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

// Under autocast the forward multiplies in bf16; the backward (outside autocast) must recompute
// the logits in bf16 too, or each token's softmax - one_hot no longer sums to zero over the
// vocabulary. The bias gradient is that sum over tokens: zero up to fp32 rounding only when the
// backward's logits are the forward's.
TEST(ChunkedCrossEntropy, UnderAutocastTheBackwardRecomputesTheForwardsBf16Logits) {
  torch::manual_seed(7);
  auto h = (torch::randn({37, 24}) * 3).set_requires_grad(true);
  auto w = torch::randn({101, 24}).set_requires_grad(true);
  auto b = torch::randn({101}).set_requires_grad(true);
  auto targets = torch::randint(0, 101, {37}, torch::kInt64);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  auto loss = linear_cross_entropy_sum(h, w, b, targets, 8);
  auto plain_logits = torch::addmm(b, h, w.t());  // autocast: bf16
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  ASSERT_EQ(plain_logits.scalar_type(), torch::kBFloat16);
  auto plain = torch::nn::functional::cross_entropy(plain_logits.to(torch::kFloat32), targets,
                                                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  EXPECT_NEAR(loss.item<double>(), plain.item<double>(), 1e-4 * plain.item<double>());
  loss.backward();
  EXPECT_EQ(h.grad().scalar_type(), torch::kFloat32);
  EXPECT_LE(std::abs(b.grad().sum().item<double>()), 1e-5 * b.grad().abs().sum().item<double>());
  auto hp = h.detach().clone().set_requires_grad(true);
  auto wp = w.detach().clone().set_requires_grad(true);
  auto bp = b.detach().clone().set_requires_grad(true);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  auto logits = torch::addmm(bp, hp, wp.t());
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), targets,
                                       torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
      .backward();
  EXPECT_LE(diff(h.grad(), hp.grad()), 2e-2 * hp.grad().abs().max().item<double>());
  EXPECT_LE(diff(w.grad(), wp.grad()), 2e-2 * wp.grad().abs().max().item<double>());
  EXPECT_LE(diff(b.grad(), bp.grad()), 2e-2 * bp.grad().abs().max().item<double>());
}

// The widened input gradient sums W's rows a block at a time: at hidden 16384 a block is 128 rows,
// so a 300-word vocabulary takes three (one partial); equal to ATen's bf16 path.
TEST(ChunkedCrossEntropy, Bf16ThroughFp32SumsTheVocabularyInBlocks) {
  struct Restore {
    bool was = replica::models::cpu_bf16_through_fp32();
    ~Restore() { replica::models::set_cpu_bf16_through_fp32(was); }
  } restore;
  torch::manual_seed(11);
  const auto h0 = (torch::randn({9, 16384}) * 0.05).to(torch::kBFloat16);
  const auto w = (torch::randn({300, 16384}) * 0.05).to(torch::kBFloat16);
  const auto targets = torch::randint(0, 300, {9}, torch::kInt64);
  torch::Tensor loss[2], grad[2];
  for (const bool widened : {true, false}) {
    replica::models::set_cpu_bf16_through_fp32(widened);
    auto h = h0.clone().set_requires_grad(true);
    loss[widened] = linear_cross_entropy_sum(h, w, {}, targets, 4);
    loss[widened].backward();
    grad[widened] = h.grad();
  }
  EXPECT_NEAR(loss[1].item<double>(), loss[0].item<double>(), 1e-3 * loss[0].item<double>());
  EXPECT_LE(diff(grad[1], grad[0]), 1e-2 * grad[0].abs().max().item<double>());
}

}  // namespace
