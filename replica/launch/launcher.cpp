// The launcher: starts this node's workers with the torchrun environment, watches them,
// and ends the group as a whole (see launcher.h for why it is strict).
//
// Design notes:
// - Signals (the forwarded ones and SIGCHLD) are turned into bytes on a non-blocking
//   self-pipe; the monitor loop poll()s that pipe, so there is no race between "check for
//   exits" and "go to sleep", and no sleeping as synchronisation. The poll timeout only
//   serves the SIGTERM -> SIGKILL grace timer and a coarse safety net.
// - Workers are reaped with waitpid(pid, WNOHANG) on their own pids, never waitpid(-1), so
//   a program embedding run() keeps its other children to itself.
// - Between fork and exec the child only makes async-signal-safe calls: run() may be called
//   from a multi-threaded program (LibTorch starts thread pools), where anything that takes
//   a lock (malloc, stdio) could deadlock in the child.
#include "replica/launch/launcher.h"

#include "replica/core/cuda.h"
#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/core/system.h"

#include <fcntl.h>
#include <net/if.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

extern char** environ;

namespace replica::launch {

std::string WorkerExit::describe() const {
  std::string who = fmt::format("rank {} (local rank {}, pid {})", rank, local_rank, pid);
  if (signaled) return fmt::format("{} was killed by {}", who, signal_name(code));
  return fmt::format("{} exited with code {}", who, code);
}

namespace {

using Clock = std::chrono::steady_clock;

// The signals a launcher passes on to its workers (the set torchrun handles).
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// Upper bound on one poll() wait. Not needed for correctness (SIGCHLD wakes the loop); it
// only guarantees progress if SIGCHLD is somehow lost, e.g. blocked in every thread.
constexpr int kSafetyNetPollMs = 500;

// Write end of the self-pipe of the run() in progress, -1 when none. Read by the handler.
std::atomic<int> g_wake_fd{-1};
// run() owns process-wide signal dispositions while it runs, so only one may run at a time.
std::atomic<bool> g_run_active{false};

void on_signal(int signo) {
  const int saved_errno = errno;
  const int fd = g_wake_fd.load();
  if (fd >= 0) {
    const unsigned char byte = static_cast<unsigned char>(signo);
    // A full pipe drops the byte; harmless, since the pipe already holds a wake-up.
    ssize_t ignored = write(fd, &byte, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

void log_line(const std::string& line) {
  std::fprintf(stderr, "replica launch: %s\n", line.c_str());
  std::fflush(stderr);
}

std::string error_file_path(const std::string& dir, int rank, int restart) {
  return (std::filesystem::path(dir) / fmt::format("rank-{}.restart-{}.json", rank, restart)).string();
}

// A worker's error file holds one message; anything larger is not one.
constexpr std::uint64_t kMaxErrorFileBytes = std::uint64_t{1} << 20;

// Reports a failed worker's error file; when the worker left none (killed by a signal,
// crashed, OOM-killed) the launcher writes one for it, so every failure has its record.
void report_error_file(const std::string& path, const WorkerExit& exit, int restart) {
  std::error_code missing;
  if (std::filesystem::exists(path, missing)) {
    try {
      // Read as every outside JSON is (core/json.h): a regular file of bounded size and
      // nesting; a FIFO in its place is refused, not waited on.
      const auto j = parse_json(read_file(path, kMaxErrorFileBytes), path);
      std::string message = j.value("message", std::string("?"));
      if (message.size() > 2000) message = message.substr(0, 2000) + "...";
      // The rank the file claims only when it is an int (a float or a huge number would not
      // narrow); else the rank the launcher knows.
      const auto rank = j.find("rank");
      const bool rank_is_int = rank != j.end() && rank->is_number_integer() &&
                               rank->get<int64_t>() >= 0 && rank->get<int64_t>() <= std::numeric_limits<int>::max();
      log_line(fmt::format("rank {} reported at {}: {} (error file {})",
                           rank_is_int ? static_cast<int>(rank->get<int64_t>()) : exit.rank,
                           j.value("time", std::string("?")), message, path));
      return;
    } catch (const std::exception&) {
      // Torn, foreign or not a regular file: replace it with the launcher's own record below.
    }
  }
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
  const std::string message =
      exit.signaled ? fmt::format("killed by {} (no error reported: killed, crashed or out of memory)",
                                  signal_name(exit.code))
                    : fmt::format("exited with code {} without reporting an error", exit.code);
  nlohmann::json j = {{"message", message}, {"rank", exit.rank}, {"pid", exit.pid},
                      {"restart", restart}, {"time", stamp}};
  std::error_code ignored;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  std::ofstream(path) << j.dump() << "\n";
  log_line(fmt::format("rank {} left no error file; wrote {}", exit.rank, path));
}

// Installs the handlers for the forwarded signals and SIGCHLD for the duration of run(),
// and restores the caller's dispositions and signal mask afterwards.
class SignalScope {
 public:
  SignalScope() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      fail("replica launch: cannot create a pipe: {}", std::strerror(errno));
    }
    read_fd_ = fds[0];
    write_fd_ = fds[1];
    g_wake_fd.store(write_fd_);

    struct sigaction action {};
    action.sa_handler = on_signal;
    sigfillset(&action.sa_mask);  // handlers never nest; they only write one byte
    action.sa_flags = SA_RESTART;
    sigset_t unblock;
    sigemptyset(&unblock);
    for (int signo : kForwardedSignals) {
      struct sigaction previous {};
      sigaction(signo, nullptr, &previous);
      // Unix convention (nohup, `cmd &` in scripts): a signal ignored at start stays
      // ignored, and the workers inherit that, as they would without a launcher.
      // SIGTERM is how schedulers stop jobs, so it is always forwarded.
      if (previous.sa_handler == SIG_IGN && signo != SIGTERM) continue;
      install(signo, action);
      sigaddset(&unblock, signo);
    }
    struct sigaction child_action = action;
    child_action.sa_flags |= SA_NOCLDSTOP;  // wake on exits, not on stops
    install(SIGCHLD, child_action);
    sigaddset(&unblock, SIGCHLD);
    pthread_sigmask(SIG_UNBLOCK, &unblock, &saved_mask_);
  }

  ~SignalScope() {
    for (auto it = installed_.rbegin(); it != installed_.rend(); ++it) {
      sigaction(it->first, &it->second, nullptr);
    }
    pthread_sigmask(SIG_SETMASK, &saved_mask_, nullptr);
    g_wake_fd.store(-1);
    close(read_fd_);
    close(write_fd_);
  }

  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int fd() const { return read_fd_; }

  // Empties the pipe; returns the launcher signals received (SIGCHLD wake-ups are dropped:
  // the caller reaps after every wake-up anyway).
  std::vector<int> drain() {
    std::vector<int> signals;
    unsigned char buffer[64];
    for (;;) {
      const ssize_t n = read(read_fd_, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      for (ssize_t i = 0; i < n; ++i) {
        if (buffer[i] != SIGCHLD) signals.push_back(buffer[i]);
      }
    }
    return signals;
  }

 private:
  void install(int signo, const struct sigaction& action) {
    struct sigaction previous {};
    sigaction(signo, &action, &previous);
    installed_.emplace_back(signo, previous);
  }

  int read_fd_ = -1;
  int write_fd_ = -1;
  sigset_t saved_mask_{};
  std::vector<std::pair<int, struct sigaction>> installed_;
};

// argv/envp as exec wants them, built before fork (the child must not allocate).
struct ExecImage {
  std::vector<std::string> strings;  // argv strings, then "KEY=VALUE" strings
  std::vector<char*> argv;
  std::vector<char*> envp;
};

ExecImage make_image(const std::vector<std::string>& command,
                     const std::map<std::string, std::string>& environment) {
  ExecImage image;
  image.strings.reserve(command.size() + environment.size());
  for (const auto& arg : command) image.strings.push_back(arg);
  for (const auto& [key, value] : environment) image.strings.push_back(key + "=" + value);
  for (size_t i = 0; i < image.strings.size(); ++i) {
    char* s = image.strings[i].data();
    (i < command.size() ? image.argv : image.envp).push_back(s);
  }
  image.argv.push_back(nullptr);
  image.envp.push_back(nullptr);
  return image;
}

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> out;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq == nullptr) continue;
    out.emplace(std::string(*entry, static_cast<size_t>(eq - *entry)), std::string(eq + 1));
  }
  return out;
}

struct SpawnResult {
  pid_t pid = -1;         // -1: fork itself failed
  int error = 0;          // errno of the failed fork or exec, 0 on success
};

// Forks and execs one worker. Returns once the worker has exec'd or failed to: a CLOEXEC
// pipe stays open until exec succeeds, and carries errno back when it does not.
SpawnResult spawn(const ExecImage& image, pid_t launcher_pid) {
  SpawnResult result;
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    result.error = errno;
    return result;
  }
  // Block everything across fork so no handler of ours runs in the child before it has
  // reset the dispositions (it would write into the launcher's self-pipe).
  sigset_t all, saved;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &saved);
  const pid_t pid = fork();
  if (pid == 0) {
    // Child: async-signal-safe calls only from here to exec.
    struct sigaction defaults {};
    defaults.sa_handler = SIG_DFL;
    sigemptyset(&defaults.sa_mask);
    for (int signo : kForwardedSignals) {
      struct sigaction current {};
      sigaction(signo, nullptr, &current);
      if (current.sa_handler != SIG_IGN) sigaction(signo, &defaults, nullptr);
    }
    sigaction(SIGCHLD, &defaults, nullptr);
    // Programs expect these at their defaults; an embedding program may ignore them.
    sigaction(SIGPIPE, &defaults, nullptr);
    sigaction(SIGXFSZ, &defaults, nullptr);
    // A worker must never outlive its launcher (killed with SIGKILL, or crashed): it would
    // hang its peers in a collective and hold the GPU. If the launcher died before prctl
    // took effect we have already been reparented, so check and leave.
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher_pid) _exit(125);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(image.argv[0], image.argv.data(), image.envp.data());
    const int exec_errno = errno;
    ssize_t ignored = write(report[1], &exec_errno, sizeof exec_errno);
    (void)ignored;
    _exit(exec_errno == ENOENT ? 127 : 126);
  }
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  close(report[1]);
  if (pid < 0) {
    close(report[0]);
    result.error = fork_errno;
    return result;
  }
  result.pid = pid;
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(report[0], &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) result.error = exec_errno;
  return result;
}

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
};

