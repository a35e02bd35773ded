#include "replica/models/linear.h"

#include "replica/core/cpu_gemm.h"

#include "replica/core/error.h"

#include <ATen/autocast_mode.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <optional>
#include <string>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A linear layer's output shape: x's with the last size n.
std::vector<int64_t> output_sizes(const torch::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return sizes;
}

// y[M, N] = x[M, K] W[N, K]^T (+ b), dx = dy W, dW = dy^T x, db = sum of dy's rows.
struct OpenblasLinear : public torch::autograd::Function<OpenblasLinear> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias) {
    const int64_t n = weight.size(0), k = weight.size(1);
    auto x2 = x.reshape({-1, k}).contiguous();
    const int64_t m = x2.size(0);
    // The bias in C with beta 1, as addmm does.
    auto y = bias.numel() > 0 ? bias.expand({m, n}).contiguous() : torch::empty({m, n}, x.options());
    cpu_sgemm(false, true, m, n, k, x2.data_ptr<float>(), k, weight.data_ptr<float>(), k, bias.numel() > 0 ? 1.f : 0.f,
              y.data_ptr<float>(), n);
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y.view(output_sizes(x, n));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x2 = saved[0];
    const auto& weight = saved[1];
    const int64_t m = x2.size(0), n = weight.size(0), k = weight.size(1);
    auto dy = grad_outputs[0].reshape({m, n}).contiguous();
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = torch::empty({m, k}, x2.options());
      cpu_sgemm(false, false, m, k, n, dy.data_ptr<float>(), n, weight.data_ptr<float>(), k, 0.f, dx.data_ptr<float>(), k);
      dx = dx.view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {
      dw = torch::empty({n, k}, weight.options());
      cpu_sgemm(true, false, n, k, m, dy.data_ptr<float>(), n, x2.data_ptr<float>(), k, 0.f, dw.data_ptr<float>(), k);
    }
    if (ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
  }
};

// Note [bf16 GEMMs through fp32 on CPUs without bf16 arithmetic]
// LibTorch's bf16 matmul on a CPU is oneDNN's where the CPU has AVX-512 (with or without its
// BF16 extension) or AMX, and otherwise a generic loop: on this project's AVX2 AMD EPYC one
// thread multiplies 512 x 1024 by 1024 x 1024 at 0.79 GFLOPS in bf16 against 45.1 in fp32
// (bench/README.md), so a bf16 base (mixed_precision: bf16, or a quantized base dequantized to
// bf16) trained 57x slower per GEMM than fp32. Where the CPU has neither AVX512-BF16 nor
// AMX-BF16, replica's model layers multiply bf16 operands with the fp32 GEMM: each operand's bf16
// values widened to fp32 (exact), the products summed in fp32, the result rounded to bf16 once:
// what a bf16 GEMM with fp32 accumulation computes, up to the order of the sums. The weight is
// widened a block of 8 MiB of fp32 at a time; the other operand whole (an fp32 copy of the
// activation, twice its bf16 bytes, for the length of the call). LibTorch's bf16 GEMM also sums
// in fp32 and rounds once: the transformers referees' bf16 logits are equal on both paths.
// Attention is not taken through fp32: ATen's bf16 attention rounds its probabilities to bf16
// before the product with v, and an fp32 attention moved the logits two bf16 ulps away from
// transformers' bf16 ones.
//
// Note [fp16 GEMMs through fp32 on CPUs without fp16 arithmetic]
// fp16 is the same story, worse: LibTorch multiplies fp16 on a CPU with oneDNN only where the
// CPU has AVX512-FP16 or AMX-FP16 (Sapphire Rapids and later), and everywhere else with a
// generic loop, AVX-512 or not: on this project's AVX512-BF16 AMD EPYC (Zen 4) one thread
// multiplies 512 x 1024 by 1024 x 1024 at 1.18 GFLOPS in fp16 against 71.9 in fp32 (61x), and
// `mixed_precision: fp16`, what most AutoTrain configs say, trained an order of magnitude slower
// than fp32 or bf16 without a word (issue 38). So fp16 takes the same path as bf16, decided the
// same way from its own extensions (AVX512-FP16, AMX-FP16; REPLICA_CPU_FP16_GEMM overrides):
// the fp16 operands widened to fp32 (exact), summed in fp32, rounded to fp16 once, which is what
// a GPU's fp16 GEMM with fp32 accumulation (cuBLAS under autocast) gives, so the rounding points
// are a GPU's: fp16 operands in, one rounding of the fp32 sum out (a sum beyond fp16's 65504
// becomes inf there too, which the loss scaler catches). One implementation serves both half
// types (HalfLinear, cpu_half_matmul); only the switch and its environment variable differ.
// The fp32 products take the model layers' fp32 GEMM (OpenBLAS where core/cpu_gemm.h chose it).
// Attention in fp16 has its own route (models/llama.cpp, Note [fp16 attention through fp32 on
// CPUs without fp16 arithmetic]). The LLM step (bench_llama_step --dtype fp16, one thread) went
// from 36 tokens/s on ATen's fp16 kernels to 585 (fp32: 667; docs/performance.md).

