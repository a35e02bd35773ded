// Where a parameter's gradient is to be written: Megatron-LM's `main_grad` with its
// gradient_accumulation_fusion, for LibTorch.
//
// Why: DDP keeps every gradient in a flat bucket so the all-reduce needs no copy. Autograd
// writes a parameter's gradient into a tensor of its own, and DDP then copies it into the
// bucket: one extra write and read of every gradient, every step, which on a memory-bound CPU
// step costs as much as the all-reduce. DDP names each parameter's slot in its bucket here; a
// layer that computes its weight gradient itself (models::FusedLinear) writes it straight into
// that slot and leaves autograd nothing to accumulate.
//
// A registry keyed by the parameter (its autograd identity, which set_data() keeps), because
// LibTorch tensors carry no attributes. Thread-safe.
#pragma once

#include <torch/types.h>

namespace replica {

// `home`: a contiguous tensor shaped like `param`; an undefined tensor removes the entry.
void set_gradient_home(const torch::Tensor& param, torch::Tensor home);
// The slot registered for `param`, or an undefined tensor.
torch::Tensor gradient_home(const torch::Tensor& param);

}  // namespace replica
