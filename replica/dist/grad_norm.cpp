#include "replica/dist/grad_norm.h"

#include <torch/torch.h>

#include <cmath>

namespace replica::dist {

double clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm, ProcessGroup* shards_across) {
  torch::NoGradGuard no_grad;
  double sum_of_squares = 0;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    // Summed in float64: ZeRO-3 must match DDP's clipping to 1e-5 through AdamW, which
    // magnifies a float32 norm's rounding in the clip coefficient.
    sum_of_squares += g.to(torch::kDouble).pow(2).sum().item<double>();
  }
  if (shards_across != nullptr) {
    auto total = torch::tensor({sum_of_squares}, torch::kDouble);
    shards_across->allreduce_sum(total).wait();
    sum_of_squares = total.item<double>();
  }
  const double norm = std::sqrt(sum_of_squares);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const auto& g : grads) {
      if (g.defined()) torch::Tensor(g).mul_(coef);
    }
  }
  return norm;
}

}  // namespace replica::dist
