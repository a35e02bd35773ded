#include "replica/models/chunked_cross_entropy.h"

#include "replica/core/cpu_gemm.h"
#include "replica/core/error.h"
#include "replica/models/fused_ops.h"
#include "replica/models/linear.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <algorithm>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Note [the head's product dtype]
// The head multiplies in the dtype torch::linear would: autocast's where autocast is on for the
// hidden states' device when the forward runs (fp32 hidden states and weight under CPU or CUDA
// autocast to bf16), else the hidden states' own. The forward records it and the backward, which
// runs outside autocast, recomputes each chunk's logits in that same dtype, so the gradient
// softmax - one_hot is taken of the logits whose log-sum-exp the forward kept (an fp32 backward
// against a bf16 forward's log-sum-exp would leave softmax rows that do not sum to 1). bf16 or
// fp16 on a CPU without that type's arithmetic goes through the fp32 GEMM (models/linear.h
// cpu_half_matmul; fp16's generic ATen loop is slower still): the
// head is a [tokens, H] x [H, vocab] product three times a step (forward, the backward's
// recomputation, the input gradient), and ATen's generic bf16 CPU GEMM ran it single-threaded at
// ~1/57 of the fp32 speed: 2048 tokens at hidden 4096 and a 32k vocabulary took over 30 minutes
// a step there, whatever the depth of the model.
at::ScalarType product_dtype(const torch::Tensor& hidden) {
  const auto device = hidden.device().type();
  if (at::autocast::is_autocast_enabled(device) && hidden.scalar_type() != torch::kFloat64) {
    return at::autocast::get_autocast_dtype(device);
  }
  return hidden.scalar_type();
}

// Whether h's (bf16 or fp16) products go through the fp32 GEMM here.
bool through_fp32(const torch::Tensor& h) { return h.is_cpu() && cpu_half_through_fp32(h.scalar_type()); }

// a32 [M, K] (fp32) times w [K, N] (bf16 or fp16) summed in fp32, w widened a block of its rows
// (8 MiB of fp32) at a time, and rounded to w's type once: the input gradient d W of a [chunk,
// vocab] by [vocab, H] product without an fp32 copy of W and with GEMMs of full width
// (cpu_half_matmul blocks the other way: by W's columns, 65 at a 32k vocabulary).
torch::Tensor widened_matmul_by_row_blocks(const torch::Tensor& a32, const torch::Tensor& w) {
  const int64_t k = w.size(0), n = w.size(1);
  auto out = torch::zeros({a32.size(0), n}, a32.options());
  const int64_t block = std::max<int64_t>(64, (int64_t{8} << 20) / (4 * std::max<int64_t>(1, n)));
  for (int64_t r = 0; r < k; r += block) {
    const int64_t rb = std::min(block, k - r);
    out.addmm_(a32.narrow(1, r, rb), w.narrow(0, r, rb).to(torch::kFloat32));
  }
  return out.to(w.scalar_type());
}

// The chunk's logits as the head computes them, in fp32; h and weight already in the product
// dtype. In fp32 on the CPU through the model layers' GEMM (models/linear.h: OpenBLAS where
// core/cpu_gemm.h chose it), as the head's forward.
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& weight, const torch::Tensor& bias) {
  const auto optional_bias = bias.numel() > 0 ? bias.to(h.scalar_type()) : torch::Tensor();  // undefined = none
  if (through_fp32(h)) return cpu_half_matmul(h, weight.t(), optional_bias).to(torch::kFloat32);
  // No autocast here: the operands are in the product dtype already (Note [the head's product dtype]).
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (linear_uses_openblas(h, weight, optional_bias)) return models::linear(h, weight, optional_bias);
  auto logits = optional_bias.defined() ? torch::addmm(optional_bias, h, weight.t()) : torch::matmul(h, weight.t());
  return logits.to(torch::kFloat32);
}

struct LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& targets, int64_t chunk) {
    torch::NoGradGuard no_grad;
    const auto dtype = product_dtype(hidden);
    const auto h_all = hidden.to(dtype);
    const auto w = weight.to(dtype);
    const int64_t n = hidden.size(0);
    auto lse = torch::empty({n}, hidden.options().dtype(torch::kFloat32));
    auto total = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto logits = chunk_logits(h_all.narrow(0, start, len), w, bias);
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
    ctx->saved_data["dtype"] = static_cast<int64_t>(dtype);
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
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const auto grad = grad_outputs[0].to(torch::kFloat32);
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = bias.numel() > 0 && ctx->needs_input_grad(2);
    torch::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t n = hidden.size(0);
    const auto h_all = hidden.to(dtype);
    const auto w = weight.to(dtype);
    torch::Tensor grad_h = need_h ? torch::empty(hidden.sizes(), hidden.options().dtype(dtype)) : torch::Tensor();
    torch::Tensor grad_w = need_w ? torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32)) : torch::Tensor();
    torch::Tensor grad_b = need_b ? torch::zeros(bias.sizes(), bias.options().dtype(torch::kFloat32)) : torch::Tensor();
    const bool openblas = linear_uses_openblas(h_all, w, bias.numel() > 0 ? bias.to(dtype) : torch::Tensor());
    const bool widened = through_fp32(h_all);
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto h = h_all.narrow(0, start, len);
      auto t = targets.narrow(0, start, len);
      // d(lse - picked)/dlogits = softmax - one_hot(target), zero for ignored tokens.
      auto logits = chunk_logits(h, w, bias);
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
          cpu_sgemm(false, false, len, dim, vocab, d.data_ptr<float>(), vocab, w.data_ptr<float>(), dim, 0.f,
                    grad_h.narrow(0, start, len).data_ptr<float>(), dim);
        }
        if (need_w) {
          cpu_sgemm(true, false, vocab, dim, len, d.data_ptr<float>(), vocab, h.data_ptr<float>(), dim, 1.f,
                    grad_w.data_ptr<float>(), dim);
        }
      } else {
        // The logits' gradient rounded to the product dtype, as autograd hands a bf16 matmul
        // its gradient.
        auto d_in = d.to(dtype);
        if (need_h) {
          grad_h.narrow(0, start, len)
              .copy_(widened ? widened_matmul_by_row_blocks(d_in.to(torch::kFloat32), w) : torch::matmul(d_in, w));
        }
        if (need_w) {
          // Widened: accumulated in fp32 by one GEMM ([V, H] fp32, no bf16 product to round and
          // add); else the product in the dtype, summed into fp32.
          if (widened) {
            grad_w.addmm_(d_in.t().to(torch::kFloat32), h.to(torch::kFloat32));
          } else {
            grad_w.add_(torch::matmul(d_in.t(), h).to(torch::kFloat32));
          }
        }
      }
      if (need_b) grad_b.add_(d.sum(0));
    }
    if (need_h) grad_h = grad_h.to(hidden.scalar_type());
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
