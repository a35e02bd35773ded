// CUDA kernels of replica's fused elementwise ops (replica/models/fused_ops.h is their public
// face; Note [fused kernels] in fused_ops.cpp says why they exist). Written by hand because no
// package of the build provides them: ATen has a fused RMSNorm (used as is) but no fused rotary
// embedding or SwiGLU, and Liger/Apex/FlashAttention's are Python/Triton or not on Debian.
// This file includes only the CUDA runtime's headers (no LibTorch), so nvcc compiles it in
// seconds; the wrapper hands it raw pointers, sizes and the current stream.
#include "replica/models/cuda/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace replica::models::cuda_kernels {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

int64_t blocks_for(int64_t work) { return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks)); }

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rotary embedding in HF's rotate_half layout over x [rows, D] (rows = B*T*H, a [B, T, H, D]
// tensor) with cos/sin [Bc, T, D] in fp32 (Bc = B, or 1 broadcast over the batch). Each thread
// takes kVec consecutive pairs (j, j + D/2) of one row:
//   forward   o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2     (x * cos + rotate_half(x) * sin)
//   backward  d1 = y1 c1 + y2 s2,  d2 = y2 c2 - y1 s1     (its transpose: the gradient)
// A block holds whole rows (threads_per_row = min(D/2 / kVec, 256)), so a thread finds its row
// and (b, t) with one division, and a warp reads consecutive elements.
template <typename TI, typename TO, int kVec, bool kBackward>
__global__ void rotary_kernel(const TI* __restrict__ x, TO* __restrict__ out, const float* __restrict__ cos,
                              const float* __restrict__ sin, int64_t rows, int T, int H, int half,
                              int64_t cos_batch_stride, int threads_per_row, int rows_per_block) {
  const int lane = threadIdx.x % threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / threads_per_row;
  if (row >= rows) return;
  int64_t b, t;
  if (rows <= 0xffffffffLL) {  // 32-bit division where it fits (64-bit is emulated, ~10x dearer)
    const uint32_t bt = static_cast<uint32_t>(row) / static_cast<uint32_t>(H);
    b = bt / static_cast<uint32_t>(T);
    t = bt % static_cast<uint32_t>(T);
  } else {
    const int64_t bt = row / H;
    b = bt / T;
    t = bt % T;
  }
  const int64_t D = 2 * static_cast<int64_t>(half);
  const TI* xr = x + row * D;
  TO* orow = out + row * D;
  const float* cr = cos + b * cos_batch_stride + t * D;
  const float* sr = sin + b * cos_batch_stride + t * D;
  for (int j = lane * kVec; j < half; j += threads_per_row * kVec) {
    const auto x1 = *reinterpret_cast<const Pack<TI, kVec>*>(xr + j);
    const auto x2 = *reinterpret_cast<const Pack<TI, kVec>*>(xr + j + half);
    const auto c1 = *reinterpret_cast<const Pack<float, kVec>*>(cr + j);
    const auto c2 = *reinterpret_cast<const Pack<float, kVec>*>(cr + j + half);
    const auto s1 = *reinterpret_cast<const Pack<float, kVec>*>(sr + j);
    const auto s2 = *reinterpret_cast<const Pack<float, kVec>*>(sr + j + half);
    Pack<TO, kVec> o1, o2;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float a = to_float(x1.v[k]), b2 = to_float(x2.v[k]);
      if (kBackward) {
        o1.v[k] = from_float<TO>(a * c1.v[k] + b2 * s2.v[k]);
        o2.v[k] = from_float<TO>(b2 * c2.v[k] - a * s1.v[k]);
      } else {
        o1.v[k] = from_float<TO>(a * c1.v[k] - b2 * s1.v[k]);
        o2.v[k] = from_float<TO>(b2 * c2.v[k] + a * s2.v[k]);
      }
    }
    *reinterpret_cast<Pack<TO, kVec>*>(orow + j) = o1;
    *reinterpret_cast<Pack<TO, kVec>*>(orow + j + half) = o2;
  }
}

