// Optimizers for the trainer (torch::optim SGD with momentum, AdamW; AdamW with 8-bit state in
// optim_8bit.h, Adafactor in adafactor.h) and their state as named tensors, so checkpoints stay
// in safetensors (no pickle).
#pragma once

#include "replica/io/safetensors.h"
#include "replica/train/run_config.h"

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace replica::train {

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::AdamW;
  double lr = 1e-3;
  double momentum = 0.9;
  double weight_decay = 0.0;
  // Where the state lives and the step runs (Note [optimizer offload] in optim.cpp).
  OffloadDevice offload = OffloadDevice::None;
  std::string nvme_path;  // offload nvme: the swap files' directory
};

// Where an optimizer allocates a parameter's state tensors (zeros shaped like it): RAM by
// default, files under nvme_path for the nvme offload. Load and step both go through it, so a
// resumed run's state lands where a fresh run's would.
using StateAllocator = std::function<torch::Tensor(const torch::Tensor& param)>;
class StateHome {
 public:
  virtual ~StateHome() = default;
  void set_state_allocator(StateAllocator allocate) { allocate_ = std::move(allocate); }
  torch::Tensor state_zeros(const torch::Tensor& param) const;
  // Zeros of another shape or dtype than a parameter's (8-bit state), where state_zeros puts them.
  torch::Tensor state_zeros(at::IntArrayRef sizes, const at::TensorOptions& options) const;

 private:
  StateAllocator allocate_;
};

// torch::optim::SGD with a fused step: for contiguous float32 parameters, gradient and
// momentum buffer, weight decay, momentum and the update are one pass over memory (read g, b,
// p; write b, p) instead of LibTorch's three kernels (eight passes). The optimizer step of a
// large model on a CPU is memory-bound, so this is ~1.6x less time. Same state (SGDParamState),
// same arithmetic up to float rounding (LibTorch's kernels use fused multiply-adds on AVX2;
// this loop rounds each operation). Other dtypes and layouts take torch::optim::SGD's step.
class FusedSGD : public torch::optim::SGD, public StateHome {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// torch::optim::AdamW whose step is ATen's fused AdamW kernel (at::_fused_adamw_, what
// PyTorch's AdamW(fused=True) runs, on CPU and CUDA): per parameter one vectorized pass that
// reads p, g, exp_avg, exp_avg_sq and writes p, exp_avg, exp_avg_sq, where LibTorch's step
// runs eight kernels (~14 passes over memory). Same state (AdamWParamState, so checkpoints and
// load_optimizer_state are unchanged), same arithmetic up to float rounding. A step where any
// parameter is not fusable (sparse gradient, dtype or device differing from its gradient's or
// state's, non-contiguous) takes torch::optim::AdamW::step for that whole step.
class FusedAdamW : public torch::optim::AdamW, public StateHome {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// An optimizer that steps copies of the parameters: pinned host copies for parameters on a GPU
// with offload cpu/nvme (Note [optimizer offload] in optim.cpp), fp32 master copies for bf16 or
// fp16 parameters (Note [master weights]). Each step moves the gradients to the copies (cast
// to their dtype), steps them with the inner optimizer and copies the new values back.
// Checkpoints see the inner optimizer's state under the parameters' names, in the format of
// every other run.
class CopyStepOptimizer : public torch::optim::Optimizer {
 public:
  CopyStepOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> copies,
                    std::unique_ptr<torch::optim::Optimizer> inner);
  torch::Tensor step(LossClosure closure = nullptr) override;
  torch::optim::Optimizer& inner() { return *inner_; }
  const std::vector<torch::Tensor>& copies() const { return copies_; }

 private:
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> copies_;  // what inner_ steps, one per parameter
  std::unique_ptr<torch::optim::Optimizer> inner_;
};

// The optimizer over `params` (trainable parameters, in the order of `names`): FusedSGD,
// FusedAdamW, AdamW8bit (paged for paged_adamw_8bit) or Adafactor; with spec.offload, its state in files (nvme) and, for parameters on a GPU, its
// step on the host; for bf16/fp16 parameters, fp32 master copies (both CopyStepOptimizer).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec,
                                                        const std::vector<torch::Tensor>& params);

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

// Per-parameter state as "<param name>.<field>" tensors (SGD: momentum_buffer; AdamW: step,
// exp_avg, exp_avg_sq, max_exp_avg_sq; the 8-bit AdamW and Adafactor: their headers say).
// Parameters without state yet are absent.
io::NamedTensors optimizer_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                                 const std::vector<torch::Tensor>& params,
                                 const std::vector<std::string>& names);

// Bytes of optimizer state this worker holds (what the memory report counts): the live state
// tensors, not their checkpoint form.
int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer);

// Restores what optimizer_state wrote. A shape mismatch or unknown name is a replica::Error.
void load_optimizer_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                          const std::vector<torch::Tensor>& params,
                          const std::vector<std::string>& names, const io::NamedTensors& state);

}  // namespace replica::train
