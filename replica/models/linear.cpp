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

std::atomic<int>& bf16_switch() {  // -1: not decided yet
  static std::atomic<int> on{-1};
  return on;
}

bool decide_bf16_through_fp32() {
  const char* v = std::getenv("REPLICA_CPU_BF16_GEMM");
  const std::string choice = v ? v : "auto";
  if (choice == "fp32") return true;
  if (choice == "aten") return false;
  if (choice != "auto") fail("REPLICA_CPU_BF16_GEMM={}: want auto, fp32 or aten", choice);
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* key) {
    auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  return !has("avx512_bf16") && !has("amx_bf16");
}

// y = x W^T + b in bf16 through the fp32 GEMM; saves x and W (bf16) as torch::linear does.
struct Bf16Linear : public torch::autograd::Function<Bf16Linear> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias) {
    const int64_t n = weight.size(0), k = weight.size(1);
    auto x2 = x.reshape({-1, k});
    auto y = cpu_bf16_matmul(x2, weight.t(), bias.numel() > 0 ? bias : torch::Tensor());
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y.view(output_sizes(x, n));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x2 = saved[0];
    const auto& weight = saved[1];
    auto dy = grad_outputs[0].reshape({x2.size(0), weight.size(0)}).to(torch::kBFloat16);
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = cpu_bf16_matmul(dy, weight).view(ctx->saved_data["x_sizes"].toIntVector());
    if (ctx->needs_input_grad(1)) dw = cpu_bf16_matmul(dy.t(), x2);
    if (ctx->needs_input_grad(2)) db = dy.to(torch::kFloat32).sum(0).to(torch::kBFloat16);
    return {dx, dw, db};
  }
};

// Whether torch::linear would multiply x and weight in bf16 on the CPU (bf16 tensors, or CPU
// autocast to bf16) and Bf16Linear takes the product instead.
bool linear_takes_bf16_through_fp32(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!x.defined() || !weight.defined() || !x.device().is_cpu() || !weight.device().is_cpu()) return false;
  if (weight.dim() != 2 || x.dim() < 1 || x.numel() == 0 || x.size(-1) != weight.size(1)) return false;
  if (bias.defined() && (!bias.device().is_cpu() || bias.dim() != 1 || bias.size(0) != weight.size(0))) return false;
  auto floating = [](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
  };
  if (!floating(x) || !floating(weight) || (bias.defined() && !floating(bias))) return false;
  const bool bf16 = at::autocast::is_autocast_enabled(at::kCPU)
                        ? at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16
                        : x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 &&
                              (!bias.defined() || bias.scalar_type() == torch::kBFloat16);
  return bf16 && cpu_bf16_through_fp32();
}

}  // namespace

bool cpu_bf16_through_fp32() {
  int on = bf16_switch().load();
  if (on < 0) {
    on = decide_bf16_through_fp32() ? 1 : 0;
    bf16_switch().store(on);
  }
  return on == 1;
}

bool set_cpu_bf16_through_fp32(bool on) {
  const bool was = cpu_bf16_through_fp32();
  bf16_switch().store(on ? 1 : 0);
  return was;
}

torch::Tensor dtype_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  if (x.is_cpu() && x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() >= 1 &&
      x.numel() > 0 && cpu_bf16_through_fp32()) {
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(1);
    return cpu_bf16_matmul(x.reshape({-1, x.size(-1)}), w).view(sizes);
  }
  return at::matmul(x, w);
}

torch::Tensor cpu_bf16_matmul(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0) || (bias.defined() && bias.numel() != b.size(1))) {
    fail("cpu_bf16_matmul: a {} times b {} (bias {})", c10::str(a.sizes()), c10::str(b.sizes()),
         bias.defined() ? c10::str(bias.sizes()) : "none");
  }
  // Plain fp32 GEMMs here, whatever autocast says outside; no graph.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  torch::NoGradGuard no_grad;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto a32 = a.to(torch::kFloat32).contiguous();
  auto out = torch::empty({m, n}, a.options().dtype(torch::kBFloat16));
  const int64_t block = std::max<int64_t>(64, (int64_t{8} << 20) / (4 * std::max<int64_t>(1, k)));
  for (int64_t j = 0; j < n; j += block) {
    const int64_t nb = std::min(block, n - j);
    auto part = torch::mm(a32, b.narrow(1, j, nb).to(torch::kFloat32));
    if (bias.defined()) part.add_(bias.narrow(0, j, nb).to(torch::kFloat32));
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
  if (linear_takes_bf16_through_fp32(x, weight, bias)) {
    // The casts autocast would make (differentiable, so gradients reach fp32 weights and inputs).
    const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
    const auto b = bias.defined() ? bf16(bias) : torch::empty({0}, weight.options().dtype(torch::kBFloat16));
    return Bf16Linear::apply(bf16(x), bf16(weight), b);
  }
  if (!linear_uses_openblas(x, weight, bias)) return torch::linear(x, weight, bias);
  // No bias: an empty tensor (autograd functions take defined tensors only).
  const auto b = bias.defined() ? bias : torch::empty({0}, weight.options().requires_grad(false));
  return OpenblasLinear::apply(x, weight, b);
}

}  // namespace replica::models
