// replica's hand-written CPU kernels for the decoder's elementwise ops (fp32, AVX2 + FMA), the
// CPU side of Note [fused kernels] (models/fused_ops.cpp). Plain C++ types, no LibTorch header:
// fused_ops.cpp checks shapes, dtypes and contiguity, splits rows across threads
// (at::parallel_for) and calls these on each piece with pointers to its first row.
//
// Why by hand: ATen has no CPU kernel for any of these fusions (its _fused_rms_norm is the
// composite on the CPU), and the composite chains cost the LLM step on the CPU what they cost
// on a GPU: a pass over memory per op, a tensor autograd keeps per op, and for the loss a
// zero-filled [tokens, vocabulary] gradient that is then scattered into and read again.
// AVX2 + FMA are checked at run time (available()); elsewhere the composite ops stay.
#pragma once

#include <cstdint>

namespace replica::models::cpu_kernels {

// Whether this CPU runs the kernels (x86-64 with AVX2 and FMA).
bool available();

// HF's rotary embedding (rotate_half layout) of `rows` rows of D = 2 * half floats, rows of a
// [B, T, H, D] tensor starting at row `first_row` (x and out point at that row); cos/sin
// [Bc, T, D] (cos_batch_stride = T * D, or 0 when one row of positions serves the batch).
// backward: x is the output's gradient and out the input's (rotation by minus the angle).
void rotary(const float* x, float* out, const float* cos, const float* sin, int64_t first_row, int64_t rows, int64_t T,
            int64_t H, int64_t half, int64_t cos_batch_stride, bool backward);

// out = silu(g) * u over n floats.
void swiglu_forward(const float* g, const float* u, float* out, int64_t n);
// The gradients of silu(g) * u from the output's gradient dy.
void swiglu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n);

// y = w * (x / sqrt(mean(x^2) + eps)) over rows of H floats; rstd[r] = 1 / sqrt(mean + eps).
void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t H, float eps);
// dx from dy; dw_sum (may be null: no weight gradient) gets these rows' sum of dy * x * rstd added.
void rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw_sum,
                       int64_t rows, int64_t H);

// Cross-entropy of logits [rows, V] against targets [rows] (-100: ignored, loss 0; outside
// [0, V): NaN): loss[r] and lse[r] = log(sum(exp(logits[r]))).
void cross_entropy_forward(const float* logits, const int64_t* targets, float* loss, float* lse, int64_t rows,
                           int64_t V);
// dlogits = grad * (softmax(logits) - one_hot(target)), zero rows where the target is ignored.
void cross_entropy_backward(const float* logits, const int64_t* targets, const float* lse, float grad, float* dlogits,
                            int64_t rows, int64_t V);

}  // namespace replica::models::cpu_kernels
