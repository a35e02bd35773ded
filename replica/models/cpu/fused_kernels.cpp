// See fused_kernels.h. The kernels are compiled for AVX2 + FMA by a function attribute (not a
// flag on the file), so nothing else in this file, and no inline function another file shares,
// carries instructions an older CPU lacks; available() checks the CPU before any of them runs.
//
// Numerics: each kernel computes what the composite ops compute, in fp32, in their order where
// that is cheap (the compiler may fuse a product and a sum into one FMA, one rounding fewer). exp is Cephes' expf (range reduction by ln 2, a degree-6 polynomial, about 1 ulp; ATen
// uses SLEEF's, also within 1 ulp), so the softmax, the loss and SiLU differ from ATen's by
// float rounding; the tests (fused_cpu_test.cpp) hold each kernel to the composite at 1e-6.
#include "replica/models/cpu/fused_kernels.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define REPLICA_X86_KERNELS 1
#include <immintrin.h>
#endif

namespace replica::models::cpu_kernels {

#ifdef REPLICA_X86_KERNELS

#define REPLICA_AVX2 __attribute__((target("avx2,fma")))

bool available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

namespace {

// exp of 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact),
// exp(r) by Cephes' polynomial, 2^n written into the exponent bits. Below -87.34 (where exp
// leaves the normal floats) the result is 0; above 88 it is exp(88).
REPLICA_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

REPLICA_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

REPLICA_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// silu(g) = g / (1 + exp(-g)), as ATen's silu.
REPLICA_AVX2 inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

inline float sigmoid1(float g) { return 1.0f / (1.0f + std::exp(-g)); }

}  // namespace

REPLICA_AVX2 void rotary(const float* x, float* out, const float* cos, const float* sin, int64_t first_row, int64_t rows,
                         int64_t T, int64_t H, int64_t half, int64_t cos_batch_stride, bool backward) {
  const int64_t D = 2 * half;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = first_row + i;
    const int64_t offset = row / (T * H) * cos_batch_stride + (row / H) % T * D;
    const float *c = cos + offset, *s = sin + offset, *x1 = x + i * D, *x2 = x1 + half;
    float *o1 = out + i * D, *o2 = o1 + half;
    // Forward: [x1 c1 - x2 s1, x2 c2 + x1 s2] (HF's x * cos + rotate_half(x) * sin). Backward,
    // its transpose: [x1 c1 + x2 s2, x2 c2 - x1 s1].
    int64_t j = 0;
    for (; j + 8 <= half; j += 8) {
      const __m256 a = _mm256_loadu_ps(x1 + j), b = _mm256_loadu_ps(x2 + j);
      const __m256 c1 = _mm256_loadu_ps(c + j), c2 = _mm256_loadu_ps(c + half + j);
      const __m256 s1 = _mm256_loadu_ps(s + j), s2 = _mm256_loadu_ps(s + half + j);
      if (!backward) {
        _mm256_storeu_ps(o1 + j, _mm256_sub_ps(_mm256_mul_ps(a, c1), _mm256_mul_ps(b, s1)));
        _mm256_storeu_ps(o2 + j, _mm256_add_ps(_mm256_mul_ps(b, c2), _mm256_mul_ps(a, s2)));
      } else {
        _mm256_storeu_ps(o1 + j, _mm256_add_ps(_mm256_mul_ps(a, c1), _mm256_mul_ps(b, s2)));
        _mm256_storeu_ps(o2 + j, _mm256_sub_ps(_mm256_mul_ps(b, c2), _mm256_mul_ps(a, s1)));
      }
    }
    for (; j < half; ++j) {
      const float a = x1[j], b = x2[j];
      if (!backward) {
        o1[j] = a * c[j] - b * s[j];
        o2[j] = b * c[half + j] + a * s[half + j];
      } else {
        o1[j] = a * c[j] + b * s[half + j];
        o2[j] = b * c[half + j] - a * s[j];
      }
    }
  }
}

REPLICA_AVX2 void swiglu_forward(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

REPLICA_AVX2 void swiglu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n) {
  // du = dy silu(g); dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))), ATen's silu_backward of dy u.
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i), d = _mm256_loadu_ps(dy + i), up = _mm256_loadu_ps(u + i);
    const __m256 sig = sigmoid8(x);
    _mm256_storeu_ps(du + i, _mm256_mul_ps(d, _mm256_mul_ps(x, sig)));
    const __m256 slope = _mm256_mul_ps(sig, _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, sig))));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(d, up), slope));
  }
  for (; i < n; ++i) {
    const float sig = sigmoid1(g[i]);
    du[i] = dy[i] * (g[i] * sig);
    dg[i] = dy[i] * u[i] * (sig * (1.0f + g[i] * (1.0f - sig)));
  }
}