// The two half types' switches: -1 not decided yet, 0 ATen's kernels, 1 through fp32.
struct HalfGemm {
  at::ScalarType dtype;
  const char* env;         // auto | fp32 | aten
  const char* has[2];      // the CPU extensions (at::cpu::get_cpu_capabilities' keys) that do the arithmetic
};
constexpr HalfGemm kBf16Gemm{at::kBFloat16, "REPLICA_CPU_BF16_GEMM", {"avx512_bf16", "amx_bf16"}};
constexpr HalfGemm kFp16Gemm{at::kHalf, "REPLICA_CPU_FP16_GEMM", {"avx512_fp16", "amx_fp16"}};

std::atomic<int>& half_switch(at::ScalarType dtype) {
  static std::atomic<int> bf16{-1}, fp16{-1};
  return dtype == at::kHalf ? fp16 : bf16;
}

bool cpu_has(const HalfGemm& g) {
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* key) {
    auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  return has(g.has[0]) || has(g.has[1]);
}

bool decide_through_fp32(const HalfGemm& g) {
  const char* v = std::getenv(g.env);
  const std::string choice = v ? v : "auto";
  if (choice == "fp32") return true;
  if (choice == "aten") return false;
  if (choice != "auto") fail("{}={}: want auto, fp32 or aten", g.env, choice);
  return !cpu_has(g);
}

bool through_fp32(const HalfGemm& g) {
  auto& on = half_switch(g.dtype);
  int now = on.load();
  if (now < 0) {
    now = decide_through_fp32(g) ? 1 : 0;
    on.store(now);
  }
  return now == 1;
}

bool set_through_fp32(const HalfGemm& g, bool on) {
  const bool was = through_fp32(g);
  half_switch(g.dtype).store(on ? 1 : 0);
  return was;
}

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// y = x W^T + b in bf16 or fp16 through the fp32 GEMM; saves x and W (in the half type) as
// torch::linear does.
struct HalfLinear : public torch::autograd::Function<HalfLinear> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias) {
    const int64_t n = weight.size(0), k = weight.size(1);
    auto x2 = x.reshape({-1, k});
    auto y = cpu_half_matmul(x2, weight.t(), bias.numel() > 0 ? bias : torch::Tensor());
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y.view(output_sizes(x, n));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x2 = saved[0];
    const auto& weight = saved[1];
    const auto dtype = x2.scalar_type();
    auto dy = grad_outputs[0].reshape({x2.size(0), weight.size(0)}).to(dtype);
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = cpu_half_matmul(dy, weight).view(ctx->saved_data["x_sizes"].toIntVector());
    if (ctx->needs_input_grad(1)) dw = cpu_half_matmul(dy.t(), x2);
    if (ctx->needs_input_grad(2)) db = dy.to(torch::kFloat32).sum(0).to(dtype);
    return {dx, dw, db};
  }
};

// The half type (bf16 or fp16) torch::linear would multiply x and weight in on the CPU (the
// tensors' own, or CPU autocast's), where HalfLinear takes the product instead; nullopt where it
// does not.
std::optional<at::ScalarType> linear_half_through_fp32(const torch::Tensor& x, const torch::Tensor& weight,
                                                       const torch::Tensor& bias) {
  if (!x.defined() || !weight.defined() || !x.device().is_cpu() || !weight.device().is_cpu()) return std::nullopt;
  if (weight.dim() != 2 || x.dim() < 1 || x.numel() == 0 || x.size(-1) != weight.size(1)) return std::nullopt;
  if (bias.defined() && (!bias.device().is_cpu() || bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return std::nullopt;
  }
  auto floating = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat32 || is_half(t.scalar_type()); };
  if (!floating(x) || !floating(weight) || (bias.defined() && !floating(bias))) return std::nullopt;
  at::ScalarType dtype = x.scalar_type();
  if (at::autocast::is_autocast_enabled(at::kCPU)) {
    dtype = at::autocast::get_autocast_dtype(at::kCPU);
  } else if (weight.scalar_type() != dtype || (bias.defined() && bias.scalar_type() != dtype)) {
    return std::nullopt;
  }
  if (!cpu_half_through_fp32(dtype)) return std::nullopt;
  return dtype;
}

}  // namespace

bool cpu_bf16_through_fp32() { return through_fp32(kBf16Gemm); }
bool set_cpu_bf16_through_fp32(bool on) { return set_through_fp32(kBf16Gemm, on); }
bool cpu_fp16_through_fp32() { return through_fp32(kFp16Gemm); }
bool set_cpu_fp16_through_fp32(bool on) { return set_through_fp32(kFp16Gemm, on); }

