#include "replica/core/system.h"

#include "replica/core/error.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <nlohmann/json.hpp>
#include <sched.h>
#include <unistd.h>

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

void keep_freed_memory_in_process() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_MAX, 0);              // large blocks come from the heap, not per-block mmaps
  mallopt(M_TRIM_THRESHOLD, INT_MAX);  // and stay there when freed, for the next step
#endif
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
