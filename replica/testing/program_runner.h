// Runs a program as a child for end-to-end tests: the current environment minus any
// distributed-job variables (so the child is not mistaken for a worker of this job), one
// thread, optional standard input, stdout and stderr captured, and a deadline after which the
// child's whole process group is killed and the test fails. No sleeps: it waits on the pipes
// and on a pidfd.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace replica::testing {

struct Result {
  int exit_code = -1;       // exit status, or 128 + signal
  bool signaled = false;
  bool timed_out = false;
  double seconds = 0;
  std::string out, err;
  std::string all() const { return out + err; }
};

inline std::ostream& operator<<(std::ostream& os, const Result& r) {
  return os << "exit " << r.exit_code << (r.timed_out ? " (timed out)" : "") << " after " << r.seconds
            << " s\n--- stdout ---\n" << r.out << "--- stderr ---\n" << r.err;
}

// Variables that would make the child a worker of some other job.
inline bool is_world_variable(const std::string& name) {
  static const char* exact[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"};
  for (const char* e : exact) {
    if (name == e) return true;
  }
  for (const char* prefix : {"OMPI_", "PMI_", "SLURM_", "REPLICA_"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// A file's bytes, for assertions about what a run wrote; "" when it cannot be read (the
// assertion that follows then fails with the content it expected).
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// A child's environment: this process's minus the distributed-job variables (so the child
// is not mistaken for a worker of this job), one intra-op thread, plus `env`.
inline std::vector<std::string> child_environment(const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (is_world_variable(name) || env.count(name) || name == "OMP_NUM_THREADS") continue;
    env_s.push_back(entry);
  }
  env_s.push_back("OMP_NUM_THREADS=1");
  for (const auto& [k, v] : env) env_s.push_back(k + "=" + v);
  return env_s;
}

// Runs `program args...` with the current environment (minus world variables) plus `env`.
// Bounded by `limit`: on expiry the child's process group is killed and timed_out is set.
// A non-empty `cwd` is the child's working directory (relative paths in `args` resolve there).
inline Result run_program(const std::string& program, const std::vector<std::string>& args,
                          const std::map<std::string, std::string>& env = {},
                          std::chrono::seconds limit = std::chrono::seconds(60),
                          const std::string& stdin_text = "", const std::string& cwd = "") {
  using Clock = std::chrono::steady_clock;
  Result r;
  // Everything the child needs is built before fork (only async-signal-safe calls after).
  std::vector<std::string> argv_s = {program};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = child_environment(env);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  // Standard input from an unlinked temporary file (empty unless stdin_text is given).
  char in_path[] = "/tmp/replica-test-stdin-XXXXXX";
  const int in_fd = mkstemp(in_path);
  if (in_fd < 0 || write(in_fd, stdin_text.data(), stdin_text.size()) != static_cast<ssize_t>(stdin_text.size())) {
    ADD_FAILURE() << "cannot write the stdin file";
    return r;
  }
  lseek(in_fd, 0, SEEK_SET);
  unlink(in_path);
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return r;
  }
  const auto start = Clock::now();
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return r;
  }
  if (pid == 0) {
    setpgid(0, 0);
    dup2(in_fd, 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) {
      const char msg[] = "chdir to the working directory failed\n";
      ssize_t ignored = write(2, msg, sizeof msg - 1);
      (void)ignored;
      _exit(127);
    }
    execve(argv[0], argv.data(), envp.data());
    const char msg[] = "exec failed\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(127);
  }
  setpgid(pid, pid);  // also from here, so the group exists whichever runs first
  close(in_fd);
  close(out_pipe[1]);
  close(err_pipe[1]);

  // Wait on the two pipes and on the child itself (a pidfd turns readable when it exits),
  // with the deadline as poll's timeout.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) ADD_FAILURE() << "pidfd_open: " << std::strerror(errno);
  const auto deadline = start + limit;
  pollfd fds[3] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}, {pidfd, POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  bool exited = false;
  int status = 0;
  char buf[65536];
  while (fds[0].fd >= 0 || fds[1].fd >= 0 || (!exited && pidfd >= 0)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      r.timed_out = true;
      break;
    }
    const int n = poll(fds, 3, static_cast<int>(left));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ADD_FAILURE() << "poll: " << std::strerror(errno);
      r.timed_out = true;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[i]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
      }
    }
    if (fds[2].fd >= 0 && fds[2].revents != 0) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        close(fds[2].fd);
        fds[2].fd = -1;
      }
    }
  }
  if (r.timed_out) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
  }
  if (!exited) waitpid(pid, &status, 0);
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signaled = true;
    r.exit_code = 128 + WTERMSIG(status);
  }
  if (r.timed_out) {
    ADD_FAILURE() << program << " did not finish within " << limit.count() << " s and was killed\n" << r;
  }
  return r;
}

// A test with its own scratch directory (dir_), made fresh for each test and removed after it,
// or kept and named when the test failed, for inspection.
class ScratchDirTest : public ::testing::Test {
 protected:
  explicit ScratchDirTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix_ + "-XXXXXX")).string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << "cannot create a directory under " << tmpl;
    dir_ = tmpl;
  }
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << "(test directory kept for inspection: " << dir_ << ")\n";
      return;
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::filesystem::path dir_;

 private:
  std::string prefix_;
};

}  // namespace replica::testing
