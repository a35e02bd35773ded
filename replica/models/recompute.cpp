#include "replica/models/recompute.h"

#include "replica/core/error.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include <optional>

namespace replica::models {
namespace {

// Note [recompute]
// PyTorch's torch.utils.checkpoint has two forms. The reentrant one calls backward() on the
// recomputed layer from inside the outer backward, so the parameters' gradients are
// accumulated inside that inner pass: DDP's and ZeRO-3's gradient hooks fire in a nested
// graph task, and the end-of-backward callbacks they queue would run at the end of that
// inner pass (PyTorch's "marked ready twice" with DDP). The non-reentrant one needs saved-
// tensor hooks that LibTorch's C++ API does not have.
//
// This node does neither: its inputs are the layer's input and the layer's trainable
// parameters themselves. In backward it runs the layer's forward again (grad on, the autocast
// state and the RNG state of the first forward restored, so dropout draws the same masks),
// asks torch::autograd::grad for the gradients of input and parameters (which accumulates
// nothing), and returns them as its own outputs. The outer backward then delivers the
// parameters' gradients to their accumulators like any other node's: DDP's buckets and ZeRO-3's
// reductions see them in the outer pass, in order. ZeRO-3's PreBackward node sits on this
// node's output, so the layer's parameters are gathered before the forward runs again.
//
// A layer may have several outputs (recomputed_outputs: a mixture-of-experts layer's hidden
// states and router scores). Each is one output of the node; autograd runs the node once, when
// every output that reached the loss has its gradient (the hidden states' through ZeRO-3's
// PreBackward, so the gather still comes first), and the recomputation differentiates the
// outputs that got one together.
//
// The layer's buffers are put back as they were before the recomputation: a forward in train
// mode updates state as a side effect (BatchNorm's running mean and variance, its batch
// count), and the first forward already did that once. They are written back through
// variable_data(), which shares their memory but not their version counter, so that autograd's
// saved copy of them in the recomputed graph (batch_norm saves the running statistics) is not
// seen as modified in place.
//
// Note [the recomputation clears autocast's cast cache]
// Under autocast, ATen caches the lower-precision copy of every fp32 leaf that requires grad
// (the trainable weights) for as long as autocast stays on, and hands the cached copy to every
// later op that casts the same tensor, whatever was written into the tensor since (the cache is
// keyed by the tensor, not its version). Python's autocast context manager clears the cache
// when its outermost scope exits, and the trainer clears it after each forward. The
// recomputation turns autocast on again inside the backward, so it must clear what it cached:
// left in place, the copies of the trainable weights (LoRA's adapters) taken in this backward
// were served to the next step's forward after the optimizer had changed the weights, and bf16
// LoRA trained on stale adapters (the loss rose after the first update). Only paths that cast
// through autocast hit it: ATen's bf16 GEMM on CPUs with bf16 arithmetic and every GPU, not the
// fp32-through path of CPUs without it (models/linear.cpp), which casts explicitly.
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
};

AutocastState autocast_state(c10::DeviceType device) {
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
}

void set_autocast_state(c10::DeviceType device, const AutocastState& s) {
  at::autocast::set_autocast_enabled(device, s.enabled);
  at::autocast::set_autocast_dtype(device, s.dtype);
}

using LayerFn = std::function<std::vector<torch::Tensor>(const torch::Tensor&)>;

struct RecomputeBackward final : torch::autograd::Node {
  LayerFn fn;
  torch::Tensor input;              // the layer's input, detached
  bool input_requires_grad = false;
  std::vector<torch::Tensor> params;  // trainable, in next-edge order after the input
  std::vector<torch::Tensor> buffers;  // the layer's, restored after the recomputation
  c10::Device device = torch::kCPU;
  AutocastState autocast;
  torch::Tensor cpu_rng;
  std::optional<torch::Tensor> device_rng;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // The first forward's RNG state for the recomputation; the run's own continues after it.
    at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
    const torch::Tensor cpu_now = cpu_gen.get_state();
    cpu_gen.set_state(cpu_rng);
    std::optional<at::Generator> device_gen;
    torch::Tensor device_now;
    if (device_rng) {
      device_gen = at::globalContext().defaultGenerator(device);
      device_now = device_gen->get_state();
      device_gen->set_state(*device_rng);
    }
    const AutocastState autocast_now = autocast_state(device.type());
    set_autocast_state(device.type(), autocast);

