// Global-norm gradient clipping for gradients that may be sharded across ranks (ZeRO-3's
// master shards, DDP's shard_optimizer shards): torch::nn::utils::clip_grad_norm_'s rule over
// the norm of all of them.
#pragma once

#include "replica/distributed/process_group.h"

#include <torch/types.h>

#include <vector>

namespace replica::distributed {

// Scales `grads` in place by max_norm / (norm + 1e-6) when that is below 1 (max_norm infinity
// only measures) and returns the norm before clipping. `shards_across`: the group over which
// the gradients are disjoint shards, whose squared norms are summed (collective); null when
// `grads` are the whole set on every rank. Undefined tensors are skipped.
double clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm, ProcessGroup* shards_across);

}  // namespace replica::distributed