// How one attempt at running the group ended.
struct GroupOutcome {
  enum class Kind { kSuccess, kWorkerFailed, kInterrupted, kStartFailed } kind = Kind::kSuccess;
  WorkerExit failure;  // kWorkerFailed
  int signo = 0;       // kInterrupted: the signal the launcher received
  int exit_code = 0;   // the launcher's exit code for this outcome
};

// One attempt: start this node's workers, watch them, stop them all when one fails or the
// launcher is signalled, and reap every one before returning.
class Group {
 public:
  Group(const LaunchOptions& options, int master_port, int restart_count, SignalScope& signals,
        std::string error_dir)
      : options_(options), master_port_(master_port), restart_count_(restart_count),
        signals_(signals), error_dir_(std::move(error_dir)) {}

  GroupOutcome run() {
    start_all();
    monitor();
    return outcome_;
  }

 private:
  std::map<std::string, std::string> worker_environment(const std::map<std::string, std::string>& base,
                                                        int rank, int local_rank) const {
    // Precedence: inherited environment < options.env < the launcher's own variables.
    // The rendezvous variables must be right or the job hangs, so nothing overrides them.
    std::map<std::string, std::string> env = base;
    for (const auto& [key, value] : options_.env) env[key] = value;
    const int world_size = options_.nnodes * options_.nproc_per_node;
    const int threads = options_.threads_per_worker > 0
                            ? options_.threads_per_worker
                            : std::max(1, usable_cores() / options_.nproc_per_node);
    env["RANK"] = std::to_string(rank);
    env["LOCAL_RANK"] = std::to_string(local_rank);
    env["WORLD_SIZE"] = std::to_string(world_size);
    env["LOCAL_WORLD_SIZE"] = std::to_string(options_.nproc_per_node);
    env["GROUP_RANK"] = std::to_string(options_.node_rank);
    env["GROUP_WORLD_SIZE"] = std::to_string(options_.nnodes);
    env["MASTER_ADDR"] = options_.master_addr;
    env["MASTER_PORT"] = std::to_string(master_port_);
    env["REPLICA_RESTART_COUNT"] = std::to_string(restart_count_);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_count_);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options_.max_restarts);
    env["REPLICA_THREADS_PER_WORKER"] = std::to_string(threads);
    env["REPLICA_ERROR_FILE"] = error_file_path(error_dir_, rank, restart_count_);
    if (!options_.iface.empty()) env["GLOO_SOCKET_IFNAME"] = options_.iface;
    // A user's explicit OMP_NUM_THREADS wins (torchrun behaves the same way); otherwise
    // workers sharing the cores must not each start one thread per core.
    if (env.find("OMP_NUM_THREADS") == env.end()) env["OMP_NUM_THREADS"] = std::to_string(threads);
    return env;
  }

  void start_all() {
    const auto base = current_environment();
    const pid_t launcher_pid = getpid();
    for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
      // A signal that arrived while starting: do not start more, stop those running.
      for (int signo : signals_.drain()) on_launcher_signal(signo);
      if (stopping_) return;

      const int rank = options_.node_rank * options_.nproc_per_node + local_rank;
      const auto environment = worker_environment(base, rank, local_rank);
      std::error_code ignored;  // a stale record of an earlier run must not be reported as this one's
      std::filesystem::remove(environment.at("REPLICA_ERROR_FILE"), ignored);
      const ExecImage image = make_image(options_.command, environment);
      const SpawnResult spawned = spawn(image, launcher_pid);
      if (spawned.pid > 0) workers_.push_back(Worker{rank, local_rank, spawned.pid, true});
      if (spawned.error == 0) continue;

      // The worker could not be started; restarting would fail the same way, so this ends
      // the run. A failed exec's child exits at once and is reaped by monitor().
      if (spawned.pid < 0) {
        log_line(fmt::format("cannot start rank {}: {}", rank, std::strerror(spawned.error)));
        outcome_.exit_code = 1;
      } else {
        log_line(fmt::format("cannot execute '{}': {}", options_.command.front(),
                             std::strerror(spawned.error)));
        outcome_.exit_code = spawned.error == ENOENT ? 127 : 126;  // the shell's codes
      }
      outcome_.kind = GroupOutcome::Kind::kStartFailed;
      begin_stop(SIGTERM);
      return;
    }
  }

  void monitor() {
    while (any_running()) {
      int timeout_ms = kSafetyNetPollMs;
      if (kill_at_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at_ - Clock::now());
        timeout_ms = static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, kSafetyNetPollMs));
      }
      pollfd wake{signals_.fd(), POLLIN, 0};
      poll(&wake, 1, timeout_ms);  // EINTR is fine: we look at everything below anyway
      for (int signo : signals_.drain()) on_launcher_signal(signo);
      reap();
      if (kill_at_ && Clock::now() >= *kill_at_) {
        kill_at_.reset();
        for (const auto& w : workers_) {
          if (!w.running) continue;
          log_line(fmt::format("rank {} (pid {}) did not stop within {}s; sending SIGKILL", w.rank,
                               w.pid, options_.kill_grace_s));
          kill(w.pid, SIGKILL);
        }
      }
    }
  }

  bool any_running() const {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
  }

  void reap() {
    for (auto& w : workers_) {
      if (!w.running) continue;
      int status = 0;
      pid_t r;
      do {
        r = waitpid(w.pid, &status, WNOHANG);
      } while (r < 0 && errno == EINTR);
      if (r == 0) continue;
      w.running = false;
      WorkerExit exit;
      exit.rank = w.rank;
      exit.local_rank = w.local_rank;
      exit.pid = w.pid;
      if (r < 0) {
        // ECHILD: someone else in this process reaped it; its status is lost. Count it as
        // a failure: a silently vanished worker would hang its peers.
        log_line(fmt::format("rank {} (pid {}) was reaped by someone else; its exit status is unknown",
                             w.rank, w.pid));
        exit.code = 1;
      } else if (WIFSIGNALED(status)) {
        exit.signaled = true;
        exit.code = WTERMSIG(status);
      } else {
        exit.code = WEXITSTATUS(status);
      }
      // Workers exiting while we stop the group are the consequence, not the cause.
      if (stopping_ || (!exit.signaled && exit.code == 0)) continue;
      log_line(exit.describe());
      report_error_file(error_file_path(error_dir_, exit.rank, restart_count_), exit, restart_count_);
      outcome_.kind = GroupOutcome::Kind::kWorkerFailed;
      outcome_.failure = exit;
      outcome_.exit_code = exit.signaled ? 128 + exit.code : exit.code;
      begin_stop(SIGTERM);
    }
  }

  void on_launcher_signal(int signo) {
    ++launcher_signals_;
    if (outcome_.kind != GroupOutcome::Kind::kInterrupted) {
      // Being told to stop wins over a worker failure: no restart, exit 128 + signal.
      outcome_.kind = GroupOutcome::Kind::kInterrupted;
      outcome_.signo = signo;
      outcome_.exit_code = 128 + signo;
    }
    if (launcher_signals_ > 1) {
      // Asked twice (Ctrl-C again): the user does not want to wait for the grace period.
      for (const auto& w : workers_) {
        if (w.running) kill(w.pid, SIGKILL);
      }
      kill_at_.reset();
      stopping_ = true;
      return;
    }
    begin_stop(signo);
  }

  // Sends `signo` to every running worker and arms the SIGKILL timer.
  void begin_stop(int signo) {
    stopping_ = true;
    for (const auto& w : workers_) {
      if (w.running) kill(w.pid, signo);
    }
    if (!kill_at_) {
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(options_.kill_grace_s));
    }
  }

  const LaunchOptions& options_;
  const int master_port_;
  const int restart_count_;
  SignalScope& signals_;
  const std::string error_dir_;
  std::vector<Worker> workers_;
  GroupOutcome outcome_;
  bool stopping_ = false;
  int launcher_signals_ = 0;
  std::optional<Clock::time_point> kill_at_;
};