bool cpu_does_half_arithmetic(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return cpu_has(kBf16Gemm);
  if (dtype == at::kHalf) return cpu_has(kFp16Gemm);
  return true;
}

bool cpu_half_through_fp32(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return cpu_bf16_through_fp32();
  if (dtype == at::kHalf) return cpu_fp16_through_fp32();
  return false;
}

torch::Tensor dtype_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  if (x.is_cpu() && w.is_cpu() && is_half(x.scalar_type()) && w.scalar_type() == x.scalar_type() && x.dim() >= 1 &&
      w.dim() == 2 && x.numel() > 0 && cpu_half_through_fp32(x.scalar_type())) {
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(1);
    return cpu_half_matmul(x.reshape({-1, x.size(-1)}), w).view(sizes);
  }
  return at::matmul(x, w);
}

torch::Tensor cpu_half_matmul(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0) || (bias.defined() && bias.numel() != b.size(1)) ||
      !is_half(a.scalar_type()) || b.scalar_type() != a.scalar_type() ||
      (bias.defined() && bias.scalar_type() != a.scalar_type())) {
    fail("cpu_half_matmul: a {} {} times b {} {} (bias {}): want [M, K] x [K, N] (+ [N]) of one half type",
         c10::str(a.sizes()), c10::toString(a.scalar_type()), c10::str(b.sizes()), c10::toString(b.scalar_type()),
         bias.defined() ? c10::str(bias.sizes()) : "none");
  }
  // Plain fp32 GEMMs here, whatever autocast says outside; no graph.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  torch::NoGradGuard no_grad;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto a32 = a.to(torch::kFloat32).contiguous();
  auto out = torch::empty({m, n}, a.options());
  const int64_t block = std::max<int64_t>(64, (int64_t{8} << 20) / (4 * std::max<int64_t>(1, k)));
  // The fp32 GEMM the model layers' fp32 products take (OpenBLAS where core/cpu_gemm.h chose it:
  // LibTorch's MKL sgemm took twice its time on this project's AMD EPYCs), else torch::mm.
  const bool openblas =
      cpu_gemm_is_openblas() && m > 0 && n > 0 && k > 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX;
  for (int64_t j = 0; j < n; j += block) {
    const int64_t nb = std::min(block, n - j);
    auto b32 = b.narrow(1, j, nb).to(torch::kFloat32);  // [k, nb], row-major or (b a transpose) column-major
    torch::Tensor part;
    if (openblas) {
      const bool trans_b = !b32.is_contiguous() && b32.t().is_contiguous();
      if (!trans_b) b32 = b32.contiguous();
      part = bias.defined() ? bias.narrow(0, j, nb).to(torch::kFloat32).expand({m, nb}).contiguous()
                            : torch::empty({m, nb}, a32.options());
      cpu_sgemm(false, trans_b, m, nb, k, a32.data_ptr<float>(), k, b32.data_ptr<float>(), trans_b ? k : nb,
                bias.defined() ? 1.f : 0.f, part.data_ptr<float>(), nb);
    } else {
      part = torch::mm(a32, b32);
      if (bias.defined()) part.add_(bias.narrow(0, j, nb).to(torch::kFloat32));
    }
    out.narrow(1, j, nb).copy_(part);
  }
  return out;
}

bool linear_uses_openblas(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!x.defined() || !weight.defined() || !x.device().is_cpu() || !weight.device().is_cpu()) return false;
  if (x.scalar_type() != torch::kFloat32 || weight.scalar_type() != torch::kFloat32) return false;
  if (bias.defined() && (bias.scalar_type() != torch::kFloat32 || !bias.device().is_cpu() || bias.dim() != 1)) return false;
  if (at::autocast::is_autocast_enabled(at::kCPU)) return false;  // autocast picks the dtype: torch::linear's rules
  if (weight.dim() != 2 || !weight.is_contiguous() || x.dim() < 1 || x.numel() == 0) return false;
  if (x.size(-1) != weight.size(1) || (bias.defined() && bias.size(0) != weight.size(0))) return false;
  if (x.numel() / x.size(-1) > INT_MAX || weight.size(0) > INT_MAX || weight.size(1) > INT_MAX) return false;
  return cpu_gemm_is_openblas();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (const auto half = linear_half_through_fp32(x, weight, bias)) {
    // The casts autocast would make (differentiable, so gradients reach fp32 weights and inputs).
    const auto cast = [&](const torch::Tensor& t) { return t.to(*half); };
    const auto b = bias.defined() ? cast(bias) : torch::empty({0}, weight.options().dtype(*half));
    return HalfLinear::apply(cast(x), cast(weight), b);
  }
  if (!linear_uses_openblas(x, weight, bias)) return torch::linear(x, weight, bias);
  // No bias: an empty tensor (autograd functions take defined tensors only).
  const auto b = bias.defined() ? bias : torch::empty({0}, weight.options().requires_grad(false));
  return OpenblasLinear::apply(x, weight, b);
}

}  // namespace replica::models
