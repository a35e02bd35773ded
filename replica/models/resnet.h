// ResNet-18 (He et al. 2015, torchvision's resnet18 layout) for small single-channel images
// such as Fashion-MNIST's 28x28.
//
// Parameter names follow torchvision (conv1, bn1, layer1.0.conv1, layer1.0.bn1, ...,
// layer2.0.downsample.0/1, fc), so weights map one to one onto a torchvision model with
// conv1 replaced for in_channels and the stem option below.
// stem: "imagenet" = 7x7 stride-2 conv + 3x3 stride-2 max-pool (torchvision; 28x28 input
// reaches layer1 at 7x7, cheap); "pooled" = 3x3 stride-1 conv + the same max-pool (layer1 at
// 14x14, ~4x the compute: keeps a 2x2 map into layer4 instead of 1x1); "small" = 3x3 stride-1
// conv, no pool (the CIFAR variant; layer1 at 28x28, ~16x the compute).
// The norm layer is pluggable (BatchNorm2d by default) so that DDP runs can put
// ddp::SyncBatchNorm2d in its place; it must keep BatchNorm2d's parameter names.
// Activation checkpointing (set_gradient_checkpointing): each of the four stages (layer1 ..
// layer4, two blocks each) keeps only its input and runs its forward again in backward
// (models/recompute.h); the norm layers' running statistics are updated once per forward as
// without it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>

namespace replica::models {

using NormLayerFactory = std::function<torch::nn::AnyModule(int64_t channels)>;

struct ResNetOptions {
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  std::string stem = "imagenet";  // imagenet | pooled | small
  NormLayerFactory norm_layer;     // empty: torch::nn::BatchNorm2d
};

class ResNet18Impl : public torch::nn::Module {
 public:
  explicit ResNet18Impl(ResNetOptions options = {});
  // x [B, in_channels, H, W] float; returns logits [B, num_classes].
  torch::Tensor forward(torch::Tensor x);
  // Activation checkpointing of every stage: off by default.
  void set_gradient_checkpointing(bool on) { recompute_stages_ = on; }
  bool gradient_checkpointing() const { return recompute_stages_; }

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::AnyModule bn1_;
  std::vector<torch::nn::Sequential> layers_;
  torch::nn::Linear fc_{nullptr};
  bool pool_ = true;
  int64_t in_channels_ = 1;
  bool recompute_stages_ = false;
};
TORCH_MODULE(ResNet18);

}  // namespace replica::models
