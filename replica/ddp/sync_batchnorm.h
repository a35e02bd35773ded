// Collectives that autograd can see, and SyncBatchNorm built on them.
//
// all_gather_with_grad: every rank gets the concatenation of every rank's rows; its backward
// sums the gradient over ranks and hands each rank its own rows (the gradient of the sum of
// all ranks' losses). Two-tower training uses it so that in-batch negatives span the global
// batch: world 2 then trains exactly as world 1 with the same global batch.
//
// SyncBatchNorm2d (PyTorch's nn.SyncBatchNorm for [N, C, H, W]): in training, the batch mean
// and variance of each channel are taken over the samples of every rank (one all-reduce of
// the per-channel sums and sums of squares, in float64); backward all-reduces the gradient of
// those sums, so the result equals BatchNorm2d on the concatenated global batch. Without a
// process group, or in a world of one, or in eval mode, it is plain BatchNorm2d. Its
// parameters and buffers have BatchNorm2d's names (weight, bias, running_mean, running_var,
// num_batches_tracked), so checkpoints move freely between the two.
// Every rank must call forward in the same order with the same channel count (collectives).
#pragma once

#include "replica/distributed/process_group.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>

namespace replica::ddp {

// Rows of `x` ([n, ...], the same shape on every rank) from every rank, in rank order.
torch::Tensor all_gather_with_grad(const torch::Tensor& x, distributed::ProcessGroup& pg);

// In-place-free sum over ranks whose backward is again a sum over ranks.
torch::Tensor all_reduce_sum_with_grad(const torch::Tensor& x, distributed::ProcessGroup& pg);

class SyncBatchNorm2dImpl : public torch::nn::Module {
 public:
  SyncBatchNorm2dImpl(int64_t num_features, std::shared_ptr<distributed::ProcessGroup> pg, double eps = 1e-5,
                      double momentum = 0.1);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  int64_t num_features_;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  double eps_, momentum_;
};
TORCH_MODULE(SyncBatchNorm2d);

}  // namespace replica::ddp
