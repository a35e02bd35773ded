// models::linear and core's cpu_sgemm (OpenBLAS for the CPU's fp32 GEMMs of model layers, Note
// [OpenBLAS for CPU GEMMs on non-Intel CPUs] in core/cpu_gemm.h) against LibTorch's torch::mm and
// torch::linear: values, gradients, frozen weights, thread splits, and where it stays LibTorch's.
#include "replica/core/cpu_gemm.h"
#include "replica/testing/paths.h"
#include "replica/models/linear.h"
#include "replica/models/llama.h"
#include "replica/testing/program_runner.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

using namespace replica::models;

namespace {

// This binary takes the OpenBLAS path whatever the CPU's vendor, so that the path is tested on
// Intel machines too (where `auto` keeps MKL); an outer REPLICA_CPU_GEMM wins. Set before main,
// so before the once-per-process decision. Without Debian's libopenblas0-serial (scripts/setup.sh
// installs it) every test here fails naming the library.
const bool kForced = setenv("REPLICA_CPU_GEMM", "openblas", /*overwrite=*/0) == 0;

// Relative to the product's scale: fp32 GEMMs in another summation order.
void expect_close(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double scale = std::max(1.0, b.abs().max().item<double>());
  EXPECT_LE((a - b).abs().max().item<double>(), 2e-5 * scale) << what;
}

struct ThreadsGuard {
  int before = at::get_num_threads();
  explicit ThreadsGuard(int threads) { at::set_num_threads(threads); }
  ~ThreadsGuard() { at::set_num_threads(before); }
};

}  // namespace

TEST(CpuGemm, OpenblasIsInUseAndDescribed) {
  ASSERT_TRUE(kForced);
  ASSERT_TRUE(replica::cpu_gemm_is_openblas()) << replica::cpu_gemm_description();
  EXPECT_NE(replica::cpu_gemm_description().find("OpenBLAS"), std::string::npos) << replica::cpu_gemm_description();
}

TEST(CpuGemm, EveryTransposeAndBetaEqualsTorchMm) {
  torch::manual_seed(0);
  for (int threads : {1, 2, 3}) {
    ThreadsGuard guard(threads);
    // Tall (split by rows), wide (split by columns), small (one call).
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{301, 77, 45}, {33, 290, 130}, {5, 7, 3}}) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          auto a = ta ? torch::randn({k, m}) : torch::randn({m, k});
          auto b = tb ? torch::randn({n, k}) : torch::randn({k, n});
          auto c0 = torch::randn({m, n});
          auto want = torch::mm(ta ? a.t() : a, tb ? b.t() : b);
          auto c = torch::empty({m, n});
          replica::cpu_sgemm(ta, tb, m, n, k, a.data_ptr<float>(), a.size(1), b.data_ptr<float>(), b.size(1), 0.f,
                             c.data_ptr<float>(), n);
          expect_close(c, want, "beta 0");
          auto acc = c0.clone();
          replica::cpu_sgemm(ta, tb, m, n, k, a.data_ptr<float>(), a.size(1), b.data_ptr<float>(), b.size(1), 1.f,
                             acc.data_ptr<float>(), n);
          expect_close(acc, want + c0, "beta 1");
        }
      }
    }
  }
}

TEST(CpuGemm, SameThreadsSameBits) {
  torch::manual_seed(1);
  ThreadsGuard guard(2);
  auto a = torch::randn({512, 96}), b = torch::randn({200, 96});
  auto run = [&] {
    auto c = torch::empty({512, 200});
    replica::cpu_sgemm(false, true, 512, 200, 96, a.data_ptr<float>(), 96, b.data_ptr<float>(), 96, 0.f,
                       c.data_ptr<float>(), 200);
    return c;
  };
  EXPECT_TRUE(torch::equal(run(), run()));
}

TEST(ModelsLinear, ForwardAndGradientsEqualTorchLinear) {
  torch::manual_seed(2);
  for (bool with_bias : {false, true}) {
    auto x = torch::randn({3, 37, 64}, torch::requires_grad());
    auto w = torch::randn({48, 64}, torch::requires_grad());
    auto b = with_bias ? torch::randn({48}, torch::requires_grad()) : torch::Tensor();
    auto x2 = x.detach().clone().requires_grad_();
    auto w2 = w.detach().clone().requires_grad_();
    auto b2 = with_bias ? b.detach().clone().requires_grad_() : torch::Tensor();
    ASSERT_TRUE(linear_uses_openblas(x, w, b));
    auto y = replica::models::linear(x, w, b);
    auto want = torch::linear(x2, w2, b2);
    expect_close(y, want, "output");
    auto g = torch::randn_like(want);
    y.backward(g);
    want.backward(g);
    expect_close(x.grad(), x2.grad(), "input gradient");
    expect_close(w.grad(), w2.grad(), "weight gradient");
    if (with_bias) expect_close(b.grad(), b2.grad(), "bias gradient");
    // A second backward accumulates, as autograd does for torch::linear.
    replica::models::linear(x, w, b).backward(g);
    torch::linear(x2, w2, b2).backward(g);
    expect_close(w.grad(), w2.grad(), "accumulated weight gradient");
  }
}

