// Helpers shared by the model tests: fixture paths, temporary directories, comparisons.
#pragma once

#include "replica/core/error.h"
#include "replica/models/linear.h"
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

// Runs `fn` in a child process and returns the replica::Error message it threw ("(no error)"
// when it returned). The child is ended by SIGALRM after 20 s and limited to 1 GiB more
// address space than it started with, so input that used to hang (a FIFO opened before it
// was checked), overflow the stack (JSON nested 10^6 deep) or read endlessly (/dev/zero)
// fails the test instead of hanging, crashing or exhausting the machine. For readers of
// files only: the child must not start LibTorch's thread pools after the fork.
inline std::string error_in_child(const std::function<void()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) return "(pipe failed)";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(20);
    long pages = 0;
    if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
      std::fclose(statm);
    }
    if (pages > 0) {
      const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{1} << 30);
      const rlimit r{limit, limit};
      ::setrlimit(RLIMIT_AS, &r);
    }
    std::string out = "(no error)";
    try {
      fn();
    } catch (const replica::Error& e) {
      out = e.what();
    } catch (const std::exception& e) {
      out = std::string("(not a replica::Error) ") + e.what();
    }
    for (size_t done = 0; done < out.size();) {
      const ssize_t n = ::write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    return "(child killed by signal " + std::to_string(WTERMSIG(status)) +
           (WTERMSIG(status) == SIGALRM ? ": it hung)" : ")");
  }
  return out;
}

}  // namespace replica::models::testing