void validate(const LaunchOptions& o) {
  if (o.command.empty() || o.command.front().empty()) fail("replica launch: no program to run was given");
  if (o.nproc_per_node < 1) fail("replica launch: nproc_per_node must be at least 1, got {}", o.nproc_per_node);
  if (o.nnodes < 1) fail("replica launch: nnodes must be at least 1, got {}", o.nnodes);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    fail("replica launch: node_rank {} is out of range for nnodes {} (0..{})", o.node_rank, o.nnodes,
         o.nnodes - 1);
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    fail("replica launch: master_port {} is out of range (0..65535)", o.master_port);
  }
  if (o.master_port == 0 && o.nnodes > 1) {
    fail("replica launch: master_port must be given when nnodes > 1 (got nnodes {}); every node "
         "must agree on it, so it cannot be picked at random",
         o.nnodes);
  }
  if (o.master_addr.empty()) fail("replica launch: master_addr is empty");
  if (o.max_restarts < 0) fail("replica launch: max_restarts must be >= 0, got {}", o.max_restarts);
  if (!(o.kill_grace_s >= 0) || !std::isfinite(o.kill_grace_s)) {
    fail("replica launch: kill_grace_s must be a finite number >= 0, got {}", o.kill_grace_s);
  }
  if (o.threads_per_worker < 0) {
    fail("replica launch: threads_per_worker must be >= 0, got {}", o.threads_per_worker);
  }
  if (!o.iface.empty() && if_nametoindex(o.iface.c_str()) == 0) {
    fail("replica launch: network interface '{}' (--iface) does not exist on this host (see `ip link`)", o.iface);
  }
  const int64_t world = int64_t{o.nnodes} * o.nproc_per_node;
  if (world > (int64_t{1} << 24)) fail("replica launch: world size {} is too large", world);
}

