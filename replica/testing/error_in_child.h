// error_in_child: a parser run in a forked child, bounded in time and address space, for
// tests of hostile input that used to hang, overflow the stack or allocate without bound.
#pragma once

#include "replica/core/error.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>

namespace replica::testing {

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

}  // namespace replica::testing
