// GPT-OSS's mixture-of-experts MLP, numerically transformers' GptOssMLP (router + experts):
//   router   logits = x W^T + b over E experts; the top k logits per token, softmax over those
//            k; scores [N, E] are those k weights scattered into zeros (transformers returns
//            the same tensor as "router_logits", and its load-balancing loss reads it);
//   experts  per expert e, on the tokens routed to it: gate_up = x W_e + b_e (gate and up
//            interleaved in the last dimension: gate = [..., ::2], up = [..., 1::2]),
//            gate clamped above at `limit`, up clamped to [-limit, limit],
//            h = (up + 1) * gate * sigmoid(alpha * gate), out = h D_e + d_e; the outputs
//            weighted by the token's score for e and summed.
// Parameter names and shapes are the checkpoint's (one tensor for all experts, as
// transformers keeps them):
//   mlp.router.weight [E, H], mlp.router.bias [E]
//   mlp.experts.gate_up_proj [E, H, 2I], mlp.experts.gate_up_proj_bias [E, 2I]
//   mlp.experts.down_proj [E, I, H],     mlp.experts.down_proj_bias [E, H]
//
// Note [experts under data parallelism]
// The experts are four tensors, each holding every expert, so a step in which no token on
// this worker went to expert e still gives those tensors a gradient (zero in e's rows):
// DDP's buckets see every parameter ready in every backward and no rank waits on another's
// routing (no find_unused_parameters, no hang when the ranks route to disjoint experts), and
// ZeRO-3 gathers the same group on every rank whatever the routing.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace replica::models {

struct MoeConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per expert
  int64_t num_experts = 0;        // num_local_experts
  int64_t top_k = 0;              // num_experts_per_tok
  double alpha = 1.702;           // GPT-OSS's SwiGLU: gate * sigmoid(alpha * gate)
  double limit = 7.0;             // the clamp
  double initializer_range = 0.02;
};

class TopKRouterImpl : public torch::nn::Module {
 public:
  // init: transformers' _init_weights (N(0, initializer_range)); else uninitialised (a load follows).
  TopKRouterImpl(const MoeConfig& c, torch::ScalarType dtype, bool init);
  // x [N, H] -> (scores [N, E], indices [N, k]).
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x);

  torch::Tensor weight, bias;

 private:
  int64_t top_k_;
};
TORCH_MODULE(TopKRouter);

class ExpertsImpl : public torch::nn::Module {
 public:
  ExpertsImpl(const MoeConfig& c, torch::ScalarType dtype, bool init);
  // x [N, H], indices [N, k], scores [N, E] -> [N, H].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& indices, const torch::Tensor& scores);

  torch::Tensor gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias;

 private:
  MoeConfig c_;
};
TORCH_MODULE(Experts);

class MoeMlpImpl : public torch::nn::Module {
 public:
  MoeMlpImpl(const MoeConfig& c, torch::ScalarType dtype, bool init);
  // x [B, T, H] -> [B, T, H]. The router's scores are kept for the load-balancing loss
  // (last_router_scores) until the next forward.
  torch::Tensor forward(const torch::Tensor& x);
  const torch::Tensor& last_router_scores() const { return last_scores_; }

  TopKRouter router{nullptr};
  Experts experts{nullptr};

 private:
  torch::Tensor last_scores_;
};
TORCH_MODULE(MoeMlp);

// transformers' load_balancing_loss_func (Switch Transformer, eqs. 4-6) over every layer's
// router scores ([N, E] each, concatenated): softmax over the scores, the top-k experts per
// token; E * sum_e (fraction of tokens routed to e) * (mean probability of e). `token_mask`
// ([N], or [B, T] with B T = N; 1 = a real token) restricts both means to real tokens;
// undefined: every token.
torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& router_scores, int64_t num_experts,
                                  int64_t top_k, const torch::Tensor& token_mask = {});

}  // namespace replica::models
