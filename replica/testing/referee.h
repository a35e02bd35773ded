// Test support: running the real Python stack (torch, transformers, peft, tokenizers, ...) as
// the referee of a conformance test. Header-only, for test programs.
//
// The interpreter is the project's virtual environment (.venv, passed by scripts/setup.sh as
// the CMake cache entry REPLICA_PYTHON) unless the environment variable REPLICA_PYTHON names
// another. A test whose referee package is missing skips with a message naming it; with
// REPLICA_REQUIRE_REFEREES=1 (scripts/test.sh, so CI) a missing package fails the test instead,
// so that a broken install cannot pass as a run of skipped tests.
#pragma once

#include <gtest/gtest.h>
#include "replica/testing/paths.h"
#include <stdlib.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <iostream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace replica::testing {

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The Python that holds the reference packages.
inline std::string python() {
  if (const char* p = std::getenv("REPLICA_PYTHON"); p && *p) return p;
  if (std::string(REPLICA_PYTHON).size() && std::filesystem::exists(REPLICA_PYTHON)) return REPLICA_PYTHON;
  return "python3";
}

struct PythonRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `python() script args...` and collects its output.
inline PythonRun run_python(const std::filesystem::path& script, const std::vector<std::string>& args = {}) {
  std::string cmd = shell_quote(python()) + " " + shell_quote(script.string());
  for (const auto& a : args) cmd += " " + shell_quote(a);
  cmd += " 2>&1";
  PythonRun run;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return run;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) run.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

// "" when every package is installed for python(), else a sentence naming the first that is
// not. One interpreter, find_spec (no import: transformers alone takes 3 s to import), and the
// answer cached per package for the test program's life.
inline std::string missing_packages(std::initializer_list<const char*> packages) {
  static std::map<std::string, bool> installed;
  std::string unknown;
  for (const char* pkg : packages) {
    if (!installed.count(pkg)) unknown += std::string(" ") + pkg;
  }
  if (!unknown.empty()) {
    const std::string cmd = shell_quote(python()) +
                            " -c 'import importlib.util, sys; print(\" \".join(p for p in sys.argv[1:] if "
                            "importlib.util.find_spec(p) is None))'" + unknown + " 2>/dev/null";
    std::string out;
    bool ran = false;
    if (FILE* pipe = ::popen(cmd.c_str(), "r")) {
      std::array<char, 512> buf{};
      size_t n = 0;
      while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
      ran = ::pclose(pipe) == 0;
    }
    std::istringstream words(out);
    std::set<std::string> missing{std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
    for (const char* pkg : packages) {
      // Missing when the interpreter could not run, or named it.
      if (!installed.count(pkg)) installed[pkg] = ran && !missing.count(pkg);
    }
  }
  for (const char* pkg : packages) {
    if (!installed[pkg]) {
      return std::string("referee package '") + pkg + "' is not installed for " + python() +
             " (scripts/test.sh installs scripts/requirements-test.txt into .venv)";
    }
  }
  return "";
}

inline bool referees_required() {
  const char* v = std::getenv("REPLICA_REQUIRE_REFEREES");
  return v && std::string(v) == "1";
}

// A fresh directory under the system's temporary directory ("<prefix>-XXXXXX"), removed with
// everything in it when the object goes, unless the test failed (then kept and named on stderr).
struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& prefix) {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path = pattern;
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    if (::testing::Test::HasFailure()) {
      std::cerr << "(test directory kept for inspection: " << path << ")\n";
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  // dir / "name": the path of an entry inside, as a string.
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

}  // namespace replica::testing

// Skips the test (or fails it, under REPLICA_REQUIRE_REFEREES=1) when a referee package is
// missing: REPLICA_REQUIRE_PYTHON("transformers", "peft");
#define REPLICA_REQUIRE_PYTHON(...)                                                   \
  do {                                                                                \
    const std::string replica_missing_ = ::replica::testing::missing_packages({__VA_ARGS__}); \
    if (!replica_missing_.empty()) {                                                  \
      if (::replica::testing::referees_required()) FAIL() << replica_missing_;        \
      GTEST_SKIP() << replica_missing_;                                               \
    }                                                                                 \
  } while (0)
