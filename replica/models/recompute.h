// Activation (gradient) checkpointing of one layer: its forward runs without keeping the
// activations autograd would save, and its backward runs the forward again to get them
// (Note [recompute] in recompute.cpp). Memory per layer drops to its input; compute grows by
// one forward.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <vector>

namespace replica::models {

// fn(x) for `layer` (whose parameters fn uses), checkpointed when autograd records (else a plain
// call). fn must compute the same thing when called again: what it captures stays alive and
// unchanged until the backward (the RNG and autocast state are restored for it). The layer's
// buffers are left by the recomputation as the first forward left them (BatchNorm's running
// statistics are updated once, not twice).
torch::Tensor recomputed(torch::nn::Module& layer, std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& x);

// The same for a layer with several outputs (a mixture-of-experts layer's hidden states and
// its router scores, which the load-balancing loss reads): every output gets the recomputing
// node as its history, and a backward through any of them (or all) recomputes once. fn must
// return the same number of outputs each time.
std::vector<torch::Tensor> recomputed_outputs(torch::nn::Module& layer,
                                              std::function<std::vector<torch::Tensor>(const torch::Tensor&)> fn,
                                              const torch::Tensor& x);

}  // namespace replica::models
