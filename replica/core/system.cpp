#include "replica/core/system.h"

#include "replica/core/error.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <dlfcn.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <nlohmann/json.hpp>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

namespace replica {

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return 1;
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::optional<int64_t> env_int(const char* name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || errno != 0 || end == nullptr || *end != '\0') {
    fail("environment variable {}='{}' is not an integer", name, *v);
  }
  return static_cast<int64_t>(x);
}

void set_compute_threads(int threads) {
  if (threads < 1) threads = 1;
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(threads);
}

// Note [which freed blocks the process keeps]
// Keeping every freed block in the heap (no mmap at all, no trimming) is fastest where the
// step's large blocks are sized like the parameters: gradients, optimizer temporaries, DDP and
// ZeRO buffers, cheap elementwise work whose page faults would cost as much as the work
// (MLP-54M, 4096 x 4096 fp32 weights of 64 MiB: world 1 at 43-65 samples/s kept against 34-39
// with blocks of 32 MiB and more mapped afresh, 3 alternating runs). Where the large blocks are
// activations of a big model (LoRA at hidden 4096: 32 MiB fp32-widened inputs, 44 MiB SwiGLU
// halves, 86 MiB down-projection inputs, each layer's checkpointed input kept between them),
// a heap that never gives memory back fragments: a bf16 LoRA step of 8 layers peaked at 6,112
// MiB against 5,212 with blocks of 32 MiB and more mapped per block (5,964 at 64 MiB; 5,095
// with glibc's default policy), at the same step time (342-352 s), since each such block feeds
// a GEMM whose work dwarfs its page faults. So blocks of 32 MiB (glibc's own ceiling for
// its dynamic threshold) and more are mapped per block unless a trainable parameter's bytes
// reach half of them: then the threshold is twice that parameter (a layer's weight and bias
// together, an fp32 copy of a bf16 weight), or, where glibc refuses such a threshold, nothing
// is mapped.
void keep_freed_memory_in_process(int64_t largest_parameter_bytes) {
#if defined(__GLIBC__)
  constexpr int64_t kGlibcDynamicThresholdMax = int64_t{32} << 20;
  constexpr int kGlibcDefaultMmapMax = 65536;
  const int64_t threshold = std::max(kGlibcDynamicThresholdMax, 2 * std::max<int64_t>(0, largest_parameter_bytes) + 4096);
  if (threshold > INT_MAX || mallopt(M_MMAP_THRESHOLD, static_cast<int>(threshold)) != 1) {
    mallopt(M_MMAP_MAX, 0);  // large blocks come from the heap, not per-block mmaps
  } else {
    mallopt(M_MMAP_MAX, kGlibcDefaultMmapMax);  // undoes an earlier call's 0
  }
  mallopt(M_TRIM_THRESHOLD, INT_MAX);  // and stay there when freed, for the next step
#else
  (void)largest_parameter_bytes;
#endif
}

void keep_freed_memory_for(const std::vector<at::Tensor>& parameters) {
  int64_t largest = 0;
  for (const auto& p : parameters) {
    if (p.defined() && p.requires_grad()) largest = std::max<int64_t>(largest, p.numel() * p.element_size());
  }
  keep_freed_memory_in_process(largest);
}

std::string signal_name(int signo) {
  switch (signo) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGSEGV: return "SIGSEGV";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    default: return "signal " + std::to_string(signo);
  }
}

}  // namespace replica

namespace replica {

namespace {
std::string& project_error_file() {
  static std::string path;
  return path;
}
}  // namespace

void keep_worker_error_file_at(const std::string& path) { project_error_file() = path; }

void write_worker_error_file(const std::string& message) {
  try {
    std::vector<std::string> paths;
    if (const auto path = env("REPLICA_ERROR_FILE"); path && !path->empty()) paths.push_back(*path);
    if (!project_error_file().empty() && (paths.empty() || paths[0] != project_error_file())) {
      paths.push_back(project_error_file());
    }
    if (paths.empty()) return;
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
    nlohmann::json j = {{"message", message},
                        {"rank", env_int("RANK").value_or(-1)},
                        {"pid", static_cast<int64_t>(getpid())},
                        {"restart", env_int("REPLICA_RESTART_COUNT").value_or(0)},
                        {"time", stamp}};
    for (const auto& path : paths) {
      std::error_code ignored;
      std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
      std::ofstream(path) << j.dump() << "\n";
    }
  } catch (...) {
    // Reporting must not turn one failure into another.
  }
}

}  // namespace replica
