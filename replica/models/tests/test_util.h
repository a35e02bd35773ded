// Helpers shared by the model tests: fixture paths, temporary directories, comparisons.
#pragma once

#include "replica/core/error.h"
#include "replica/models/linear.h"
#include "replica/testing/error_in_child.h"
#include "replica/testing/paths.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <functional>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace replica::models::testing {

namespace fs = std::filesystem;

// Runs `body` once on each bf16 GEMM path of models/linear.h, whatever this machine's `auto`
// picks (Note [bf16 GEMMs through fp32 on CPUs without bf16 arithmetic]): ATen's bf16 kernels
// (taken where the CPU has AVX512-BF16 or AMX) and the fp32 GEMM (taken where it has neither).
// The setting is restored however body ends.
template <typename Body>
void for_each_bf16_gemm_path(Body&& body) {
  for (const bool through_fp32 : {false, true}) {
    SCOPED_TRACE(through_fp32 ? "bf16 GEMM path: through fp32" : "bf16 GEMM path: ATen's bf16 kernels");
    struct Restore {
      bool was;
      ~Restore() { set_cpu_bf16_through_fp32(was); }
    } restore{set_cpu_bf16_through_fp32(through_fp32)};
    body();
  }
}

inline std::string fixture(const std::string& name) {
  return std::string(REPLICA_SOURCE_DIR) + "/replica/models/tests/reference/fixtures/" + name;
}

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// A fresh directory under the system temp dir, removed when the test ends.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("replica_models_test_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str(const std::string& sub = "") const { return sub.empty() ? path.string() : (path / sub).string(); }
};

inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Expects `fn` to throw replica::Error whose message contains every needle.
template <typename Fn>
void expect_error(Fn fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected replica::Error containing " << needles.front();
  } catch (const replica::Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

using replica::testing::error_in_child;  // replica/testing/error_in_child.h

}  // namespace replica::models::testing
