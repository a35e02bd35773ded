// models::linear and core's cpu_sgemm (OpenBLAS for the CPU's fp32 GEMMs of model layers, Note
// [OpenBLAS for CPU GEMMs on non-Intel CPUs] in core/cpu_gemm.h) against LibTorch's torch::mm and
// torch::linear: values, gradients, frozen weights, thread splits, and where it stays LibTorch's.
#include "replica/core/cpu_gemm.h"
#include "replica/testing/paths.h"
#include "replica/models/linear.h"
#include "replica/testing/program_runner.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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
  // And those cases give torch::linear's values exactly.
  auto xb = x.to(torch::kBFloat16), wb = w.to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(replica::models::linear(xb, wb), torch::linear(xb, wb)));
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
