// A multilayer perceptron: flatten, then Linear+ReLU per hidden size, then a Linear head.
// PyTorch's nn.Linear initialisation (the peer benchmark uses the same model).
//
// Parameter names (stable; checkpoints and the sharded engines key on them) match
// PyTorch's nn.Sequential(nn.Linear, nn.ReLU, ..., nn.Linear) registered as `layers`:
// Linear k sits at Sequential index 2k, so MLP(784, {256, 128}, 10) has
//   layers.0.weight [256, 784]  layers.0.bias [256]
//   layers.2.weight [128, 256]  layers.2.bias [128]
//   layers.4.weight [10, 128]   layers.4.bias [10]      (235,146 parameters in all).
// Bad sizes, or an input whose features do not match in_features, are replica::Error.
#pragma once

#include "replica/models/layer_hooks.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace replica::models {

// Note [model size bounds]
// The sizes of replica's own models come from YAML keys and from data (hidden_sizes,
// embedding_dim, the largest id): a mistyped one (hidden_sizes: [2147483647]) would ask
// LibTorch for terabytes. Each width is bounded where its key is checked, and the whole
// model's parameter count where the model is sized, before anything is allocated: 2^32
// parameters (16 GiB in fp32, before gradients and optimizer state) is beyond any model these
// tasks train, and below what would exhaust a machine before the first step.
inline constexpr int64_t kMaxLayerWidth = int64_t{1} << 16;
inline constexpr int64_t kMaxModelParameters = int64_t{1} << 32;

// "" when every width is in [1, kMaxLayerWidth], else "must list widths from 1 to 65536, got
// W": a key's check (params.hidden_sizes).
std::string layer_widths_problem(const std::vector<int64_t>& widths);
// The weights and biases of MLP(in_features, hidden_sizes, out_features), saturating at
// INT64_MAX instead of wrapping.
int64_t mlp_parameter_count(int64_t in_features, const std::vector<int64_t>& hidden_sizes, int64_t out_features);

class MLPImpl : public torch::nn::Module, public HookedLayers {
 public:
  MLPImpl(int64_t in_features, std::vector<int64_t> hidden_sizes, int64_t out_features);
  // x: [B, ...] flattened to [B, in_features]; returns logits [B, out_features].
  torch::Tensor forward(torch::Tensor x);
  // The Linear layers (ZeRO-3 gathers each one's parameters around its forward).
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override;

 private:
  torch::nn::Sequential layers_{nullptr};
  int64_t in_features_ = 0;
};

// What TORCH_MODULE(MLP) would declare, plus a non-template constructor: ModuleHolder's
// forwarding constructor cannot take a braced list, so `MLP(784, {256, 128}, 10)` would not
// compile with the macro alone.
class MLP : public torch::nn::ModuleHolder<MLPImpl> {
 public:
  using torch::nn::ModuleHolder<MLPImpl>::ModuleHolder;
  using Impl = MLPImpl;
  MLP(int64_t in_features, std::vector<int64_t> hidden_sizes, int64_t out_features)
      : ModuleHolder(in_features, std::move(hidden_sizes), out_features) {}
};

}  // namespace replica::models