// The error files' directory when the caller named none. Removed when run() returns after a
// success (or when it holds nothing); kept after a failure, because the launcher has printed
// the path of the failed worker's error file in it.
class TemporaryDirectory {
 public:
  std::string create() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "replica-launch-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) fail("replica launch: cannot create a temporary directory: {}", std::strerror(errno));
    path_ = tmpl;
    return path_;
  }
  void keep_if_not_empty() { keep_ = true; }
  ~TemporaryDirectory() {
    std::error_code ignored;
    if (path_.empty()) return;
    if (keep_ && !std::filesystem::is_empty(path_, ignored)) return;
    std::filesystem::remove_all(path_, ignored);
  }

 private:
  std::string path_;
  bool keep_ = false;
};

// Runs the group, restarting it after a worker failure up to max_restarts times; the exit code.
int run_attempts(const LaunchOptions& options, int master_port, SignalScope& signals, const std::string& error_dir) {
  for (int restart = 0;; ++restart) {
    const GroupOutcome outcome = Group(options, master_port, restart, signals, error_dir).run();
    switch (outcome.kind) {
      case GroupOutcome::Kind::kSuccess:
        return 0;
      case GroupOutcome::Kind::kInterrupted:
        log_line(fmt::format("received {}; stopped all workers", signal_name(outcome.signo)));
        return outcome.exit_code;
      case GroupOutcome::Kind::kStartFailed:
        return outcome.exit_code;
      case GroupOutcome::Kind::kWorkerFailed:
        break;
    }
    if (restart >= options.max_restarts) {
      if (options.max_restarts > 0) {
        log_line(fmt::format("no restarts left ({} of {} used); exiting with code {}", restart,
                             options.max_restarts, outcome.exit_code));
      }
      return outcome.exit_code;
    }
    // A signal that came in between attempts must not be lost by starting over.
    const std::vector<int> pending = signals.drain();
    if (!pending.empty()) {
      log_line(fmt::format("received {}; not restarting", signal_name(pending.front())));
      return 128 + pending.front();
    }
    log_line(fmt::format("restarting workers (restart {} of {})", restart + 1, options.max_restarts));
  }
}

