#include "replica/models/attention_sinks.h"

#include <torch/torch.h>

#include <limits>

namespace replica::models {

torch::Tensor attention_with_sinks(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& allowed, const torch::Tensor& sinks, double scaling,
                                   double dropout, bool training) {
  const int64_t B = q.size(0), heads = q.size(1), T = q.size(2);
  const int64_t groups = heads / k.size(1);
  // repeat_kv: kv head g serves query heads g*groups .. g*groups + groups - 1.
  auto keys = groups == 1 ? k : k.repeat_interleave(groups, /*dim=*/1);
  auto values = groups == 1 ? v : v.repeat_interleave(groups, /*dim=*/1);
  auto scores = torch::matmul(q, keys.transpose(2, 3)) * scaling;  // [B, h, T, T]
  torch::Tensor mask = allowed;
  if (!mask.defined()) mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).tril();
  // transformers adds a min-float bias where a key is masked; -inf gives the same softmax.
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  auto sink_column = sinks.to(scores.scalar_type()).view({1, heads, 1, 1}).expand({B, heads, T, 1});
  auto combined = torch::cat({scores, sink_column}, -1);
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  auto probs = torch::softmax(combined, -1, combined.scalar_type()).narrow(-1, 0, T);
  if (training && dropout > 0) probs = torch::dropout(probs, dropout, /*train=*/true);
  return torch::matmul(probs, values);  // [B, h, T, D]
}

}  // namespace replica::models