template <typename TI, typename TO, int kVec>
void launch_rotary_kernel(const RotaryArgs& a, cudaStream_t stream) {
  const int threads_per_row = static_cast<int>(std::min<int64_t>(a.half / kVec, kThreads));
  const int rows_per_block = kThreads / threads_per_row;
  const auto blocks = static_cast<unsigned>((a.rows + rows_per_block - 1) / rows_per_block);
  const int threads = threads_per_row * rows_per_block;
  auto* x = static_cast<const TI*>(a.x);
  auto* out = static_cast<TO*>(a.out);
  if (a.backward) {
    rotary_kernel<TI, TO, kVec, true><<<blocks, threads, 0, stream>>>(x, out, a.cos, a.sin, a.rows, static_cast<int>(a.T),
        static_cast<int>(a.H), static_cast<int>(a.half), a.cos_batch_stride, threads_per_row, rows_per_block);
  } else {
    rotary_kernel<TI, TO, kVec, false><<<blocks, threads, 0, stream>>>(x, out, a.cos, a.sin, a.rows, static_cast<int>(a.T),
        static_cast<int>(a.H), static_cast<int>(a.half), a.cos_batch_stride, threads_per_row, rows_per_block);
  }
}

template <typename TI, typename TO>
const char* launch_rotary(const RotaryArgs& a) {
  if (a.rows == 0) return nullptr;
  if (a.rows > 0x7fffffffLL) return "rotary: too many rows for one launch";
  // Four pairs per thread where every pack is aligned: rows and halves are multiples of 4
  // elements and the bases 16 bytes (torch's allocations are).
  const bool vec = a.half % 4 == 0 && aligned16(a.x) && aligned16(a.out) && aligned16(a.cos) && aligned16(a.sin);
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (vec) launch_rotary_kernel<TI, TO, 4>(a, stream);
  else launch_rotary_kernel<TI, TO, 1>(a, stream);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <typename TI>
const char* rotary_for_input(const RotaryArgs& a) {
  switch (a.out_dtype) {
    case Dtype::kFloat32: return launch_rotary<TI, float>(a);
    case Dtype::kBFloat16: return launch_rotary<TI, __nv_bfloat16>(a);
    case Dtype::kFloat16: return launch_rotary<TI, __half>(a);
  }
  return "rotary: unknown output dtype";
}

// SwiGLU: out = silu(g) * u, in fp32, rounded once to T; backward from dy:
//   du = dy * silu(g),  dg = dy * u * s * (1 + g (1 - s)),  s = sigmoid(g)
// (the formulas of ATen's silu / silu_backward). kVec elements per thread from one aligned
// 16-byte load per tensor where the pointers allow (kVec > 1), then a scalar tail.
template <typename T, int kVec>
__global__ void swiglu_forward_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = n / kVec;
  for (int64_t p = tid; p < packs; p += stride) {
    const auto gp = reinterpret_cast<const Pack<T, kVec>*>(g)[p];
    const auto up = reinterpret_cast<const Pack<T, kVec>*>(u)[p];
    Pack<T, kVec> op;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gv = to_float(gp.v[k]);
      op.v[k] = from_float<T>(gv / (1.0f + expf(-gv)) * to_float(up.v[k]));
    }
    reinterpret_cast<Pack<T, kVec>*>(out)[p] = op;
  }
  for (int64_t i = packs * kVec + tid; i < n; i += stride) {
    const float gv = to_float(g[i]);
    out[i] = from_float<T>(gv / (1.0f + expf(-gv)) * to_float(u[i]));
  }
}