TEST(ModelsLinear, FrozenWeightGetsNoGradientAndNonContiguousInputsWork) {
  torch::manual_seed(3);
  auto w = torch::randn({24, 40});  // frozen, as LoRA's base
  auto x = torch::randn({40, 10}, torch::requires_grad());
  auto xt = x.t();  // [10, 40], not contiguous
  auto y = replica::models::linear(xt, w);
  expect_close(y, torch::linear(xt.detach(), w), "output");
  y.sum().backward();
  EXPECT_FALSE(w.grad().defined());
  auto x2 = x.detach().clone().requires_grad_();
  torch::linear(x2.t(), w).sum().backward();
  expect_close(x.grad(), x2.grad(), "input gradient through the transpose");
}

TEST(ModelsLinear, StaysWithTorchLinearWhereOpenblasDoesNotApply) {
  auto w = torch::randn({8, 16});
  auto x = torch::randn({4, 16});
  EXPECT_FALSE(linear_uses_openblas(x.to(torch::kBFloat16), w.to(torch::kBFloat16)));
  EXPECT_FALSE(linear_uses_openblas(x.to(torch::kFloat64), w.to(torch::kFloat64)));
  EXPECT_FALSE(linear_uses_openblas(x, w.t().contiguous().t()));  // a transposed view as weight
  EXPECT_FALSE(linear_uses_openblas(torch::randn({0, 16}), w));
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    EXPECT_FALSE(linear_uses_openblas(x, w));
    at::autocast::set_autocast_enabled(at::kCPU, false);
  }
  // And those cases give torch::linear's values exactly (bf16 where it is not taken through fp32).
  const bool was = set_cpu_bf16_through_fp32(false);
  auto xb = x.to(torch::kBFloat16), wb = w.to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(replica::models::linear(xb, wb), torch::linear(xb, wb)));
  set_cpu_bf16_through_fp32(was);
}

namespace {

struct Bf16ThroughFp32 {
  bool was = set_cpu_bf16_through_fp32(true);
  ~Bf16ThroughFp32() { set_cpu_bf16_through_fp32(was); }
};

// Within a bf16 rounding of the reference, element by element (plus a floor for values near 0).
void expect_bf16_close(const torch::Tensor& got, const torch::Tensor& want, double ulps, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  auto bound = w.abs() * (ulps * std::ldexp(1.0, -8)) + 1e-3 * std::max(1e-30, w.abs().max().item<double>());
  EXPECT_TRUE(((g - w).abs() <= bound).all().item<bool>()) << what << ": max abs diff " << (g - w).abs().max().item<double>();
}

}  // namespace

TEST(ModelsLinear, Bf16ThroughFp32IsTheFp32ProductRoundedOnce) {
  Bf16ThroughFp32 on;
  torch::manual_seed(5);
  // K = 32768: the weight is widened 64 columns (8 MiB of fp32) at a time, 200 = 3 x 64 + 8.
  auto a = torch::randn({5, 32768}).to(torch::kBFloat16), b = torch::randn({32768, 200}).to(torch::kBFloat16);
  auto bias = torch::randn({200}).to(torch::kBFloat16);
  auto got = cpu_bf16_matmul(a, b, bias);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  auto want = (torch::mm(a.to(torch::kFloat32), b.to(torch::kFloat32)) + bias.to(torch::kFloat32)).to(torch::kBFloat16);
  expect_bf16_close(got, want, 1, "a b + bias");
  // A transposed view as either operand.
  expect_bf16_close(cpu_bf16_matmul(b.t().narrow(0, 0, 7), a.t()),
                    torch::mm(b.t().narrow(0, 0, 7).to(torch::kFloat32), a.t().to(torch::kFloat32)).to(torch::kBFloat16), 1,
                    "transposed views");
}

