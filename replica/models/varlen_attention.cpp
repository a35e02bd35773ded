// See varlen_attention.h.
//
// Note [packed attention]
// A packed row holds several samples; each token attends only to earlier tokens of its own
// sample. The first path passes that as a [B, 1, T, T] bool
// block-diagonal causal mask to at::scaled_dot_product_attention. On CUDA any mask rules out
// FlashAttention-2: ATen takes the memory-efficient kernel (which reads the mask, and computes
// every block of the T x T scores, the blocks between samples included) or, for grouped
// key/value heads, which it refuses, the math path after the heads are repeated (Note
// [grouped-query attention and the math kernel] in llama.cpp). FlashAttention-2's varlen entry
// (at::_flash_attention_forward with cumulative sequence lengths) takes the rows as one stream
// of [B * T, heads, D] tokens cut into segments, computes only each segment's own causal
// triangle, reads grouped key/value heads natively, and has its backward in autograd
// (FlashAttentionBackward0). So on CUDA, packed rows take it wherever it applies.
//
// choose_packed_attention is the one place that says where that is. The mask stays for:
//   - sliding-window layers whose window is shorter than the row, and GPT-OSS's sinks: they
//     keep the path their own tests hold to transformers (a window as wide as the row is plain
//     causal attention, so such a layer is an ordinary packed layer);
//   - attention dropout in training: the flash kernel draws its own dropout mask, so the
//     varlen path would not be the mask path's computation with another seed but a different
//     random stream per path; one path keeps dropout reproducible;
//   - on CUDA, what the flash kernel refuses: fp32 (no autocast), a head_dim over 256 or not a
//     multiple of 8, a GPU before Ampere, ATen's flash switch turned off: ATen's own dispatch is asked
//     (flash_varlen_takes), so no kernel rule is restated here beyond the varlen entry's head
//     size, which the sdpa entry pads and the varlen entry does not;
//     On CUDA such calls keep the mask unless the varlen path is forced: the loop below would
//     launch a kernel per segment, and it was not measured against the masked kernels there.
// Off CUDA the varlen path is a loop over segments: each segment's [1, heads, len, D] slice
// through ATen's CPU flash kernel with is_causal, which skips the key blocks above the diagonal
// and never visits another segment's, where the masked kernel computes every block of the
// T x T scores and masks most of them. Exact (the same kernel, the same blocks within a
// segment) and faster, so it is the CPU's default too: on the LLM step benchmark
// (bench_llama_step --segments, 18.7M Llama, fp32, one thread, this project's 2-core build machine)
// 1.8x the tokens/s at 1 x 2048 tokens in 8 segments, 1.3x at 1 x 1024 in 4, 16 or even 256
// segments of 4 tokens (the per-segment calls do not eat the gain), and the same at 4 x 256
// (docs/performance.md).
// REPLICA_PACKED_ATTENTION=varlen forces the varlen path wherever the layer allows it (the loop
// where the flash kernel does not take the call), =mask the mask, so that the tests run every
// path on every machine.
//
// The segment boundaries are host facts: the workloads build their rows on the host, so the
// layout (cu_seqlens on the device, the longest segment as a host integer, which the kernel
// needs before launch) is computed there once per micro-batch (packed_layout) and handed to the
// model; nothing in the forward waits for the device to learn it.
#include "replica/models/varlen_attention.h"

#include "replica/core/error.h"

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_fused_sdp_choice.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <string>

namespace replica::models {

namespace {

// -1: not read yet; else a PackedAttentionMode.
std::atomic<int>& mode_switch() {
  static std::atomic<int> mode{-1};
  return mode;
}

PackedAttentionMode mode_from_environment() {
  const char* v = std::getenv("REPLICA_PACKED_ATTENTION");
  const std::string choice = v ? v : "auto";
  if (choice == "auto") return PackedAttentionMode::kAuto;
  if (choice == "varlen") return PackedAttentionMode::kVarlen;
  if (choice == "mask") return PackedAttentionMode::kMask;
  fail("REPLICA_PACKED_ATTENTION={}: want auto, varlen or mask", choice);
}

}  // namespace

PackedAttentionMode packed_attention_mode() {
  int now = mode_switch().load();
  if (now < 0) {
    now = static_cast<int>(mode_from_environment());
    mode_switch().store(now);
  }
  return static_cast<PackedAttentionMode>(now);
}

PackedAttentionMode set_packed_attention_mode(PackedAttentionMode mode) {
  const auto was = packed_attention_mode();
  mode_switch().store(static_cast<int>(mode));
  return was;
}

const char* to_string(PackedAttentionMode mode) {
  switch (mode) {
    case PackedAttentionMode::kAuto: return "auto";
    case PackedAttentionMode::kVarlen: return "varlen";
    case PackedAttentionMode::kMask: return "mask";
  }
  return "?";
}

const char* to_string(PackedAttention path) {
  switch (path) {
    case PackedAttention::kMask: return "mask";
    case PackedAttention::kFlashVarlen: return "flash varlen";
    case PackedAttention::kSegmentLoop: return "segment loop";
  }
  return "?";
}

PackedLayout packed_layout(const torch::Tensor& segment_ids, const torch::Device& device) {
  if (segment_ids.dim() != 2 || !at::isIntegralType(segment_ids.scalar_type(), /*includeBool=*/false)) {
    fail("packed_layout: segment_ids must be integer [batch, seq], got {} {}", c10::toString(segment_ids.scalar_type()),
         c10::str(segment_ids.sizes()));
  }
  const int64_t B = segment_ids.size(0), T = segment_ids.size(1);
  if (B * T > std::numeric_limits<int32_t>::max()) {
    fail("packed_layout: {} x {} tokens do not fit the int32 offsets of the varlen kernel", B, T);
  }
  const auto host = segment_ids.to(torch::kCPU, torch::kInt64).contiguous();
  const auto ids = host.accessor<int64_t, 2>();
  PackedLayout out;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      if (t == 0 || ids[b][t] != ids[b][t - 1]) out.offsets.push_back(b * T + t);
    }
  }
  out.offsets.push_back(B * T);
  std::vector<int32_t> cu(out.offsets.begin(), out.offsets.end());
  for (size_t i = 1; i < out.offsets.size(); ++i) {
    out.max_seqlen = std::max(out.max_seqlen, out.offsets[i] - out.offsets[i - 1]);
  }
  auto cu_seqlens = torch::tensor(cu, torch::kInt32);
  // As the workloads move their batches: from pinned memory, the copy ordered before the
  // kernels that read it, the host not blocked.
  out.cu_seqlens = device.is_cuda() ? cu_seqlens.pin_memory().to(device, /*non_blocking=*/true) : cu_seqlens;
  return out;
}

