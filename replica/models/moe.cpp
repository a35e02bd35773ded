#include "replica/models/moe.h"

#include "replica/core/error.h"

#include <torch/torch.h>

namespace replica::models {

TopKRouterImpl::TopKRouterImpl(const MoeConfig& c, torch::ScalarType dtype, bool init) : top_k_(c.top_k) {
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    fail("num_experts_per_tok must be between 1 and num_local_experts ({}), got {}", c.num_experts, c.top_k);
  }
  weight = register_parameter("weight", torch::empty({c.num_experts, c.hidden_size}, torch::dtype(dtype)));
  bias = register_parameter("bias", torch::empty({c.num_experts}, torch::dtype(dtype)));
  if (init) {
    torch::NoGradGuard no_grad;
    weight.normal_(0.0, c.initializer_range);
    bias.normal_(0.0, c.initializer_range);
  }
}

std::pair<torch::Tensor, torch::Tensor> TopKRouterImpl::forward(const torch::Tensor& x) {
  auto logits = torch::nn::functional::linear(x, weight, bias);  // [N, E]
  auto [top_values, top_indices] = logits.topk(top_k_, /*dim=*/-1);
  // Softmax over the chosen k, in the logits' dtype (transformers' dtype=router_top_value.dtype).
  auto weights = torch::softmax(top_values, /*dim=*/1, top_values.scalar_type());
  auto scores = torch::zeros_like(logits).scatter(1, top_indices, weights);
  return {scores, top_indices};
}

ExpertsImpl::ExpertsImpl(const MoeConfig& c, torch::ScalarType dtype, bool init) : c_(c) {
  const auto o = torch::dtype(dtype);
  gate_up_proj = register_parameter("gate_up_proj", torch::empty({c.num_experts, c.hidden_size, 2 * c.intermediate_size}, o));
  gate_up_proj_bias = register_parameter("gate_up_proj_bias", torch::empty({c.num_experts, 2 * c.intermediate_size}, o));
  down_proj = register_parameter("down_proj", torch::empty({c.num_experts, c.intermediate_size, c.hidden_size}, o));
  down_proj_bias = register_parameter("down_proj_bias", torch::empty({c.num_experts, c.hidden_size}, o));
  if (init) {
    torch::NoGradGuard no_grad;
    gate_up_proj.normal_(0.0, c.initializer_range);
    gate_up_proj_bias.zero_();
    down_proj.normal_(0.0, c.initializer_range);
    down_proj_bias.zero_();
  }
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& x, const torch::Tensor& indices, const torch::Tensor& scores) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  // Tokens grouped by expert: only the experts some token chose run (transformers' training
  // path), each on its own tokens. The parameters still get a gradient in every step: Note
  // [experts under data parallelism] in moe.h.
  auto out = torch::zeros_like(x);
  torch::Tensor flat_experts, flat_tokens;
  {
    torch::NoGradGuard no_grad;
    const int64_t k = indices.size(1);
    flat_experts = indices.reshape(-1);  // [N k]
    flat_tokens = torch::arange(x.size(0), indices.options()).repeat_interleave(k);
  }
  const auto hit = std::get<0>(at::_unique(flat_experts, /*sorted=*/true));
  const auto hit_cpu = hit.to(torch::kCPU);
  const auto* ids = hit_cpu.data_ptr<int64_t>();
  for (int64_t n = 0; n < hit_cpu.numel(); ++n) {
    const int64_t e = ids[n];
    torch::Tensor token_idx;
    {
      torch::NoGradGuard no_grad;
      token_idx = flat_tokens.masked_select(flat_experts == e);  // ascending, as torch.where gives
    }
    auto h = x.index_select(0, token_idx);
    auto gate_up = torch::matmul(h, gate_up_proj[e]) + gate_up_proj_bias[e];
    auto gate = gate_up.index({"...", Slice(None, None, 2)}).clamp_max(c_.limit);
    auto up = gate_up.index({"...", Slice(1, None, 2)}).clamp(-c_.limit, c_.limit);
    auto glu = gate * torch::sigmoid(gate * c_.alpha);
    auto y = torch::matmul((up + 1) * glu, down_proj[e]) + down_proj_bias[e];
    y = y * scores.index({token_idx, e}).unsqueeze(-1);
    out = out.index_add(0, token_idx, y.to(x.scalar_type()));
  }
  return out;
}

MoeMlpImpl::MoeMlpImpl(const MoeConfig& c, torch::ScalarType dtype, bool init) {
  router = register_module("router", TopKRouter(c, dtype, init));
  experts = register_module("experts", Experts(c, dtype, init));
}

torch::Tensor MoeMlpImpl::forward(const torch::Tensor& x) {
  const auto shape = x.sizes().vec();
  auto flat = x.reshape({-1, shape.back()});
  auto [scores, indices] = router(flat);
  last_scores_ = scores;
  return experts(flat, indices, scores).view(shape);
}

torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& router_scores, int64_t num_experts,
                                  int64_t top_k, const torch::Tensor& token_mask) {
  if (router_scores.empty()) fail("load_balancing_loss: no router scores (no mixture-of-experts layer ran)");
  auto logits = torch::cat(router_scores, 0);                      // [L N, E]
  auto probs = torch::softmax(logits, -1);
  auto selected = std::get<1>(probs.topk(top_k, -1));              // [L N, k]
  auto expert_mask = torch::one_hot(selected, num_experts).to(probs.scalar_type());  // [L N, k, E]
  torch::Tensor tokens_per_expert, prob_per_expert;
  if (!token_mask.defined()) {
    tokens_per_expert = expert_mask.mean(0);                       // [k, E]
    prob_per_expert = probs.mean(0);                               // [E]
  } else {
    const int64_t layers = logits.size(0) / token_mask.numel();
    auto m = token_mask.reshape(-1).to(probs.scalar_type()).repeat({layers});  // [L N]
    tokens_per_expert = (expert_mask * m.view({-1, 1, 1})).sum(0) / m.sum();
    prob_per_expert = (probs * m.view({-1, 1})).sum(0) / m.sum();
  }
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts);
}

}  // namespace replica::models