    torch::autograd::variable_list out(1 + params.size());
    {
      std::vector<torch::Tensor> kept;
      kept.reserve(buffers.size());
      for (const auto& b : buffers) kept.push_back(b.detach().clone());
      torch::AutoGradMode grad_on(true);
      torch::Tensor x = input.detach().requires_grad_(input_requires_grad);
      // Note [the recomputation clears autocast's cast cache]: as the outermost autocast
      // scope does on exit.
      if (autocast.enabled) at::autocast::increment_nesting();
      const std::vector<torch::Tensor> ys = fn(x);
      set_autocast_state(device.type(), autocast_now);
      if (autocast.enabled && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < buffers.size(); ++i) buffers[i].variable_data().copy_(kept[i]);
      }
      torch::autograd::variable_list inputs;
      if (input_requires_grad) inputs.push_back(x);
      inputs.insert(inputs.end(), params.begin(), params.end());
      // The outputs the outer backward reached (an undefined gradient: that output was not used).
      torch::autograd::variable_list outputs, output_grads;
      for (size_t i = 0; i < ys.size() && i < grads.size(); ++i) {
        if (grads[i].defined() && ys[i].requires_grad()) {
          outputs.push_back(ys[i]);
          output_grads.push_back(grads[i]);
        }
      }
      if (!inputs.empty() && !outputs.empty()) {
        const auto got = torch::autograd::grad(outputs, inputs, output_grads, /*retain_graph=*/false,
                                               /*create_graph=*/false, /*allow_unused=*/true);
        size_t k = 0;
        if (input_requires_grad) out[0] = got[k++];
        for (size_t i = 0; i < params.size(); ++i) out[1 + i] = got[k++];
      }
    }
    set_autocast_state(device.type(), autocast_now);
    cpu_gen.set_state(cpu_now);
    if (device_gen) device_gen->set_state(device_now);
    return out;
  }

  void release_variables() override {
    input = torch::Tensor();
    fn = nullptr;
    buffers.clear();
  }
};

}  // namespace

std::vector<torch::Tensor> recomputed_outputs(torch::nn::Module& layer, LayerFn fn, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  std::vector<torch::Tensor> params;
  for (auto& p : layer.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  if (params.empty() && !x.requires_grad()) return fn(x);

  auto node = std::make_shared<RecomputeBackward>();
  node->device = x.device();
  node->autocast = autocast_state(x.device().type());
  node->cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
  if (x.device().is_cuda()) node->device_rng = at::globalContext().defaultGenerator(x.device()).get_state();
  std::vector<torch::Tensor> ys;
  {
    torch::NoGradGuard no_grad;
    ys = fn(x);
  }
  node->fn = std::move(fn);
  node->input = x.detach();
  node->input_requires_grad = x.requires_grad();
  node->params = params;
  for (auto& b : layer.buffers()) {
    if (b.defined()) node->buffers.push_back(b);
  }
  torch::autograd::edge_list edges = torch::autograd::collect_next_edges(x);
  for (const auto& p : params) {
    auto more = torch::autograd::collect_next_edges(p);
    edges.insert(edges.end(), more.begin(), more.end());
  }
  node->set_next_edges(std::move(edges));
  // Output i of the node is ys[i]: the backward's grads[i] is its gradient.
  for (const auto& y : ys) {
    if (y.defined() && !at::isFloatingType(y.scalar_type())) {
      fail("recomputed_outputs: a checkpointed layer's outputs must be floating-point tensors, got {}",
           c10::toString(y.scalar_type()));
    }
  }
  torch::autograd::set_history(ys, node);
  return ys;
}

torch::Tensor recomputed(torch::nn::Module& layer, std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& x) {
  return recomputed_outputs(layer, [fn = std::move(fn)](const torch::Tensor& in) {
    return std::vector<torch::Tensor>{fn(in)};
  }, x)[0];
}

}  // namespace replica::models