REPLICA_AVX2 void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t H,
                                   float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    float* yr = y + r * H;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= H; j += 8) {
      const __m256 v = _mm256_loadu_ps(xr + j);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; j < H; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    rstd[r] = inv;
    const __m256 vinv = _mm256_set1_ps(inv);
    j = 0;
    for (; j + 8 <= H; j += 8) {
      _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), vinv)));
    }
    for (; j < H; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

REPLICA_AVX2 void rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                                    float* dw_sum, int64_t rows, int64_t H) {
  // y = w x r with r = (mean(x^2) + eps)^-1/2: dx = r w dy - x r^3 mean(w dy x); dw = dy x r.
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * H, *dyr = dy + r * H;
    float* dxr = dx + r * H;
    const float inv = rstd[r];
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= H; j += 8) {
      acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(dyr + j)), _mm256_loadu_ps(xr + j), acc);
    }
    float dot = hsum(acc);
    for (; j < H; ++j) dot += w[j] * dyr[j] * xr[j];
    const float k = inv * inv * inv * (dot / static_cast<float>(H));
    const __m256 vinv = _mm256_set1_ps(inv), vk = _mm256_set1_ps(k);
    j = 0;
    for (; j + 8 <= H; j += 8) {
      const __m256 xv = _mm256_loadu_ps(xr + j), dyv = _mm256_loadu_ps(dyr + j);
      const __m256 wdy = _mm256_mul_ps(_mm256_loadu_ps(w + j), dyv);
      _mm256_storeu_ps(dxr + j, _mm256_fnmadd_ps(xv, vk, _mm256_mul_ps(vinv, wdy)));
      if (dw_sum) {
        _mm256_storeu_ps(dw_sum + j, _mm256_fmadd_ps(dyv, _mm256_mul_ps(xv, vinv), _mm256_loadu_ps(dw_sum + j)));
      }
    }
    for (; j < H; ++j) {
      dxr[j] = inv * (w[j] * dyr[j]) - xr[j] * k;
      if (dw_sum) dw_sum[j] += dyr[j] * (xr[j] * inv);
    }
  }
}

REPLICA_AVX2 void cross_entropy_forward(const float* logits, const int64_t* targets, float* loss, float* lse,
                                        int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = targets[r];
    if (t == -100) {  // ignored: no loss, and the backward writes zeros without reading lse
      loss[r] = 0.0f;
      lse[r] = 0.0f;
      continue;
    }
    const float* x = logits + r * V;
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(x + j), vmax);  // a NaN in x wins
    float m = hmax(vmax);
    for (; j < V; ++j) m = x[j] > m || std::isnan(x[j]) ? x[j] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= V; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
    float sum = hsum(acc);
    for (; j < V; ++j) sum += std::exp(x[j] - m);
    const float l = m + std::log(sum);
    lse[r] = l;
    loss[r] = t >= 0 && t < V ? l - x[t] : std::numeric_limits<float>::quiet_NaN();
  }
}

REPLICA_AVX2 void cross_entropy_backward(const float* logits, const int64_t* targets, const float* lse, float grad,
                                         float* dlogits, int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = targets[r];
    const float* x = logits + r * V;
    float* d = dlogits + r * V;
    int64_t j = 0;
    if (t == -100) {
      for (; j + 8 <= V; j += 8) _mm256_storeu_ps(d + j, _mm256_setzero_ps());
      for (; j < V; ++j) d[j] = 0.0f;
      continue;
    }
    const __m256 vl = _mm256_set1_ps(lse[r]), vg = _mm256_set1_ps(grad);
    for (; j + 8 <= V; j += 8) _mm256_storeu_ps(d + j, _mm256_mul_ps(vg, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vl))));
    for (; j < V; ++j) d[j] = grad * std::exp(x[j] - lse[r]);
    if (t >= 0 && t < V) d[t] -= grad;
  }
}

#else  // not x86-64 with GCC or Clang: available() is false and nothing below is called

bool available() { return false; }
void rotary(const float*, float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool) {
  std::abort();
}
void swiglu_forward(const float*, const float*, float*, int64_t) { std::abort(); }
void swiglu_backward(const float*, const float*, const float*, float*, float*, int64_t) { std::abort(); }
void rms_norm_forward(const float*, const float*, float*, float*, int64_t, int64_t, float) { std::abort(); }
void rms_norm_backward(const float*, const float*, const float*, const float*, float*, float*, int64_t, int64_t) {
  std::abort();
}
void cross_entropy_forward(const float*, const int64_t*, float*, float*, int64_t, int64_t) { std::abort(); }
void cross_entropy_backward(const float*, const int64_t*, const float*, float, float*, int64_t, int64_t) { std::abort(); }

#endif

}  // namespace replica::models::cpu_kernels
