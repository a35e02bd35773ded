// Attention over packed rows without a [B, 1, T, T] mask: each segment (a packed sample, or a
// run of padding) attends causally within itself. On CUDA ATen's FlashAttention-2 with
// cumulative sequence lengths; elsewhere a loop over segments through
// at::scaled_dot_product_attention. Which path a layer takes is decided in one place,
// choose_packed_attention (Note [packed attention] in varlen_attention.cpp says why).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace replica::models {

// Where each segment of a micro-batch's packed rows lies in the flattened [B * T] tokens,
// computed on the host from the host copy of segment_ids (packed_layout), so that no forward
// asks the device for it. A segment is a run of equal ids within a row (padding, id -1, is a
// segment of its own); rows never share a segment.
struct PackedLayout {
  std::vector<int64_t> offsets;  // host: each segment's first token, then B * T
  torch::Tensor cu_seqlens;      // the same offsets, int32, on the batch's device
  int64_t max_seqlen = 0;        // the longest segment
  bool defined() const { return cu_seqlens.defined(); }
  int64_t segments() const { return offsets.empty() ? 0 : static_cast<int64_t>(offsets.size()) - 1; }
};

// The layout of segment_ids [B, T] (integer; a CPU tensor: no device wait; a device tensor is
// copied to the host once), cu_seqlens placed on `device` (from pinned memory, without blocking
// the host).
PackedLayout packed_layout(const torch::Tensor& segment_ids, const torch::Device& device);

// REPLICA_PACKED_ATTENTION=auto|varlen|mask, read once (set_packed_attention_mode overrides).
//   auto    on CUDA FlashAttention-2's varlen kernel where it takes the call, else the mask;
//           elsewhere (the CPU) the loop over segments;
//   varlen  the varlen path wherever the layer allows it: the flash kernel where it takes the
//           call, else the loop over segments;
//   mask    the [B, 1, T, T] mask always (the path before the varlen one).
enum class PackedAttentionMode { kAuto, kVarlen, kMask };
PackedAttentionMode packed_attention_mode();
// For tests and benchmarks: sets the mode for this process, returns the previous one.
PackedAttentionMode set_packed_attention_mode(PackedAttentionMode mode);
const char* to_string(PackedAttentionMode mode);

enum class PackedAttention {
  kMask,          // at::scaled_dot_product_attention with the block-diagonal causal mask
  kFlashVarlen,   // at::_flash_attention_forward with cu_seqlens (CUDA, fp16 / bf16)
  kSegmentLoop,   // at::scaled_dot_product_attention(is_causal) on each segment
};
const char* to_string(PackedAttention path);

// What the decision looks at, for one attention layer's call on packed rows.
struct PackedAttentionCall {
  bool sliding = false;      // the layer's sliding window is shorter than the row
  bool sinks = false;        // GPT-OSS's attention sinks (attention_sinks.h)
  double dropout = 0.0;      // attention dropout of this call (0 outside training)
  bool cuda = false;         // q, k, v on a CUDA device
  bool flash_takes = false;  // flash_varlen_takes() for them (CUDA only)
};
// The one decision (Note [packed attention]).
PackedAttention choose_packed_attention(const PackedAttentionCall& call,
                                        PackedAttentionMode mode = packed_attention_mode());

// Whether ATen's FlashAttention-2 kernel takes causal attention over q [B, heads, T, D] and
// k, v [B, kv_heads, T, D] as they are (dtype, head size, GPU, ATen's own switches): ATen's own
// dispatch is asked, plus the varlen entry's rule that head_dim is a multiple of 8 (the sdpa
// entry pads other sizes; the varlen one does not). False for CPU tensors.
bool flash_varlen_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale);

// Causal attention within each segment of `layout`: q [N, heads, D], k and v [N, kv_heads, D]
// (N = B * T, the rows flattened; kv_heads divides heads), scale on the scores. Returns
// [N, heads, D] in q's dtype. path kFlashVarlen (CUDA) or kSegmentLoop (any device);
// differentiable in q, k and v.
torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const PackedLayout& layout, double scale, PackedAttention path);

}  // namespace replica::models
