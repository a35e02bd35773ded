// Helpers shared by the fuzz targets: the parsers under test read files, so each input is
// written to a per-process scratch directory under /dev/shm first; every target runs under a
// memory limit; and a replica::Error must be one bounded message.
#pragma once

#include "replica/core/error.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

namespace replica::fuzz {

inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const std::string d = "/dev/shm/replica-fuzz-" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    // Removed when the process exits normally (a crash leaves it: the input is in it too).
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all("/dev/shm/replica-fuzz-" + std::to_string(::getpid()), ignored);
    });
    return d;
  }();
  return dir;
}

inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

// Messages name the thing at fault and show at most an excerpt of a value (never the whole
// value: a 100 MB line or a 10^6-deep array must not come back in a message). Messages of the
// parsers under fuzzing are a few hundred characters; a longer one repeats the input.
inline constexpr size_t kMaxMessageChars = 4096;

inline void check_message(const replica::Error& e) {
  const size_t n = std::strlen(e.what());
  if (n == 0 || n > kMaxMessageChars) {
    std::fprintf(stderr, "replica::Error message of %zu characters (at most %zu): %.300s...\n", n,
                 kMaxMessageChars, e.what());
    __builtin_trap();
  }
}

}  // namespace replica::fuzz

// Every target runs under a memory limit (libFuzzer's -rss_limit_mb and -malloc_limit_mb,
// 2048 MB unless the command line says otherwise): an allocation sized from the input before
// it is checked (hidden_size 1e12, a shape of 2^31, samples: 10**12) is then a finding
// ("out-of-memory (malloc(...))") instead of a slow machine. libFuzzer parses its flags after
// LLVMFuzzerInitialize, and the last occurrence of a flag wins, so the defaults go first.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  static char rss[] = "-rss_limit_mb=2048";
  static char malloc_limit[] = "-malloc_limit_mb=2048";
  static char* args[1024];
  const int n = *argc;
  if (n < 1 || n + 3 > 1024) return 0;
  args[0] = (*argv)[0];
  args[1] = rss;
  args[2] = malloc_limit;
  for (int i = 1; i < n; ++i) args[i + 2] = (*argv)[i];
  args[n + 2] = nullptr;
  *argc = n + 2;
  *argv = args;
  return 0;
}
