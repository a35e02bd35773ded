// Fused paths of the decoder's elementwise ops: RMSNorm, rotary embedding, SwiGLU, and the
// loss's cross-entropy. Each replaces a chain of ATen kernels (and the intermediate tensors
// autograd keeps) by one kernel forward and one backward: replica's CUDA kernels on a GPU, its
// AVX2 kernels for fp32 on the CPU. Note [fused kernels] in fused_ops.cpp has the why, the
// numbers and the tolerances.
#pragma once

#include <torch/types.h>

namespace replica::models {

// The one decision: whether ops on `x` take the fused kernels. True for CUDA tensors of a build
// with the CUDA kernels (LibTorch with CUDA), and for fp32 CPU tensors where the CPU has AVX2
// and FMA, unless REPLICA_FUSED_KERNELS=0 or set_fused_kernels(false) turned them off.
bool fused_kernels_for(const torch::Tensor& x);
// Turns the fused paths on or off for this process (tests compare the two; default: on unless
// REPLICA_FUSED_KERNELS=0). Returns the previous setting.
bool set_fused_kernels(bool on);
// Whether this build has the CUDA kernels at all.
bool fused_kernels_compiled();
// Whether this CPU runs the CPU kernels (x86-64 with AVX2 and FMA).
bool fused_cpu_kernels_available();

// RMSNorm over the last dimension with a weight of that size (on CUDA ATen's fused kernel,
// at::_fused_rms_norm): fp32 statistics, x and weight of one dtype, result in that dtype.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// HF's apply_rotary_pos_emb for x [B, T, heads, D] (the projection viewed per head, before the
// transpose attention wants) with cos/sin [B or 1, T, D]; computed in fp32, written as `out`.
torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           torch::ScalarType out);

// silu(gate) * up (SwiGLU's product), computed in fp32, in their (common) dtype.
torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// The sum over tokens of cross-entropy(logits [N, V], targets [N]; -100 ignored), computed in
// fp32 from logits of any float dtype without an fp32 copy of them; a target outside [0, V)
// gives NaN.
torch::Tensor fused_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets);

// The same kernels without autograd, for code that forms the logits' gradient itself (the
// chunked head, chunked_cross_entropy.cpp). Per row of logits [N, V]: the loss and the
// log-sum-exp, fp32 [N] (0 and 0 where the target is -100).
struct RowCrossEntropy {
  torch::Tensor loss, lse;
};
RowCrossEntropy fused_cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets);
// grad * (softmax(logits) - one_hot(targets)) from fused_cross_entropy_rows' lse, zero rows
// where the target is -100; grad an fp32 scalar tensor on the logits' device. In the logits'
// dtype.
torch::Tensor fused_cross_entropy_rows_backward(const torch::Tensor& logits, const torch::Tensor& targets,
                                                const torch::Tensor& lse, const torch::Tensor& grad);

}  // namespace replica::models
