// Multi-process test scenarios: the test binary starts copies of itself through replica's
// launcher (`<binary> --worker NAME`, one per rank, torchrun's environment), and each copy runs
// one rank of scenario NAME; replica/testing/worker_main.cpp is those binaries' main.
#pragma once

#include "replica/launch/launcher.h"

#include <map>
#include <string>

namespace replica::testing {

// Starts `nproc` workers running scenario `name` (one thread each) and waits for them: the
// launcher's exit code, 0 when every rank's checks passed.
inline int launch_scenario(const std::string& name, int nproc, const std::map<std::string, std::string>& env = {}) {
  launch::LaunchOptions opts;
  opts.env = env;
  opts.nproc_per_node = nproc;
  opts.threads_per_worker = 1;
  opts.command = {"/proc/self/exe", "--worker", name};
  return launch::run(opts);
}

}  // namespace replica::testing
