#include "replica/ddp/sync_batchnorm.h"

#include "replica/core/error.h"

#include <torch/torch.h>

namespace replica::ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

distributed::ProcessGroup* group_of(AutogradContext* ctx) {
  return reinterpret_cast<distributed::ProcessGroup*>(ctx->saved_data["pg"].toInt());
}

struct AllGatherFunction : public torch::autograd::Function<AllGatherFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t pg_address) {
    auto* pg = reinterpret_cast<distributed::ProcessGroup*>(pg_address);
    ctx->saved_data["pg"] = pg_address;
    ctx->saved_data["rows"] = x.size(0);
    std::vector<torch::Tensor> parts;
    pg->allgather(parts, x.detach().contiguous());
    return torch::cat(parts, 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* pg = group_of(ctx);
    const int64_t rows = ctx->saved_data["rows"].toInt();
    torch::Tensor g = grads[0].contiguous().clone();
    pg->allreduce_sum(g).wait();
    return {g.narrow(0, pg->rank() * rows, rows), torch::Tensor()};
  }
};

struct AllReduceFunction : public torch::autograd::Function<AllReduceFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t pg_address) {
    ctx->saved_data["pg"] = pg_address;
    torch::Tensor out = x.detach().clone();
    reinterpret_cast<distributed::ProcessGroup*>(pg_address)->allreduce_sum(out).wait();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor g = grads[0].contiguous().clone();
    group_of(ctx)->allreduce_sum(g).wait();
    return {g, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_gather_with_grad(const torch::Tensor& x, distributed::ProcessGroup& pg) {
  if (pg.size() == 1) return x;
  return AllGatherFunction::apply(x, reinterpret_cast<int64_t>(&pg));
}

torch::Tensor all_reduce_sum_with_grad(const torch::Tensor& x, distributed::ProcessGroup& pg) {
  if (pg.size() == 1) return x;
  return AllReduceFunction::apply(x, reinterpret_cast<int64_t>(&pg));
}

SyncBatchNorm2dImpl::SyncBatchNorm2dImpl(int64_t num_features, std::shared_ptr<distributed::ProcessGroup> pg, double eps,
                                         double momentum)
    : num_features_(num_features), pg_(std::move(pg)), eps_(eps), momentum_(momentum) {
  if (num_features < 1) fail("SyncBatchNorm2d: num_features must be >= 1, got {}", num_features);
  weight = register_parameter("weight", torch::ones({num_features}));
  bias = register_parameter("bias", torch::zeros({num_features}));
  running_mean = register_buffer("running_mean", torch::zeros({num_features}));
  running_var = register_buffer("running_var", torch::ones({num_features}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
}

torch::Tensor SyncBatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(1) != num_features_) {
    fail("SyncBatchNorm2d: input of shape {} is not [N, {}, H, W]", c10::str(x.sizes()), num_features_);
  }
  if (!is_training() || !pg_ || pg_->size() == 1) {
    if (is_training()) {
      torch::NoGradGuard no_grad;
      num_batches_tracked.add_(1);
    }
    return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), momentum_, eps_,
                             /*cudnn_enabled=*/true);
  }
  // Per-channel sums over this rank's samples, summed over ranks (with gradient).
  torch::Tensor xd = x.to(torch::kDouble);
  torch::Tensor local = torch::cat({xd.sum({0, 2, 3}), (xd * xd).sum({0, 2, 3}),
                                    torch::full({1}, static_cast<double>(x.size(0) * x.size(2) * x.size(3)),
                                                torch::kDouble)});
  torch::Tensor total = all_reduce_sum_with_grad(local, *pg_);
  const double count = total[2 * num_features_].item<double>();
  if (count < 2) fail("SyncBatchNorm2d: needs more than one value per channel across ranks, got {}", count);
  torch::Tensor mean = total.narrow(0, 0, num_features_) / count;
  torch::Tensor var = (total.narrow(0, num_features_, num_features_) / count - mean * mean).clamp_min(0);
  {
    torch::NoGradGuard no_grad;
    running_mean.mul_(1 - momentum_).add_(mean.to(running_mean.scalar_type()) * momentum_);
    running_var.mul_(1 - momentum_).add_(var.to(running_var.scalar_type()) * (momentum_ * count / (count - 1)));
    num_batches_tracked.add_(1);
  }
  torch::Tensor invstd = (var + eps_).rsqrt();
  auto shape = [&](const torch::Tensor& t) { return t.to(x.scalar_type()).view({1, num_features_, 1, 1}); };
  return (x - shape(mean)) * shape(invstd * weight.to(torch::kDouble)) + shape(bias.to(torch::kDouble));
}

}  // namespace replica::ddp
