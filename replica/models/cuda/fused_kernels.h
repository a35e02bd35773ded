// The launchers of replica's hand-written CUDA kernels (fused_kernels.cu), in plain C++ types so
// that the .cu file needs no LibTorch header. Only replica/models/fused_ops.cpp calls them; it
// checks shapes, dtypes and contiguity first. Each returns nullptr, or the CUDA error's text.
#pragma once

#include <cstdint>

namespace replica::models::cuda_kernels {

enum class Dtype { kFloat32, kBFloat16, kFloat16 };

// Rotary embedding (HF's rotate_half layout) of x [rows, 2 * half] contiguous, rows = B*T*H of a
// [B, T, H, D] tensor, by cos/sin fp32 [Bc, T, D] contiguous (cos_batch_stride = T*D, or 0 when
// one row of positions serves the whole batch). backward: x is the output's gradient and out
// the input's (the rotation by minus the angle).
struct RotaryArgs {
  const void* x;
  Dtype in_dtype;
  void* out;
  Dtype out_dtype;
  const float* cos;
  const float* sin;
  int64_t rows, T, H, half, cos_batch_stride;
  bool backward;
  void* stream;  // cudaStream_t
};
const char* rotary(const RotaryArgs& args);

// SwiGLU silu(g) * u over n contiguous elements of one dtype. Forward writes out_or_dy; backward
// reads the output's gradient from out_or_dy and writes dg, du.
struct SwigluArgs {
  const void* g;
  const void* u;
  void* out_or_dy;
  void* dg;
  void* du;
  Dtype dtype;
  int64_t n;
  bool backward;
  void* stream;  // cudaStream_t
};
const char* swiglu(const SwigluArgs& args);

// Cross-entropy of logits [rows, V] (contiguous, one dtype) against int64 targets [rows] (-100:
// ignored). Forward writes loss [rows] and lse [rows] (fp32); backward reads lse and the loss
// sum's gradient (one fp32 on the device) and writes dlogits in the logits' dtype.
struct CrossEntropyArgs {
  const void* logits;
  Dtype dtype;
  const int64_t* targets;
  float* loss;
  float* lse;
  const float* grad;
  void* dlogits;
  int64_t rows, V;
  bool backward;
  void* stream;  // cudaStream_t
};
const char* cross_entropy(const CrossEntropyArgs& args);

}  // namespace replica::models::cuda_kernels
