// AdamW with 8-bit block-wise state: bitsandbytes' AdamW8bit / PagedAdamW8bit (what
// transformers' optim="adamw_bnb_8bit" and "paged_adamw_8bit" run), written here because
// bitsandbytes is a Python package with no C++ API: LibTorch cannot call it.
//
// The algorithm is bitsandbytes 0.50.2's, operation for operation as its CPU backend runs it
// (tests/optim_8bit_conformance_test.cpp checks the parameters, the state bytes and the block
// maxima against bitsandbytes itself on the same tensors):
//   - each moment is kept as one byte per element: an index into a 256-entry "dynamic"
//     quantization map (create_dynamic_map: signed for exp_avg, unsigned for exp_avg_sq), times
//     the absolute maximum of its block of 256 elements (one float per block);
//   - a step dequantizes both moments, runs AdamW's update in float32 and quantizes them again
//     (new block maxima; each value to its map entry through bitsandbytes' 65536-bin lookup
//     table of nearest entries);
//   - a tensor under 4096 elements keeps float32 moments (bitsandbytes' min_8bit_size) with its
//     32-bit update;
//   - paged (paged_adamw_8bit): on a GPU the state of a tensor of 100000 elements or more is in
//     CUDA managed memory (host-pageable, migrated on demand), as bitsandbytes' paged buffers;
//     on a CPU paged changes nothing (bitsandbytes falls back the same way).
// State: 2 bytes per element + 8 bytes per 256 elements = 2.03 bytes against fp32 AdamW's 8.
#pragma once

#include "replica/io/safetensors.h"
#include "replica/train/optim.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace replica::train {

// bitsandbytes 0.50.2's constants (Optimizer2State.init_state, get_state_buffer).
inline constexpr int64_t kQuantBlock = 256;         // elements per block maximum
inline constexpr int64_t kMin8bitSize = 4096;       // smaller tensors keep float32 moments
inline constexpr int64_t kPagedMinNumel = 100000;   // smaller tensors are never paged

// bitsandbytes.functional.create_dynamic_map(signed) (256 float32 entries, sorted).
torch::Tensor dynamic_map(bool is_signed);

// bitsandbytes' block-wise quantization of `x` (float32) with `code` (a dynamic map): the
// byte per element and the absolute maximum per block of kQuantBlock, as
// torch.ops.bitsandbytes.quantize_blockwise computes them on a CPU; on any device.
struct Quantized {
  torch::Tensor codes;   // uint8, x's shape
  torch::Tensor absmax;  // float32 [ceil(numel / kQuantBlock)]
};
Quantized quantize_blockwise(const torch::Tensor& x, const torch::Tensor& code);
// code[codes] * absmax of the element's block, in float32, x's shape.
torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& code);

// Whether the state of a parameter of `numel` elements on `device` goes to CUDA managed memory
// (paged_adamw_8bit on a GPU, tensors of kPagedMinNumel elements or more): the one place that
// choice is made, a function of the device so that every machine's tests can ask it.
bool paged_state(bool paged, const torch::Device& device, int64_t numel);

struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  explicit AdamW8bitOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, paged) = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdamW8bitParamState : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  int64_t step = 0;
  // uint8 codes with absmax1/absmax2 (8-bit), or float32 exp_avg / exp_avg_sq (small tensors).
  torch::Tensor state1, state2;
  torch::Tensor absmax1, absmax2;
  bool eight_bit() const { return state1.scalar_type() == torch::kByte; }
};

// StateHome: with offload nvme its state tensors are files (optim.h).
class AdamW8bit : public torch::optim::Optimizer, public StateHome {
 public:
  AdamW8bit(std::vector<torch::Tensor> params, AdamW8bitOptions options);
  torch::Tensor step(LossClosure closure = nullptr) override;
  // New zeroed state for `p` (8-bit or float32 by its size), where the options put it.
  AdamW8bitParamState fresh_state(const torch::Tensor& p) const;

 private:
  torch::Tensor zeros(const torch::Tensor& p, at::IntArrayRef sizes, torch::ScalarType dtype) const;
};

// The state as checkpoint tensors "<name>.<field>", per element so that DDP's and ZeRO-3's
// sharded checkpoints gather and re-cut it like AdamW's: step (int64), and either state1,
// state2 (the codes, in bf16, which holds 0..255 exactly) with absmax1, absmax2 (each
// element's block maximum, float32), or exp_avg, exp_avg_sq (float32 state).
io::NamedTensors adamw_8bit_state(AdamW8bit& optimizer, const std::vector<torch::Tensor>& params,
                                  const std::vector<std::string>& names);
// Restores it. Where the tensors are cut as they were saved (same engine and world size) the
// codes and block maxima come back as they were, so the run continues bit for bit; cut
// otherwise, each tensor's moments are quantized again from their saved values. Returns the
// number of entries of `state` used.
size_t load_adamw_8bit_state(AdamW8bit& optimizer, const std::vector<torch::Tensor>& params,
                             const std::vector<std::string>& names, const io::NamedTensors& state);

// Bytes of state held (codes, block maxima, float32 moments).
int64_t adamw_8bit_state_bytes(AdamW8bit& optimizer);

}  // namespace replica::train
