// parse_config's error for a config text that must not parse: the tests of the key tables
// (run_config_test.cpp) and of DeepSpeed's config (deepspeed_config_test.cpp) assert on it.
#pragma once

#include "replica/core/error.h"
#include "replica/train/run_config.h"

#include <gtest/gtest.h>

#include <string>

namespace replica::train::testing {

// parse_config(text, "run.yaml")'s replica::Error message; fails the test when the text parses.
inline std::string parse_error_of(const std::string& text) {
  try {
    parse_config(text, "run.yaml");
  } catch (const replica::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without error:\n" << text;
  return "";
}

}  // namespace replica::train::testing
