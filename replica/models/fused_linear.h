// torch::nn::Linear whose backward writes the weight gradient straight into the gradient's
// home when one is registered (replica/core/gradient_home.h: DDP registers each parameter's
// slot in its all-reduce bucket), like Megatron-LM's gradient_accumulation_fusion.
//
// Without a home (one worker, ZeRO-3, no DDP) it is torch::nn::Linear: same parameters, names,
// initialisation and results. With one, the first backward of a step (weight.grad undefined)
// computes grad_out^T @ input into the home and makes it weight.grad; later backwards of the
// same step (gradient accumulation) add into it. Autograd then receives no weight gradient to
// accumulate, so there is no separate gradient tensor and no copy of it into the bucket: per
// step one write of each weight gradient instead of a write, a read and a second write. Every
// value is the same as torch::nn::Linear's (the same BLAS calls).
//
// Inputs of other than two dimensions, and double backward, take torch::nn::Linear's path.
// Tensor hooks on the weight (register_hook) see no gradient on the fused path.
#pragma once

#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace replica::models {

class FusedLinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  torch::Tensor forward(const torch::Tensor& input);
};
TORCH_MODULE(FusedLinear);

}  // namespace replica::models
