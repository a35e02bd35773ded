// Reading a run's safetensors files back and comparing them, shared by the end-to-end suites.
#pragma once

#include "replica/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>

namespace replica::testing {

inline std::map<std::string, torch::Tensor> load_tensors(const std::filesystem::path& file) {
  auto f = io::load_safetensors(file.string());
  return {f.tensors.begin(), f.tensors.end()};
}

// The largest element-wise difference over same-named tensors (in float64); a missing tensor
// or a shape mismatch is a test failure and returns a huge value.
inline double max_abs_diff(const std::map<std::string, torch::Tensor>& a,
                           const std::map<std::string, torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.sizes() != t.sizes()) {
      ADD_FAILURE() << "tensor " << name << " missing or of another shape";
      return 1e30;
    }
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

}  // namespace replica::testing