template <typename T, int kVec>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ g, const T* __restrict__ u,
                                       T* __restrict__ dg, T* __restrict__ du, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = n / kVec;
  auto one = [](float dyv, float gv, float uv, float& dgv, float& duv) {
    const float s = 1.0f / (1.0f + expf(-gv));
    duv = dyv * gv * s;
    dgv = dyv * uv * s * (1.0f + gv * (1.0f - s));
  };
  for (int64_t p = tid; p < packs; p += stride) {
    const auto yp = reinterpret_cast<const Pack<T, kVec>*>(dy)[p];
    const auto gp = reinterpret_cast<const Pack<T, kVec>*>(g)[p];
    const auto up = reinterpret_cast<const Pack<T, kVec>*>(u)[p];
    Pack<T, kVec> dgp, dup;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float a, b;
      one(to_float(yp.v[k]), to_float(gp.v[k]), to_float(up.v[k]), a, b);
      dgp.v[k] = from_float<T>(a);
      dup.v[k] = from_float<T>(b);
    }
    reinterpret_cast<Pack<T, kVec>*>(dg)[p] = dgp;
    reinterpret_cast<Pack<T, kVec>*>(du)[p] = dup;
  }
  for (int64_t i = packs * kVec + tid; i < n; i += stride) {
    float a, b;
    one(to_float(dy[i]), to_float(g[i]), to_float(u[i]), a, b);
    dg[i] = from_float<T>(a);
    du[i] = from_float<T>(b);
  }
}

template <typename T>
const char* launch_swiglu(const SwigluArgs& a) {
  if (a.n == 0) return nullptr;
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = aligned16(a.g) && aligned16(a.u) && aligned16(a.out_or_dy) &&
                   (!a.backward || (aligned16(a.dg) && aligned16(a.du)));
  auto stream = static_cast<cudaStream_t>(a.stream);
  const auto blocks = static_cast<unsigned>(blocks_for(vec ? (a.n + kVec - 1) / kVec : a.n));
  const T* g = static_cast<const T*>(a.g);
  const T* u = static_cast<const T*>(a.u);
  if (a.backward) {
    const T* dy = static_cast<const T*>(a.out_or_dy);
    T* dg = static_cast<T*>(a.dg);
    T* du = static_cast<T*>(a.du);
    if (vec) swiglu_backward_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(dy, g, u, dg, du, a.n);
    else swiglu_backward_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(dy, g, u, dg, du, a.n);
  } else {
    T* out = static_cast<T*>(a.out_or_dy);
    if (vec) swiglu_forward_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(g, u, out, a.n);
    else swiglu_forward_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(g, u, out, a.n);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Cross-entropy over rows of logits [rows, V] against targets [rows] (int64; -100: ignored), in
// fp32 whatever the logits' dtype: one block per row. Forward: one pass with an online
// logsumexp (each thread keeps a running max m and sum s of exp(x - m); the block merges the
// pairs), then loss = lse - x[target] (0 for an ignored row, NaN for a target outside
// [0, V)). Backward: grad * (exp(x - lse) - [j == target]), zero for an ignored row, written in
// the logits' dtype: the composite's log_softmax / nll_loss over fp32 logits, rounded once.
constexpr int kRowThreads = 512;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ void add_value(MaxSum& acc, float v) {
  if (v > acc.m) {
    acc.s = acc.s * expf(acc.m - v) + 1.0f;
    acc.m = v;
  } else if (v != -INFINITY) {
    acc.s += expf(v - acc.m);
  }
}

template <typename T, int kVec>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                             float* __restrict__ loss, float* __restrict__ lse_out, int64_t V) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  MaxSum acc{-INFINITY, 0.0f};
  const int64_t packs = V / kVec;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const auto xp = reinterpret_cast<const Pack<T, kVec>*>(x)[p];
#pragma unroll
    for (int k = 0; k < kVec; ++k) add_value(acc, to_float(xp.v[k]));
  }
  for (int64_t j = packs * kVec + threadIdx.x; j < V; j += blockDim.x) add_value(acc, to_float(x[j]));
  // Merge within each warp, then the warps' results through shared memory.
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum other{__shfl_down_sync(0xffffffffu, acc.m, offset), __shfl_down_sync(0xffffffffu, acc.s, offset)};
    acc = merge(acc, other);
  }
  __shared__ MaxSum warps[kRowThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum all = warps[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) all = merge(all, warps[w]);
    const float lse = all.m + logf(all.s);
    lse_out[row] = lse;
    const int64_t t = targets[row];
    if (t == -100) loss[row] = 0.0f;
    else if (t < 0 || t >= V) loss[row] = NAN;
    else loss[row] = lse - to_float(x[t]);
  }
}

