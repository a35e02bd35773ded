// Shared by the conformance tests that take Hugging Face transformers and PEFT as referees
// (replica/models/tests/hf_conformance_test.cpp, replica/train/tests/peft_conformance_test.cpp):
// the referee scripts, scratch directories, logit comparisons and greedy decoding.
#pragma once

#include "replica/io/safetensors.h"
#include "replica/testing/paths.h"
#include "replica/models/llama.h"
#include "replica/testing/referee.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace replica::models::conformance {

namespace fs = std::filesystem;

// replica/models/tests/referee/NAME.
inline fs::path referee_script(const std::string& name) {
  return fs::path(REPLICA_SOURCE_DIR) / "replica" / "models" / "tests" / "referee" / name;
}

// A fresh directory under the temp dir for one test: removed when the test passed, kept
// (and named on stderr) when it failed, for inspection.
using ScratchDir = replica::testing::ScratchDir;

inline std::map<std::string, torch::Tensor> load_tensors(const std::string& file) {
  auto f = io::load_safetensors(file);
  return {f.tensors.begin(), f.tensors.end()};
}

inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return 1e30;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Positions [B, T] whose argmax over the vocabulary differs between two logit tensors.
inline int64_t argmax_mismatches(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.argmax(-1) != b.argmax(-1)).sum().item<int64_t>();
}

// Argmax differences only where `reference`'s top two logits are more than `gap` apart (a
// near tie may flip under rounding either side of it).
inline int64_t clear_argmax_mismatches(const torch::Tensor& ours, const torch::Tensor& reference, double gap) {
  const auto top2 = std::get<0>(reference.topk(2, -1));
  const auto clear = (top2.select(-1, 0) - top2.select(-1, 1)) > gap;
  return ((ours.argmax(-1) != reference.argmax(-1)).logical_and(clear)).sum().item<int64_t>();
}

// The fp32 logits check of every conformance test: within `tolerance` of transformers',
// the same argmax everywhere, and transformers' logits far from uniform (else every model
// would pass). Returns the max |diff|.
inline double expect_logits_match(const torch::Tensor& logits, const torch::Tensor& expected, double tolerance) {
  const double d = max_abs_diff(logits, expected);
  EXPECT_LE(d, tolerance);
  const double spread = (expected.amax(-1) - expected.amin(-1)).min().item<double>();
  EXPECT_GT(spread, 0.5);
  EXPECT_EQ(argmax_mismatches(logits, expected), 0);
  return d;
}

// Greedy decoding with replica: `new_tokens` times, the whole sequence through the model and
// the argmax of the last position appended (no KV cache; the same tokens if the logits are).
inline torch::Tensor greedy(LlamaForCausalLM& model, torch::Tensor ids, int64_t new_tokens) {
  torch::NoGradGuard no_grad;
  ids = ids.to(torch::kInt64);
  for (int64_t i = 0; i < new_tokens; ++i) {
    auto next = model->forward(ids).select(1, -1).argmax(-1, /*keepdim=*/true);
    ids = torch::cat({ids, next.to(torch::kInt64)}, 1);
  }
  return ids;
}

// Runs a referee script; a non-zero exit fails the calling test (ASSERT_TRUE on the result).
inline ::testing::AssertionResult run_referee(const std::string& script, const std::vector<std::string>& args,
                                              std::string* output = nullptr) {
  const auto run = replica::testing::run_python(referee_script(script), args);
  if (output) *output = run.output;
  if (run.exit_code != 0) {
    return ::testing::AssertionFailure() << script << " exited with " << run.exit_code << ":\n" << run.output;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace replica::models::conformance