// Clears the single-run flag when run() leaves, however it leaves.
struct RunGuard {
  RunGuard() {
    if (g_run_active.exchange(true)) {
      fail("replica launch: run() is already running in this process; only one launcher may run at a time");
    }
  }
  ~RunGuard() { g_run_active.store(false); }
};

}  // namespace

int run(const LaunchOptions& requested) {
  validate(requested);
  LaunchOptions options = requested;
  if (options.token.empty()) options.token = env("REPLICA_TOKEN").value_or("");
  if (options.token.empty() && options.nnodes == 1) options.token = random_token();
  if (!options.token.empty()) options.env["REPLICA_TOKEN"] = options.token;
  RunGuard guard;
  // One port for the whole run: every restart rendezvouses at the same address.
  const int master_port = options.master_port != 0 ? options.master_port : find_free_port(options.master_addr);
  SignalScope signals;
  TemporaryDirectory scratch;
  const std::string error_dir = options.error_dir.empty() ? scratch.create() : options.error_dir;

  const int code = run_attempts(options, master_port, signals, error_dir);
  if (code != 0) scratch.keep_if_not_empty();
  return code;
}

int resolve_nproc(const std::string& spec) { return resolve_nproc(spec, visible_gpu_count()); }

int resolve_nproc(const std::string& spec, int gpus, bool gpus_shared) {
  const int cores = usable_cores();
  std::string lower = spec;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  int64_t n = 0;
  if (lower == "auto") {
    n = gpus > 0 ? gpus : cores;
  } else {
    const bool digits = !spec.empty() && std::all_of(spec.begin(), spec.end(), [](unsigned char c) {
      return std::isdigit(c) != 0;
    });
    if (!digits) fail("nproc_per_node must be a positive integer or 'auto', got '{}'", spec);
    // Anything over 9 digits is far beyond the limit below; avoid overflow while parsing.
    n = spec.size() > 9 ? std::numeric_limits<int64_t>::max() : std::stoll(spec);
    if (n < 1) fail("nproc_per_node must be a positive integer or 'auto', got '{}'", spec);
  }
  if (gpus > 0) {
    if (n > gpus && !gpus_shared) {
      fail("nproc_per_node {} exceeds the {} GPU{} visible on this node (one worker per GPU; CUDA_VISIBLE_DEVICES={}); "
           "start at most {}, let workers share GPUs over Gloo (ddp_backend: gloo), or train on the CPU (device: cpu)",
           spec, gpus, gpus == 1 ? "" : "s", env("CUDA_VISIBLE_DEVICES").value_or("unset"), gpus);
    }
    return static_cast<int>(n);
  }
  // Past a few workers per core, CPU workers only contend and time out in collectives.
  const int64_t limit = 4 * int64_t{cores};
  if (n > limit) {
    fail("nproc_per_node {} exceeds the limit of {} workers (4 per core x {} {}) on CPU", spec, limit,
         cores, cores == 1 ? "core" : "cores");
  }
  return static_cast<int>(n);
}

std::string random_token() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof bytes) != 1) fail("replica launch: OpenSSL could not produce a random token");
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

int find_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(addr.empty() ? nullptr : addr.c_str(), "0", &hints, &found);
  if (rc != 0) fail("cannot resolve address '{}': {}", addr, gai_strerror(rc));
  std::string last_error = "no usable address";
  int port = 0;
  for (addrinfo* a = found; a != nullptr && port == 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      last_error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (port == 0) fail("cannot find a free TCP port on '{}': {}", addr, last_error);
  return port;
}

}  // namespace replica::launch
