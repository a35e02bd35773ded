#include "replica/models/rope_yarn.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace replica::models {
namespace {

double mscale_of(double scale, double mscale = 1.0) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// The dimension at which a frequency makes `rotations` turns over `positions`.
double correction_dim(double rotations, int64_t dim, double theta, double positions) {
  return (static_cast<double>(dim) * std::log(positions / (rotations * 2 * M_PI))) / (2 * std::log(theta));
}

}  // namespace

std::pair<torch::Tensor, double> yarn_inv_freq(const YarnScaling& s, double theta, int64_t dim,
                                               int64_t max_position_embeddings) {
  double attention = 0;
  if (s.attention_factor) {
    attention = *s.attention_factor;
  } else if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0) {
    attention = mscale_of(s.factor, *s.mscale) / mscale_of(s.factor, *s.mscale_all_dim);
  } else {
    attention = mscale_of(s.factor);
  }
  const double positions = static_cast<double>(s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                                                      : max_position_embeddings);
  double low = correction_dim(s.beta_fast, dim, theta, positions);
  double high = correction_dim(s.beta_slow, dim, theta, positions);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no zero-width ramp

  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto pos_freqs = torch::pow(torch::scalar_tensor(theta, f32), torch::arange(0, dim, 2, f32) / static_cast<double>(dim));
  auto extrapolation = 1.0 / pos_freqs;
  auto interpolation = 1.0 / (s.factor * pos_freqs);
  auto ramp = ((torch::arange(dim / 2, f32) - low) / (high - low)).clamp(0, 1);
  auto extrapolation_weight = 1 - ramp;
  auto inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight;
  return {inv_freq, attention};
}

}  // namespace replica::models
