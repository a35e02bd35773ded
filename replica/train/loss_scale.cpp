#include "replica/train/loss_scale.h"

#include "replica/distributed/process_group.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <torch/torch.h>

#include <unordered_map>

namespace replica::train {

bool LossScaler::unscale_and_check(const std::vector<torch::Tensor>& params, distributed::ProcessGroup& pg,
                                   bool loss_nonfinite) {
  if (!enabled_) return true;
  // ATen's fused check-and-unscale (what GradScaler runs), per device, on the gradients.
  std::unordered_map<c10::Device, std::vector<torch::Tensor>> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads[p.grad().device()].push_back(p.grad());
  }
  double found = loss_nonfinite ? 1 : 0;
  for (auto& [device, list] : grads) {
    auto found_inf = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    auto inv_scale = torch::full({1}, 1.0 / scale_, torch::TensorOptions().dtype(torch::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(list, found_inf, inv_scale);
    found += found_inf.item<float>();
  }
  auto flag = torch::tensor({found}, torch::kDouble);
  pg.allreduce_sum(flag).wait();
  return flag.item<double>() == 0;
}

void LossScaler::update(bool finite) {
  if (!enabled_) return;
  if (!finite) {
    scale_ *= kBackoffFactor;
    good_steps_ = 0;
    return;
  }
  if (++good_steps_ >= kGrowthInterval) {
    scale_ *= kGrowthFactor;
    good_steps_ = 0;
  }
}

}  // namespace replica::train
