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

// A CPU gradient's sum of squares, in float64 (reading it waits for nothing).
double sum_of_squares_on_cpu(const torch::Tensor& g) {
  if (g.scalar_type() == torch::kFloat && g.is_contiguous()) return sum_of_squares_f32(g.data_ptr<float>(), g.numel());
  return g.to(torch::kDouble).pow(2).sum().item<double>();
}

}  // namespace

// Note [the gradient norm stays on the GPU]
// Gradients on a GPU are not read one by one: a read per tensor is a wait for the device per
// parameter (some 150 a step for a 1B Llama's full fine-tuning, twice that for its LoRA
// adapters), each leaving the GPU idle until the host launches again. Their norms are taken in
// one multi-tensor kernel (_foreach_norm, fp32 accumulation as PyTorch's clip_grad_norm_),
// squared and summed in float64 on the device, summed across shards by an all-reduce of that
// device tensor, and the clip coefficient min(1, max_norm / (norm + 1e-6)) multiplies the
// gradients on the device too (PyTorch's clip_coef_clamped): the norm is read by whoever needs
// the number, when it does (the trainer: a step later, Note [the step's reads, a step late] in
// train/trainer.cpp). CPU gradients keep the float64 host sum: reading them waits for nothing.
torch::Tensor sum_of_squares_on_device(const std::vector<torch::Tensor>& grads) {
  if (grads.empty()) return torch::zeros({}, torch::kDouble);
  const torch::Device first = grads[0].device();
  torch::Tensor total;
  std::vector<torch::Tensor> same_device;
  for (size_t i = 0; i < grads.size(); ++i) {
    same_device.push_back(grads[i]);
    if (i + 1 < grads.size() && grads[i + 1].device() == grads[i].device()) continue;
    const auto norms = at::_foreach_norm(same_device, 2, torch::kFloat);  // bf16 gradients' norms in fp32
    const auto part = torch::stack(norms).to(torch::kDouble).pow(2).sum().to(first);
    total = total.defined() ? total + part : part;
    same_device.clear();
  }
  return total;
}

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm, ProcessGroup* shards_across) {
  torch::NoGradGuard no_grad;
  double host_total = 0;
  std::vector<torch::Tensor> on_cpu, on_gpu;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    // Summed in float64: ZeRO-3 must match DDP's clipping to 1e-5 through AdamW, which
    // magnifies a float32 norm's rounding in the clip coefficient.
    if (g.device().is_cpu()) {
      host_total += sum_of_squares_on_cpu(g);
      on_cpu.push_back(g);
    } else {
      on_gpu.push_back(g);
    }
  }
  if (on_gpu.empty()) {
    if (shards_across != nullptr) {
      auto across = torch::tensor({host_total}, torch::kDouble);
      shards_across->allreduce_sum(across).wait();
      host_total = across.item<double>();
    }
    const double norm = std::sqrt(host_total);
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0 && !on_cpu.empty()) at::_foreach_mul_(on_cpu, coef);
    return torch::scalar_tensor(norm, torch::kDouble);
  }
  torch::Tensor total = sum_of_squares_on_device(on_gpu) + host_total;
  if (shards_across != nullptr) shards_across->allreduce_sum(total).wait();  // a device tensor: no host wait
  const torch::Tensor norm = total.sqrt();
  if (std::isfinite(max_norm)) {
    const torch::Tensor coef = torch::clamp_max(max_norm / (norm + 1e-6), 1.0);
    at::_foreach_mul_(on_gpu, coef);
    for (auto& g : on_cpu) torch::Tensor(g).mul_(coef.item<double>());  // gradients on both: rare
  }
  return norm;
}

}  // namespace replica::distributed
