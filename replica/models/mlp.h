// A multilayer perceptron: flatten, then Linear+ReLU per hidden size, then a Linear head.
// PyTorch's nn.Linear initialisation (the peer benchmark uses the same model).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <vector>

namespace replica::models {

class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl(int64_t in_features, std::vector<int64_t> hidden_sizes, int64_t out_features);
  // x: [B, ...] flattened to [B, in_features]; returns logits [B, out_features].
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Sequential layers_{nullptr};
};
TORCH_MODULE(MLP);

}  // namespace replica::models