template <typename T, int kVec>
__global__ void cross_entropy_backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                              const float* __restrict__ lse_in, const float* __restrict__ grad,
                                              T* __restrict__ dlogits, int64_t V) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* d = dlogits + row * V;
  const int64_t t = targets[row];
  const bool ignored = t == -100;
  const float g = ignored ? 0.0f : *grad;
  const float lse = lse_in[row];
  const int64_t packs = V / kVec;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const auto xp = reinterpret_cast<const Pack<T, kVec>*>(x)[p];
    Pack<T, kVec> dp;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = p * kVec + k;
      const float soft = ignored ? 0.0f : expf(to_float(xp.v[k]) - lse);
      dp.v[k] = from_float<T>(g * (soft - (j == t ? 1.0f : 0.0f)));
    }
    reinterpret_cast<Pack<T, kVec>*>(d)[p] = dp;
  }
  for (int64_t j = packs * kVec + threadIdx.x; j < V; j += blockDim.x) {
    const float soft = ignored ? 0.0f : expf(to_float(x[j]) - lse);
    d[j] = from_float<T>(g * (soft - (j == t ? 1.0f : 0.0f)));
  }
}

template <typename T>
const char* launch_cross_entropy(const CrossEntropyArgs& a) {
  if (a.rows == 0) return nullptr;
  if (a.rows > 0x7fffffff) return "cross-entropy: too many rows for one launch";
  constexpr int kVec = 16 / sizeof(T);
  // Rows start 16-byte aligned when the base is and V is a multiple of the pack.
  const bool vec = aligned16(a.logits) && a.V % kVec == 0 && (!a.backward || aligned16(a.dlogits));
  auto stream = static_cast<cudaStream_t>(a.stream);
  const auto blocks = static_cast<unsigned>(a.rows);
  const T* x = static_cast<const T*>(a.logits);
  if (a.backward) {
    T* d = static_cast<T*>(a.dlogits);
    if (vec) cross_entropy_backward_kernel<T, kVec><<<blocks, kRowThreads, 0, stream>>>(x, a.targets, a.lse, a.grad, d, a.V);
    else cross_entropy_backward_kernel<T, 1><<<blocks, kRowThreads, 0, stream>>>(x, a.targets, a.lse, a.grad, d, a.V);
  } else {
    if (vec) cross_entropy_forward_kernel<T, kVec><<<blocks, kRowThreads, 0, stream>>>(x, a.targets, a.loss, a.lse, a.V);
    else cross_entropy_forward_kernel<T, 1><<<blocks, kRowThreads, 0, stream>>>(x, a.targets, a.loss, a.lse, a.V);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* rotary(const RotaryArgs& a) {
  switch (a.in_dtype) {
    case Dtype::kFloat32: return rotary_for_input<float>(a);
    case Dtype::kBFloat16: return rotary_for_input<__nv_bfloat16>(a);
    case Dtype::kFloat16: return rotary_for_input<__half>(a);
  }
  return "rotary: unknown input dtype";
}

const char* swiglu(const SwigluArgs& a) {
  switch (a.dtype) {
    case Dtype::kFloat32: return launch_swiglu<float>(a);
    case Dtype::kBFloat16: return launch_swiglu<__nv_bfloat16>(a);
    case Dtype::kFloat16: return launch_swiglu<__half>(a);
  }
  return "swiglu: unknown dtype";
}

const char* cross_entropy(const CrossEntropyArgs& a) {
  switch (a.dtype) {
    case Dtype::kFloat32: return launch_cross_entropy<float>(a);
    case Dtype::kBFloat16: return launch_cross_entropy<__nv_bfloat16>(a);
    case Dtype::kFloat16: return launch_cross_entropy<__half>(a);
  }
  return "cross-entropy: unknown dtype";
}

}  // namespace replica::models::cuda_kernels
