#include "replica/models/fused_linear.h"

#include "replica/core/gradient_home.h"
#include "replica/models/linear.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether `grad` is `home` itself (not just a tensor of the same shape).
bool is_home(const torch::Tensor& grad, const torch::Tensor& home) {
  return grad.defined() && grad.data_ptr() == home.data_ptr() && grad.sizes() == home.sizes() &&
         grad.strides() == home.strides();
}

// Whether the half-type products of these CPU tensors go through the fp32 GEMM (models/linear.h).
bool through_fp32(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c = {}) {
  return a.is_cpu() && b.is_cpu() && b.scalar_type() == a.scalar_type() &&
         (!c.defined() || (c.is_cpu() && c.scalar_type() == a.scalar_type())) && cpu_half_through_fp32(a.scalar_type());
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias) {
    // The weight's values as they are now (an engine such as ZeRO-3 may swap the parameter's
    // storage after the forward, as torch::nn::Linear's saved weight.t() also ignores), and
    // the parameter itself, whose gradient and gradient home backward looks up.
    // Under autocast (bf16 / fp16) the operands are cast here, as autocast casts linear's, and
    // the cast copies are saved: backward runs outside autocast and must multiply tensors of
    // one dtype (the gradients it returns are cast back to each input's dtype by autograd).
    const c10::DeviceType device = input.device().type();
    const bool autocast = at::autocast::is_autocast_enabled(device) && input.is_floating_point();
    const auto cast = [&](const torch::Tensor& t) {
      return autocast && t.defined() ? t.to(at::autocast::get_autocast_dtype(device)) : t;
    };
    const torch::Tensor x = cast(input), w = cast(weight.detach()), b = cast(bias);
    ctx->save_for_backward({x, w});
    ctx->saved_data["parameter"] = weight;
    ctx->saved_data["has_bias"] = bias.defined();
    // torch::nn::functional::linear's computation for 2-D inputs; bf16 or fp16 on a CPU without
    // that type's arithmetic through the fp32 GEMM, rounded once (models/linear.h: ATen's
    // generic half-type GEMM loop there is tens of times slower than fp32's).
    if (through_fp32(x, w, b)) return cpu_half_matmul(x, w.t(), b);
    return b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& input = saved[0];
    const torch::Tensor& weight = saved[1];
    const torch::Tensor& grad_out = grads[0];
    torch::Tensor grad_input, grad_weight, grad_bias;
    // The products through dtype_matmul: the fp32 GEMM for bf16 / fp16 on a CPU without their
    // arithmetic, else at::mm.
    if (ctx->needs_input_grad(0)) grad_input = dtype_matmul(grad_out, weight);
    if (ctx->needs_input_grad(2) && ctx->saved_data["has_bias"].toBool()) grad_bias = grad_out.sum(0);
    if (ctx->needs_input_grad(1)) {
      torch::Tensor parameter = ctx->saved_data["parameter"].toTensor();
      torch::Tensor home = gradient_home(parameter);
      torch::Tensor& current = parameter.mutable_grad();
      const bool fusable = home.defined() && !torch::GradMode::is_enabled() && home.sizes() == weight.sizes() &&
                           home.is_contiguous() && home.scalar_type() == grad_out.scalar_type();
      const bool widened = through_fp32(grad_out, input);
      if (fusable && !current.defined()) {
        if (widened) {
          home.copy_(cpu_half_matmul(grad_out.t(), input));
        } else {
          at::mm_out(home, grad_out.t(), input);
        }
        current = home;
      } else if (fusable && is_home(current, home)) {
        if (widened) {  // home + the product summed in fp32, rounded once, as addmm_
          home.copy_(at::addmm(home.to(torch::kFloat32), grad_out.t().to(torch::kFloat32), input.to(torch::kFloat32)));
        } else {
          home.addmm_(grad_out.t(), input);
        }
      } else {
        grad_weight = dtype_matmul(grad_out.t(), input);
      }
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

torch::Tensor FusedLinearImpl::forward(const torch::Tensor& input) {
  if (input.dim() != 2) return torch::nn::LinearImpl::forward(input);
  return LinearFunction::apply(input, weight, bias.defined() ? bias : torch::Tensor());
}

}  // namespace replica::models