PackedAttention choose_packed_attention(const PackedAttentionCall& call, PackedAttentionMode mode) {
  if (mode == PackedAttentionMode::kMask) return PackedAttention::kMask;
  // Paths of their own (Note [packed attention]): sliding windows, sinks, dropout.
  if (call.sliding || call.sinks || call.dropout > 0) return PackedAttention::kMask;
  if (call.cuda && call.flash_takes) return PackedAttention::kFlashVarlen;
  // Off CUDA the loop is the faster path; on CUDA without the flash kernel (fp32, an odd head
  // size) the mask, unless the varlen path is forced.
  if (!call.cuda || mode == PackedAttentionMode::kVarlen) return PackedAttention::kSegmentLoop;
  return PackedAttention::kMask;
}

bool flash_varlen_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale) {
  if (!q.is_cuda()) return false;
  const int64_t D = q.size(-1);
  if (D % 8 != 0 || D > 256) return false;
  const bool gqa = q.size(1) != k.size(1);
  const auto flash = static_cast<int64_t>(at::SDPBackend::flash_attention);
  return at::_fused_sdp_choice(q, k, v, std::nullopt, 0.0, /*is_causal=*/true, scale, gqa) == flash;
}

torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const PackedLayout& layout, double scale, PackedAttention path) {
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || k.size(0) != q.size(0) || v.sizes() != k.sizes() ||
      k.size(2) != q.size(2) || q.size(1) % k.size(1) != 0) {
    fail("varlen_attention: q {}, k {}, v {}: want [tokens, heads, D] with heads a multiple of the key/value heads",
         c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes()));
  }
  if (!layout.defined() || layout.offsets.back() != q.size(0)) {
    fail("varlen_attention: the packed layout covers {} tokens, q has {}", layout.defined() ? layout.offsets.back() : 0,
         q.size(0));
  }
  if (path == PackedAttention::kFlashVarlen) {
    auto last_contiguous = [](const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    auto outs = at::_flash_attention_forward(last_contiguous(q), last_contiguous(k), last_contiguous(v),
                                             layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen,
                                             layout.max_seqlen, /*dropout_p=*/0.0, /*is_causal=*/true,
                                             /*return_debug_mask=*/false, scale);
    return std::get<0>(outs);
  }
  if (path != PackedAttention::kSegmentLoop) fail("varlen_attention: path {} is not a varlen path", to_string(path));
  // One split per tensor and one cat: their backwards are one cat and one split, where a
  // narrow per segment would each give back a gradient of all N tokens.
  std::vector<int64_t> lengths;
  lengths.reserve(layout.offsets.size());
  for (size_t i = 1; i < layout.offsets.size(); ++i) lengths.push_back(layout.offsets[i] - layout.offsets[i - 1]);
  const auto qs = q.split_with_sizes(lengths, 0);
  const auto ks = k.split_with_sizes(lengths, 0);
  const auto vs = v.split_with_sizes(lengths, 0);
  const bool gqa = q.size(1) != k.size(1);
  auto heads_first = [](const torch::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };  // [1, heads, len, D]
  std::vector<torch::Tensor> outs;
  outs.reserve(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    auto o = at::scaled_dot_product_attention(heads_first(qs[i]), heads_first(ks[i]), heads_first(vs[i]),
                                              std::nullopt, 0.0, /*is_causal=*/true, scale, gqa);
    outs.push_back(o.squeeze(0).transpose(0, 1));
  }
  return torch::cat(outs, 0);
}

}  // namespace replica::models
