#include "replica/models/mlp.h"

#include "replica/core/error.h"
#include "replica/models/fused_linear.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdint>

namespace replica::models {

std::string layer_widths_problem(const std::vector<int64_t>& widths) {
  for (int64_t w : widths) {
    if (w < 1 || w > kMaxLayerWidth) return fmt::format("must list widths from 1 to {}, got {}", kMaxLayerWidth, w);
  }
  return "";
}

int64_t mlp_parameter_count(int64_t in_features, const std::vector<int64_t>& hidden_sizes, int64_t out_features) {
  int64_t total = 0;
  int64_t width = in_features;
  std::vector<int64_t> outs = hidden_sizes;
  outs.push_back(out_features);
  for (int64_t out : outs) {
    int64_t layer = 0;  // width x out weights + out biases
    if (__builtin_mul_overflow(width, out, &layer) || __builtin_add_overflow(layer, out, &layer) ||
        __builtin_add_overflow(total, layer, &total)) {
      return INT64_MAX;
    }
    width = out;
  }
  return total;
}

MLPImpl::MLPImpl(int64_t in_features, std::vector<int64_t> hidden_sizes, int64_t out_features) {
  if (in_features < 1) fail("MLP: in_features {} must be at least 1", in_features);
  if (out_features < 1) fail("MLP: out_features {} must be at least 1", out_features);
  for (size_t i = 0; i < hidden_sizes.size(); ++i) {
    if (hidden_sizes[i] < 1) fail("MLP: hidden size {} (layer {}) must be at least 1",
                                  hidden_sizes[i], i);
  }
  // The callers name their keys first (Note [model size bounds]); this is the last line.
  const int64_t parameters = mlp_parameter_count(in_features, hidden_sizes, out_features);
  if (parameters > kMaxModelParameters) {
    fail("MLP: {} -> [{}] -> {} has {} parameters, more than the {} replica builds", in_features,
         fmt::join(hidden_sizes, ", "), out_features, parameters, kMaxModelParameters);
  }
  in_features_ = in_features;
  // One Sequential named "layers" gives PyTorch-style parameter names (see mlp.h). Linear's
  // default reset_parameters is PyTorch's: kaiming_uniform(a=sqrt(5)) weights and
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) biases. FusedLinear is Linear whose backward writes the
  // weight gradient straight into DDP's bucket (fused_linear.h).
  torch::nn::Sequential layers;
  int64_t width = in_features;
  for (int64_t hidden : hidden_sizes) {
    layers->push_back(FusedLinear(width, hidden));
    layers->push_back(torch::nn::ReLU());
    width = hidden;
  }
  layers->push_back(FusedLinear(width, out_features));
  layers_ = register_module("layers", layers);
}

torch::Tensor MLPImpl::forward(torch::Tensor x) {
  if (x.dim() < 1) fail("MLP: input must have a batch dimension, got a scalar");
  // [B] is B samples of one feature; [B, ...] flattens everything after the batch dimension.
  torch::Tensor flat = x.dim() == 1 ? x.unsqueeze(1) : x.flatten(1);
  if (flat.size(1) != in_features_) {
    fail("MLP: input of shape {} has {} features per sample, expected {}", c10::str(x.sizes()),
         flat.size(1), in_features_);
  }
  if (!layer_hooks()) return layers_->forward(flat);
  torch::Tensor h = flat;
  for (auto& layer : *layers_) h = run_layer(*layer.ptr(), [&] { return layer.forward(h); });
  return h;
}

std::vector<std::shared_ptr<torch::nn::Module>> MLPImpl::hooked_layers() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& layer : *layers_) {
    if (!layer.ptr()->parameters(/*recurse=*/true).empty()) out.push_back(layer.ptr());
  }
  return out;
}

}  // namespace replica::models