TEST(ModelsLinear, Bf16UnderAutocastThroughFp32EqualsTorchLinearsBf16) {
  Bf16ThroughFp32 on;
  torch::manual_seed(6);
  auto x = torch::randn({4, 6, 48}, torch::requires_grad());
  auto w = torch::randn({40, 48}, torch::requires_grad());
  auto bias = torch::randn({40}, torch::requires_grad());
  auto x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_(),
       b2 = bias.detach().clone().requires_grad_();
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  auto got = replica::models::linear(x, w, bias);
  auto want = torch::linear(x2, w2, b2);  // LibTorch's own bf16 GEMM
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  expect_bf16_close(got, want, 2, "forward");
  auto dy = torch::randn(got.sizes()).to(torch::kBFloat16);
  got.backward(dy);
  want.backward(dy);
  ASSERT_EQ(w.grad().scalar_type(), torch::kFloat32);  // through the cast, as autocast's
  expect_bf16_close(x.grad(), x2.grad(), 2, "input gradient");
  expect_bf16_close(w.grad(), w2.grad(), 2, "weight gradient");
  expect_bf16_close(bias.grad(), b2.grad(), 2, "bias gradient");
  // bf16 tensors without autocast take it too; a frozen weight gets no gradient.
  auto xb = x.detach().to(torch::kBFloat16).requires_grad_(), wb = w.detach().to(torch::kBFloat16);
  auto yb = replica::models::linear(xb, wb);
  expect_bf16_close(yb, torch::linear(xb.detach(), wb), 2, "bf16 tensors");
  yb.sum().backward();
  EXPECT_TRUE(xb.grad().defined());
  EXPECT_FALSE(wb.grad().defined());
}

TEST(ModelsLinear, TwoThreadsEqualOneWithinRounding) {
  torch::manual_seed(4);
  auto x = torch::randn({256, 96}), w = torch::randn({160, 96});
  torch::Tensor one, two;
  {
    ThreadsGuard guard(1);
    one = replica::models::linear(x, w);
  }
  {
    ThreadsGuard guard(2);
    two = replica::models::linear(x, w);
  }
  expect_close(two, one, "2 threads against 1");
}

// The decision as the program reports it, and the errors for what the user set wrong (the
// program, so that each case is a process of its own: the decision is made once per process).
TEST(CpuGemm, ReplicaEnvNamesTheChoiceAndRefusesBadSettings) {
  using replica::testing::run_program;
  ASSERT_TRUE(std::filesystem::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const auto aten = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_GEMM", "aten"}});
  EXPECT_EQ(aten.exit_code, 0) << aten.all();
  EXPECT_NE(aten.out.find("model layers' GEMM:  LibTorch (MKL) (REPLICA_CPU_GEMM=aten)"), std::string::npos) << aten.out;
  const auto bad = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_GEMM", "bogus"}});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.all().find("REPLICA_CPU_GEMM=bogus: expected auto, openblas or aten"), std::string::npos) << bad.all();
  const auto missing = run_program(
      REPLICA_BIN, {"env"}, {{"REPLICA_CPU_GEMM", "openblas"}, {"REPLICA_OPENBLAS", "/nonexistent/libopenblas.so.0"}});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.all().find("REPLICA_CPU_GEMM=openblas: cannot load cblas_sgemm from /nonexistent/libopenblas.so.0"),
            std::string::npos)
      << missing.all();
}

TEST(ModelsLinear, ALlamaUnderBf16AutocastComputesThroughFp32WhatLibTorchsBf16Computes) {
  // The model's linears take the fp32 GEMM; logits and gradients stay within bf16 rounding of
  // LibTorch's own bf16 kernels.
  torch::manual_seed(7);
  replica::models::LlamaForCausalLM model(replica::models::parse_llama_config(R"({
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})",
                                                                              "tiny llama"));
  auto ids = torch::randint(0, 128, {2, 24});
  auto pass = [&](bool through_fp32) {
    const bool was = set_cpu_bf16_through_fp32(through_fp32);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto logits = model->forward(ids);
    auto loss = replica::models::causal_lm_loss(logits, ids);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    loss.backward();
    set_cpu_bf16_through_fp32(was);
    std::vector<torch::Tensor> out{logits.detach().to(torch::kFloat32)};
    for (auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto fp32 = pass(true), aten = pass(false);
  ASSERT_EQ(fp32.size(), aten.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    const double scale = std::max(1e-30, aten[i].abs().max().item<double>());
    EXPECT_LT((fp32[i] - aten[i]).abs().max().item<double>() / scale, i == 0 ? 3e-2 : 6e-2) << (i == 0 ? "logits" : "gradient ") << i;
  }
}
