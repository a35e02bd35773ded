// Reading a run's safetensors files back and comparing them, shared by the end-to-end suites.
#pragma once

#include "replica/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>

namespace replica::testing {

inline std::map<std::string, torch::Tensor> load_tensors(const std::filesystem::path& file) {
  auto f = io::load_safetensors(file.string());
  return {f.tensors.begin(), f.tensors.end()};
}

// Calls fn(a's tensor, b's tensor) in float64 for each name of `a`; a name missing from `b`
// or of another shape is a test failure, and then the result is false.
template <typename Fn>
bool for_each_pair(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                   Fn fn) {
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.sizes() != t.sizes()) {
      ADD_FAILURE() << "tensor " << name << " missing or of another shape";
      return false;
    }
    fn(t.to(torch::kDouble), it->second.to(torch::kDouble));
  }
  return true;
}

// The largest element-wise difference over same-named tensors (in float64); a missing tensor
// or a shape mismatch is a test failure and returns a huge value.
inline double max_abs_diff(const std::map<std::string, torch::Tensor>& a,
                           const std::map<std::string, torch::Tensor>& b) {
  double worst = 0;
  const bool ok = for_each_pair(a, b, [&](const torch::Tensor& x, const torch::Tensor& y) {
    worst = std::max(worst, (x - y).abs().max().item<double>());
  });
  return ok ? worst : 1e30;
}

// Same names, dtypes and bits.
inline bool bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || t.scalar_type() != it->second.scalar_type() || !torch::equal(t, it->second)) return false;
  }
  return true;
}

// The L2 distance between two sets of same-named tensors, all of them as one vector.
inline double l2_distance(const std::map<std::string, torch::Tensor>& a,
                          const std::map<std::string, torch::Tensor>& b) {
  double sum = 0;
  const bool ok = for_each_pair(a, b, [&](const torch::Tensor& x, const torch::Tensor& y) {
    sum += (x - y).pow(2).sum().item<double>();
  });
  return ok ? std::sqrt(sum) : 1e30;
}

}  // namespace replica::testing
