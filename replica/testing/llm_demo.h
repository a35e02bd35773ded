// `replica llm init-demo`'s model, tokenizer, chats and preference rows, written once per test
// program into a temporary directory for the task tests that train on them (each test file
// keeps its runs in a subdirectory of its own: run_dir). The directory goes when every test of
// the program passed, and is kept for inspection otherwise.
#pragma once

#include "replica/tasks/llm_sft/llm_sft.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>

namespace replica::testing {

struct LlmDemoDir {
  std::filesystem::path root;
  train::LlmDemo demo;
  // A directory for one test file's runs, under root (made here).
  std::filesystem::path run_dir(const std::string& name) const {
    std::filesystem::create_directories(root / name);
    return root / name;
  }
};

namespace detail {
inline bool llm_demo_made = false;
}  // namespace detail

inline const LlmDemoDir& llm_demo() {
  static const LlmDemoDir* d = [] {
    auto* out = new LlmDemoDir;
    std::string tmpl = (std::filesystem::temp_directory_path() / "replica-llm-test-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    out->root = tmpl;
    out->demo = train::write_llm_demo((out->root / "demo").string());
    detail::llm_demo_made = true;
    return out;
  }();
  return *d;
}

namespace detail {
class RemoveLlmDemo : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!llm_demo_made) return;
    if (::testing::UnitTest::GetInstance()->Passed()) {
      std::error_code ignored;
      std::filesystem::remove_all(llm_demo().root, ignored);
    } else {
      std::cerr << "(LLM test directory kept for inspection: " << llm_demo().root << ")\n";
    }
  }
};
// One registration per program, whichever test files include this header (an inline variable).
[[maybe_unused]] inline ::testing::Environment* const remove_llm_demo =
    ::testing::AddGlobalTestEnvironment(new RemoveLlmDemo);
}  // namespace detail

}  // namespace replica::testing
