#include "replica/models/linear.h"

#include "replica/core/cpu_gemm.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <climits>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = n;
    return y.view(out_sizes);
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

}  // namespace

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
  if (!linear_uses_openblas(x, weight, bias)) return torch::linear(x, weight, bias);
  // No bias: an empty tensor (autograd functions take defined tensors only).
  const auto b = bias.defined() ? bias : torch::empty({0}, weight.options().requires_grad(false));
  return OpenblasLinear::apply(x, weight, b);
}

}  // namespace replica::models
