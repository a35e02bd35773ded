// models::linear and core's cpu_sgemm (OpenBLAS for the CPU's fp32 GEMMs of model layers, Note
// [OpenBLAS for CPU GEMMs on non-Intel CPUs] in core/cpu_gemm.h) against LibTorch's torch::mm and
// torch::linear: values, gradients, frozen weights, thread splits, and where it stays LibTorch's.
#include "replica/core/cpu_gemm.h"
#include "replica/core/error.h"
#include "replica/testing/paths.h"
#include "replica/models/linear.h"
#include "replica/models/llama.h"
#include "replica/testing/program_runner.h"

#include <ATen/autocast_mode.h>
#include <ATen/cpu/Utils.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

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
  auto got = cpu_half_matmul(a, b, bias);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  auto want = (torch::mm(a.to(torch::kFloat32), b.to(torch::kFloat32)) + bias.to(torch::kFloat32)).to(torch::kBFloat16);
  expect_bf16_close(got, want, 1, "a b + bias");
  // A transposed view as either operand.
  expect_bf16_close(cpu_half_matmul(b.t().narrow(0, 0, 7), a.t()),
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

namespace {

struct Fp16ThroughFp32 {
  bool was;
  explicit Fp16ThroughFp32(bool on = true) : was(set_cpu_fp16_through_fp32(on)) {}
  ~Fp16ThroughFp32() { set_cpu_fp16_through_fp32(was); }
};

// Within `ulps` fp16 roundings (2^-11 relative) of the reference, element by element, plus a
// floor for values near 0 (a sum of terms of both signs cancels to less than its terms).
void expect_fp16_close(const torch::Tensor& got, const torch::Tensor& want, double ulps, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  auto bound = w.abs() * (ulps * std::ldexp(1.0, -11)) + 1e-4 * std::max(1e-30, w.abs().max().item<double>());
  EXPECT_TRUE(((g - w).abs() <= bound).all().item<bool>())
      << what << ": max abs diff " << (g - w).abs().max().item<double>() << ", max |want| "
      << w.abs().max().item<double>();
}

// autocast on the CPU to `dtype` for the life of the guard.
struct CpuAutocast {
  explicit CpuAutocast(at::ScalarType dtype) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
};

}  // namespace

// The fp16 product through the fp32 GEMM against a float64 reference of the same rounding
// points: fp16 operands, the exact product (fp32 accumulation is within fp32 rounding of it),
// one rounding to fp16. K = 32768 takes the weight in blocks, as for bf16.
TEST(ModelsLinear, Fp16ThroughFp32IsTheFp32ProductRoundedOnce) {
  Fp16ThroughFp32 on;
  torch::manual_seed(5);
  auto a = torch::randn({5, 32768}).to(torch::kHalf), b = torch::randn({32768, 200}).to(torch::kHalf);
  auto bias = torch::randn({200}).to(torch::kHalf);
  auto got = cpu_half_matmul(a, b, bias);
  ASSERT_EQ(got.scalar_type(), torch::kHalf);
  auto want = (torch::mm(a.to(torch::kFloat64), b.to(torch::kFloat64)) + bias.to(torch::kFloat64)).to(torch::kHalf);
  expect_fp16_close(got, want, 1, "a b + bias");
  auto t = b.t().narrow(0, 0, 7);
  const auto t_ref = torch::mm(t.to(torch::kFloat64), a.t().to(torch::kFloat64)).to(torch::kHalf);
  expect_fp16_close(cpu_half_matmul(t, a.t()), t_ref, 1, "transposed views");
  // Mixed types are refused, not widened silently.
  EXPECT_THROW(cpu_half_matmul(a, b.to(torch::kBFloat16)), replica::Error);
}

// Each fp16 path, forced (the dispatch decided from the CPU picks one; both are tested here on
// every machine): through the fp32 GEMM, a linear under fp16 autocast gives the float64
// reference of its rounding points (fp16 operands, one rounding of the product) for the output
// and both gradients, and ATen's own fp16 linear within the bf16 tests' 2 ulps; on the ATen
// path it is torch::linear exactly.
TEST(ModelsLinear, Fp16UnderAutocastThroughFp32EqualsTheReferenceAndTorchLinearsFp16) {
  torch::manual_seed(6);
  auto x0 = torch::randn({4, 6, 48}), w0 = torch::randn({40, 48}), b0 = torch::randn({40});
  auto dy = torch::randn({4, 6, 40}).to(torch::kHalf);
  struct Out {
    torch::Tensor y, dx, dw, db;
  };
  auto pass = [&](bool through_fp32, bool replica_linear) {
    Fp16ThroughFp32 path(through_fp32);
    EXPECT_EQ(cpu_fp16_through_fp32(), through_fp32);
    auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    torch::Tensor y;
    {
      CpuAutocast autocast(at::kHalf);
      y = replica_linear ? replica::models::linear(x, w, b) : torch::linear(x, w, b);
    }
    EXPECT_EQ(y.scalar_type(), torch::kHalf);
    y.backward(dy);
    EXPECT_EQ(w.grad().scalar_type(), torch::kFloat32);  // through the cast, as autocast's
    return Out{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const Out fp32 = pass(true, true), aten = pass(false, false), aten_replica = pass(false, true);
  // The reference: fp16 operands, exact products, one rounding to fp16 (the gradients then
  // widened to the fp32 parameters' type by autocast's casts).
  const auto h64 = [](const torch::Tensor& t) { return t.to(torch::kHalf).to(torch::kFloat64); };
  const auto x2 = h64(x0).reshape({-1, 48}), dy2 = dy.to(torch::kFloat64).reshape({-1, 40});
  const auto y_ref = (torch::mm(x2, h64(w0).t()) + h64(b0)).to(torch::kHalf).reshape({4, 6, 40});
  const auto dx_ref = torch::mm(dy2, h64(w0)).to(torch::kHalf).reshape({4, 6, 48});
  const auto dw_ref = torch::mm(dy2.t(), x2).to(torch::kHalf);
  const auto db_ref = dy2.sum(0).to(torch::kHalf);
  expect_fp16_close(fp32.y, y_ref, 1, "forward against the reference");
  expect_fp16_close(fp32.dx, dx_ref, 1, "input gradient against the reference");
  expect_fp16_close(fp32.dw, dw_ref, 1, "weight gradient against the reference");
  expect_fp16_close(fp32.db, db_ref, 1, "bias gradient against the reference");
  expect_fp16_close(fp32.y, aten.y, 2, "forward against ATen's fp16");
  expect_fp16_close(fp32.dx, aten.dx, 2, "input gradient against ATen's fp16");
  expect_fp16_close(fp32.dw, aten.dw, 2, "weight gradient against ATen's fp16");
  expect_fp16_close(fp32.db, aten.db, 2, "bias gradient against ATen's fp16");
  EXPECT_TRUE(torch::equal(aten_replica.y, aten.y)) << "the ATen path is torch::linear";
  EXPECT_TRUE(torch::equal(aten_replica.dw, aten.dw));
  std::cout << "fp16 through fp32 against the float64 reference: max |dy| "
            << (fp32.y.to(torch::kFloat64) - y_ref.to(torch::kFloat64)).abs().max().item<double>() << ", dx "
            << (fp32.dx.to(torch::kFloat64) - dx_ref.to(torch::kFloat64)).abs().max().item<double>() << ", dw "
            << (fp32.dw.to(torch::kFloat64) - dw_ref.to(torch::kFloat64)).abs().max().item<double>()
            << "; against ATen's fp16: y " << (fp32.y - aten.y).abs().max().item<float>() << ", dx "
            << (fp32.dx - aten.dx).abs().max().item<float>() << ", dw " << (fp32.dw - aten.dw).abs().max().item<float>()
            << "\n";
  // fp16 tensors without autocast take it too, and dtype_matmul; a frozen weight gets no gradient.
  Fp16ThroughFp32 on;
  auto xh = x0.to(torch::kHalf).requires_grad_(), wh = w0.to(torch::kHalf);
  auto yh = replica::models::linear(xh, wh);
  expect_fp16_close(yh, torch::mm(h64(x0).reshape({-1, 48}), h64(w0).t()).to(torch::kHalf).reshape({4, 6, 40}), 1,
                    "fp16 tensors");
  yh.sum().backward();
  EXPECT_TRUE(xh.grad().defined());
  EXPECT_FALSE(wh.grad().defined());
  expect_fp16_close(dtype_matmul(xh.detach(), wh.t()), yh.detach(), 0, "dtype_matmul");
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

// The fp16 decision as `replica env` reports it: forced each way, refused when misspelt, and by
// itself what the CPU's extensions say (AVX512-FP16 or AMX-FP16: ATen's kernels).
TEST(CpuGemm, ReplicaEnvNamesTheFp16ChoiceAndRefusesBadSettings) {
  using replica::testing::run_program;
  ASSERT_TRUE(std::filesystem::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const std::string fp32_line = "fp16 CPU GEMMs:      through the fp32 GEMM (REPLICA_CPU_FP16_GEMM=fp32|aten forces)";
  const std::string aten_line = "fp16 CPU GEMMs:      ATen's fp16 kernels (REPLICA_CPU_FP16_GEMM=fp32|aten forces)";
  const auto fp32 = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_FP16_GEMM", "fp32"}});
  EXPECT_EQ(fp32.exit_code, 0) << fp32.all();
  EXPECT_NE(fp32.out.find(fp32_line), std::string::npos) << fp32.out;
  const auto aten = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_FP16_GEMM", "aten"}});
  EXPECT_NE(aten.out.find(aten_line), std::string::npos) << aten.out;
  const auto bad = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_FP16_GEMM", "fp16"}});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.all().find("REPLICA_CPU_FP16_GEMM=fp16: want auto, fp32 or aten"), std::string::npos) << bad.all();
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* key) {
    auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  const bool native = has("avx512_fp16") || has("amx_fp16");
  const auto choice = run_program(REPLICA_BIN, {"env"}, {{"REPLICA_CPU_FP16_GEMM", "auto"}});
  EXPECT_NE(choice.out.find(native ? aten_line : fp32_line), std::string::npos) << choice.out;
}

namespace {

// A tiny Llama's logits and gradients under CPU autocast to `dtype`, its products through the
// fp32 GEMM and through LibTorch's own kernels of that type: within the type's rounding.
void expect_llama_paths_agree(at::ScalarType dtype, double logits_bound, double grads_bound) {
  torch::manual_seed(7);
  replica::models::LlamaForCausalLM model(replica::models::parse_llama_config(R"({
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})",
                                                                              "tiny llama"));
  auto ids = torch::randint(0, 128, {2, 24});
  const auto set = dtype == at::kHalf ? set_cpu_fp16_through_fp32 : set_cpu_bf16_through_fp32;
  auto pass = [&](bool through_fp32) {
    const bool was = set(through_fp32);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    auto logits = model->forward(ids);
    auto loss = replica::models::causal_lm_loss(logits, ids);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    loss.backward();
    set(was);
    std::vector<torch::Tensor> out{logits.detach().to(torch::kFloat32)};
    for (auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto fp32 = pass(true), aten = pass(false);
  ASSERT_EQ(fp32.size(), aten.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    const double scale = std::max(1e-30, aten[i].abs().max().item<double>());
    EXPECT_LT((fp32[i] - aten[i]).abs().max().item<double>() / scale, i == 0 ? logits_bound : grads_bound)
        << (i == 0 ? "logits" : "gradient ") << i;
  }
}

}  // namespace

TEST(ModelsLinear, ALlamaUnderBf16AutocastComputesThroughFp32WhatLibTorchsBf16Computes) {
  // The model's linears take the fp32 GEMM; logits and gradients stay within bf16 rounding of
  // LibTorch's own bf16 kernels.
  expect_llama_paths_agree(at::kBFloat16, 3e-2, 6e-2);
}

TEST(ModelsLinear, ALlamaUnderFp16AutocastComputesThroughFp32WhatLibTorchsFp16Computes) {
  // The same for fp16, within fp16's rounding (8x finer than bf16's): the layers, the head.
  expect_llama_paths_agree(at::kHalf, 4e-3, 8e-3);
}
