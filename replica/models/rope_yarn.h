// YaRN rotary scaling (rope_scaling {"rope_type": "yarn", ...}; GPT-OSS): the rotary inverse
// frequencies blended between interpolation (divided by `factor`) for the low frequencies and
// extrapolation (unchanged) for the high ones, with a linear ramp between the dimensions
// found from beta_fast / beta_slow rotations over original_max_position_embeddings; and an
// attention factor that multiplies cos and sin. transformers' _compute_yarn_parameters,
// number for number.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace replica::models {

struct YarnScaling {
  double factor = 1.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> attention_factor;  // null: from factor (and mscale / mscale_all_dim)
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  int64_t original_max_position_embeddings = 0;  // 0: the model's max_position_embeddings
  bool truncate = true;
};

// (inv_freq [dim / 2] fp32, attention factor) for rotary dimension `dim` and base `theta`.
std::pair<torch::Tensor, double> yarn_inv_freq(const YarnScaling& s, double theta, int64_t dim,
                                               int64_t max_position_embeddings);

}  // namespace replica::models
