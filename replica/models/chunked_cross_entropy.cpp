#include "replica/models/chunked_cross_entropy.h"

#include "replica/core/cpu_gemm.h"
#include "replica/core/error.h"
#include "replica/models/fused_ops.h"
#include "replica/models/linear.h"

#include <torch/torch.h>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The chunk's logits as the head computes them, in fp32. On the CPU in fp32 through the model
// layers' GEMM (models/linear.h: OpenBLAS where core/cpu_gemm.h chose it), as the head's forward.
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& weight, const torch::Tensor& bias) {
  const auto optional_bias = bias.numel() > 0 ? bias : torch::Tensor();  // models::linear: undefined = none
  if (linear_uses_openblas(h, weight, optional_bias)) return models::linear(h, weight, optional_bias);
  auto w = weight.scalar_type() == h.scalar_type() ? weight : weight.to(h.scalar_type());
  auto logits = bias.numel() > 0 ? torch::addmm(bias.to(h.scalar_type()), h, w.t()) : torch::matmul(h, w.t());
  return logits.to(torch::kFloat32);
}

struct LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& targets, int64_t chunk) {
    torch::NoGradGuard no_grad;
    const int64_t n = hidden.size(0);
    auto lse = torch::empty({n}, hidden.options().dtype(torch::kFloat32));
    auto total = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto logits = chunk_logits(hidden.narrow(0, start, len), weight, bias);
      auto t = targets.narrow(0, start, len);
      if (fused_kernels_for(logits)) {  // one pass per row (Note [fused kernels])
        auto rows = fused_cross_entropy_rows(logits, t);
        lse.narrow(0, start, len).copy_(rows.lse);
        total += rows.loss.sum();
        continue;
      }
      auto valid = t != -100;
      auto chunk_lse = torch::logsumexp(logits, -1);
      lse.narrow(0, start, len).copy_(chunk_lse);
      auto picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
      total += torch::where(valid, chunk_lse - picked, torch::zeros_like(picked)).sum();
    }
    ctx->save_for_backward({hidden, weight, bias, targets, lse});
    ctx->saved_data["chunk"] = chunk;
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& hidden = saved[0];
    const auto& weight = saved[1];
    const auto& bias = saved[2];
    const auto& targets = saved[3];
    const auto& lse = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto grad = grad_outputs[0].to(torch::kFloat32);
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = bias.numel() > 0 && ctx->needs_input_grad(2);
    torch::NoGradGuard no_grad;
    const int64_t n = hidden.size(0);
    torch::Tensor grad_h = need_h ? torch::empty_like(hidden) : torch::Tensor();
    torch::Tensor grad_w = need_w ? torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32)) : torch::Tensor();
    torch::Tensor grad_b = need_b ? torch::zeros(bias.sizes(), bias.options().dtype(torch::kFloat32)) : torch::Tensor();
    const bool openblas = linear_uses_openblas(hidden, weight, bias.numel() > 0 ? bias : torch::Tensor());
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto h = hidden.narrow(0, start, len);
      auto t = targets.narrow(0, start, len);
      // d(lse - picked)/dlogits = softmax - one_hot(target), zero for ignored tokens.
      auto logits = chunk_logits(h, weight, bias);
      torch::Tensor d;
      if (fused_kernels_for(logits)) {
        d = fused_cross_entropy_rows_backward(logits, t, lse.narrow(0, start, len), grad);
      } else {
        d = (logits - lse.narrow(0, start, len).unsqueeze(1)).exp_();
        auto valid = (t != -100);
        d.scatter_add_(1, t.clamp_min(0).unsqueeze(1), -valid.to(torch::kFloat32).unsqueeze(1));
        d.mul_((valid.to(torch::kFloat32) * grad).unsqueeze(1));
      }
      if (openblas) {
        // Straight into grad_h's rows and accumulated into grad_w (beta 1): no temporaries.
        const int64_t vocab = weight.size(0), dim = weight.size(1);
        if (need_h) {
          cpu_sgemm(false, false, len, dim, vocab, d.data_ptr<float>(), vocab, weight.data_ptr<float>(), dim, 0.f,
                    grad_h.narrow(0, start, len).data_ptr<float>(), dim);
        }
        if (need_w) {
          cpu_sgemm(true, false, vocab, dim, len, d.data_ptr<float>(), vocab, h.data_ptr<float>(), dim, 1.f,
                    grad_w.data_ptr<float>(), dim);
        }
      } else {
        auto d_in = d.to(h.scalar_type());
        if (need_h) grad_h.narrow(0, start, len).copy_(torch::matmul(d_in, weight.to(h.scalar_type())));
        if (need_w) grad_w.add_(torch::matmul(d_in.t(), h).to(torch::kFloat32));
      }
      if (need_b) grad_b.add_(d.sum(0));
    }
    if (need_w) grad_w = grad_w.to(weight.scalar_type());
    if (need_b) grad_b = grad_b.to(bias.scalar_type());
    return {grad_h, grad_w, grad_b, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear_cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                       const torch::Tensor& bias, const torch::Tensor& targets, int64_t chunk) {
  if (hidden.dim() != 2 || weight.dim() != 2 || hidden.size(1) != weight.size(1)) {
    fail("linear_cross_entropy_sum: hidden {} and weight {} do not fit ([N, H] and [V, H])", c10::str(hidden.sizes()),
         c10::str(weight.sizes()));
  }
  if (targets.dim() != 1 || targets.size(0) != hidden.size(0)) {
    fail("linear_cross_entropy_sum: targets {} for {} tokens", c10::str(targets.sizes()), hidden.size(0));
  }
  if (hidden.size(0) == 0) return torch::zeros({}, hidden.options().dtype(torch::kFloat32));
  if (chunk <= 0) chunk = hidden.size(0);
  // No bias: an empty tensor (autograd functions take defined tensors only).
  const auto b = bias.defined() ? bias : torch::zeros({0}, weight.options().requires_grad(false));
  return LinearCrossEntropy::apply(hidden.contiguous(), weight, b, targets.to(torch::kInt64), chunk);
}

}  // namespace replica::models
