// Layer hooks: a model that runs its forward layer by layer lets an engine run code just
// before and just after each layer. ZeRO-3 (replica/zero) needs exactly this to gather a
// layer's sharded parameters right before the layer computes and free them right after;
// LibTorch's C++ modules have no forward hooks of their own.
//
// A model opts in by deriving from HookedLayers, listing its layers in forward order and
// wrapping each layer call in run_layer(). With no hooks set (the default) run_layer is a
// plain call.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <vector>

namespace replica::models {

class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  // Called just before `layer` computes (possibly several times per forward: tied weights).
  virtual void before(torch::nn::Module& layer) = 0;
  // Called with the layer's output; returns what the model uses in its place (the same
  // values; an engine may attach an autograd node to it).
  virtual torch::Tensor after(torch::nn::Module& layer, torch::Tensor output) = 0;
};

class HookedLayers {
 public:
  virtual ~HookedLayers() = default;
  // The layers run_layer() is called with, in forward order (each holds its parameters).
  virtual std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() = 0;
  // nullptr removes the hooks. The hooks must outlive their use by this model.
  virtual void set_layer_hooks(LayerHooks* hooks) { layer_hooks_ = hooks; }
  LayerHooks* layer_hooks() const { return layer_hooks_; }

 protected:
  template <typename Fn>
  torch::Tensor run_layer(torch::nn::Module& layer, Fn&& fn) {
    if (!layer_hooks_) return fn();
    layer_hooks_->before(layer);
    return layer_hooks_->after(layer, fn());
  }

 private:
  LayerHooks* layer_hooks_ = nullptr;
};

}  // namespace replica::models
