#include "replica/models/resnet.h"

#include "replica/core/error.h"
#include "replica/models/recompute.h"

#include <torch/torch.h>

namespace replica::models {
namespace {

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// torchvision's BasicBlock: conv3x3-bn-relu-conv3x3-bn, plus the (downsampled) input.
class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride, const NormLayerFactory& norm) {
    conv1_ = register_module("conv1", conv(in, out, 3, stride));
    bn1_ = norm(out);
    register_module("bn1", bn1_.ptr());
    conv2_ = register_module("conv2", conv(out, out, 3, 1));
    bn2_ = norm(out);
    register_module("bn2", bn2_.ptr());
    // Zero-init of the last norm's scale is left out (torchvision's default keeps it at 1).
    if (stride != 1 || in != out) {
      torch::nn::Sequential down;
      down->push_back(conv(in, out, 1, stride));
      down->push_back(norm(out));
      downsample_ = register_module("downsample", down);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::relu(bn1_.forward(conv1_->forward(x)));
    y = bn2_.forward(conv2_->forward(y));
    return torch::relu(y + (downsample_ ? downsample_->forward(x) : x));
  }

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::AnyModule bn1_, bn2_;
  torch::nn::Sequential downsample_{nullptr};
};
TORCH_MODULE(BasicBlock);

}  // namespace

ResNet18Impl::ResNet18Impl(ResNetOptions options) {
  if (options.in_channels < 1 || options.num_classes < 1) {
    fail("ResNet-18: in_channels {} and num_classes {} must be >= 1", options.in_channels, options.num_classes);
  }
  if (options.stem != "imagenet" && options.stem != "pooled" && options.stem != "small") {
    fail("ResNet-18: stem '{}' (imagenet | pooled | small)", options.stem);
  }
  NormLayerFactory norm = options.norm_layer;
  if (!norm) norm = [](int64_t c) { return torch::nn::AnyModule(torch::nn::BatchNorm2d(c)); };
  in_channels_ = options.in_channels;
  pool_ = options.stem != "small";
  conv1_ = register_module("conv1", options.stem == "imagenet" ? conv(options.in_channels, 64, 7, 2)
                                                                : conv(options.in_channels, 64, 3, 1));
  bn1_ = norm(64);
  register_module("bn1", bn1_.ptr());
  const int64_t widths[] = {64, 128, 256, 512};
  int64_t in = 64;
  for (int i = 0; i < 4; ++i) {
    torch::nn::Sequential layer;
    layer->push_back(BasicBlock(in, widths[i], i == 0 ? 1 : 2, norm));
    layer->push_back(BasicBlock(widths[i], widths[i], 1, norm));
    in = widths[i];
    layers_.push_back(register_module(fmt::format("layer{}", i + 1), layer));
  }
  fc_ = register_module("fc", torch::nn::Linear(512, options.num_classes));
  // torchvision's initialisation: kaiming_normal(fan_out, relu) for convolutions.
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<torch::nn::Conv2d>()) {
      torch::nn::init::kaiming_normal_(c->weight, 0, torch::kFanOut, torch::kReLU);
    }
  }
}

torch::Tensor ResNet18Impl::forward(torch::Tensor x) {
  if (x.dim() != 4 || x.size(1) != in_channels_) {
    fail("ResNet-18: input of shape {} is not [B, {}, H, W]", c10::str(x.sizes()), in_channels_);
  }
  x = torch::relu(bn1_.forward(conv1_->forward(x)));
  if (pool_) x = torch::max_pool2d(x, 3, 2, 1);
  for (auto& layer : layers_) {
    if (!recompute_stages_) {
      x = layer->forward(x);
      continue;
    }
    // The closure holds the stage (a Sequential's handle) until the recomputation in backward.
    x = recomputed(*layer, [stage = layer.ptr()](const torch::Tensor& in) { return stage->forward(in); }, x);
  }
  x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
  return fc_->forward(x);
}

}  // namespace replica::models
