#include "replica/distributed/grad_norm.h"

#include <torch/torch.h>

#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace replica::distributed {
namespace {

// Sum of squares of a float32 range in float64, in one pass over memory: eight float64 lanes
// in four SSE2 registers, then the lanes in a fixed order. Materialising g.to(kDouble) instead
// wrote and re-read twice the gradient's bytes: on a memory-bound step that cost more than the
// optimizer step itself.
double sum_of_squares_f32(const float* x, int64_t n) {
  int64_t i = 0;
  double total = 0;
#if defined(__SSE2__)
  __m128d a0 = _mm_setzero_pd(), a1 = _mm_setzero_pd(), a2 = _mm_setzero_pd(), a3 = _mm_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m128 lo = _mm_loadu_ps(x + i), hi = _mm_loadu_ps(x + i + 4);
    const __m128d d0 = _mm_cvtps_pd(lo), d1 = _mm_cvtps_pd(_mm_movehl_ps(lo, lo));
    const __m128d d2 = _mm_cvtps_pd(hi), d3 = _mm_cvtps_pd(_mm_movehl_ps(hi, hi));
    a0 = _mm_add_pd(a0, _mm_mul_pd(d0, d0));
    a1 = _mm_add_pd(a1, _mm_mul_pd(d1, d1));
    a2 = _mm_add_pd(a2, _mm_mul_pd(d2, d2));
    a3 = _mm_add_pd(a3, _mm_mul_pd(d3, d3));
  }
  alignas(16) double lanes[2];
  _mm_store_pd(lanes, _mm_add_pd(_mm_add_pd(a0, a1), _mm_add_pd(a2, a3)));
  total = lanes[0] + lanes[1];
#endif
  for (; i < n; ++i) total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return total;
}

double sum_of_squares(const torch::Tensor& g) {
  if (g.scalar_type() == torch::kFloat && g.is_contiguous() && g.device().is_cpu()) {
    return sum_of_squares_f32(g.data_ptr<float>(), g.numel());
  }
  return g.to(torch::kDouble).pow(2).sum().item<double>();
}

}  // namespace

double clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm, ProcessGroup* shards_across) {
  torch::NoGradGuard no_grad;
  double total = 0;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    // Summed in float64: ZeRO-3 must match DDP's clipping to 1e-5 through AdamW, which
    // magnifies a float32 norm's rounding in the clip coefficient.
    total += sum_of_squares(g);
  }
  if (shards_across != nullptr) {
    auto across = torch::tensor({total}, torch::kDouble);
    shards_across->allreduce_sum(across).wait();
    total = across.item<double>();
  }
  const double norm = std::sqrt(total);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const auto& g : grads) {
      if (g.defined()) torch::Tensor(g).mul_(coef);
    }
  }
  return norm;
}

}  // namespace replica::distributed
