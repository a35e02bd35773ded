// Global-norm gradient clipping for gradients that may be sharded across ranks (ZeRO-3's
// master shards, DDP's shard_optimizer shards): torch::nn::utils::clip_grad_norm_'s rule over
// the norm of all of them.
#pragma once

#include "replica/distributed/process_group.h"

#include <torch/types.h>

#include <vector>

namespace replica::distributed {

// Scales `grads` in place by max_norm / (norm + 1e-6) when that is below 1 (max_norm infinity
// only measures) and returns the norm before clipping, a 0-dim float64 tensor: on the CPU for
// CPU gradients (summed in float64), on the GPU for GPU ones, where nothing is read back (Note
// [the gradient norm stays on the GPU] in grad_norm.cpp): the caller reads it when it needs the
// number. `shards_across`: the group over which the gradients are disjoint shards, whose
// squared norms are summed (collective); null when `grads` are the whole set on every rank.
// Undefined tensors are skipped.
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm, ProcessGroup* shards_across);

// The sum of squares of `grads` (defined, of any float dtype, on one or more devices) as a
// 0-dim float64 tensor on the first one's device, computed without reading anything back:
// what clip_grad_norm does for GPU gradients; declared here so that tests run it on CPU tensors
// too. Each tensor's norm accumulates in fp32 (one multi-tensor kernel), the sum in float64.
torch::Tensor sum_of_squares_on_device(const std::vector<torch::Tensor>& grads);

}  // namespace replica::distributed
