// The launcher: torchrun's job in C++. Starts one worker process per slot with the
// torchrun environment, watches them, and ends the group as a whole.
//
// Why it is strict: a distributed job with one dead worker hangs the rest inside a
// collective. So the first worker to exit non-zero or die by a signal makes the launcher
// stop every other worker (SIGTERM, then SIGKILL after a grace period), say which rank
// failed and how, and exit non-zero. SIGINT/SIGTERM sent to the launcher reach every worker.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace replica::launch {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;        // 0: pick a free port on master_addr (single node only)
  int max_restarts = 0;       // restarts of the whole group after a failure
  double kill_grace_s = 3.0;  // SIGTERM -> SIGKILL delay when stopping workers
  int threads_per_worker = 0; // 0: usable cores / nproc_per_node (at least 1); sets OMP_NUM_THREADS
  // Network interface for the workers' collectives (GLOO_SOCKET_IFNAME); empty: Gloo's choice.
  std::string iface;
  // Where each worker's error file goes (REPLICA_ERROR_FILE = error_dir/rank-R.restart-N.json);
  // empty: a temporary directory removed when run() returns. The trainer passes
  // project_name/errors so the record stays with the run; that directory is created by
  // whoever writes the first record (a run that does not fail leaves none).
  std::string error_dir;
  std::vector<std::string> command;          // program and its arguments
  std::map<std::string, std::string> env;    // extra variables for every worker
  // The rendezvous secret every worker gets as REPLICA_TOKEN (never logged or written out).
  // Empty: the launcher's own REPLICA_TOKEN; neither set on one node: a fresh random one.
  // Several nodes must share one, so there it is never made up.
  std::string token;
};

// How one worker ended.
struct WorkerExit {
  int rank = -1;
  int local_rank = -1;
  int pid = -1;
  bool signaled = false;
  int code = 0;  // exit code, or the signal number when signaled
  std::string describe() const;  // "rank 1 (pid 123) exited with code 3" / "... was killed by SIGKILL"
};

// Runs the job to completion. Returns the launcher's exit code: 0 when every worker
// exited 0; otherwise the failed worker's exit code (128 + signal for a signal), after
// logging the failure to stderr. Every worker gets RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, REPLICA_RESTART_COUNT,
// OMP_NUM_THREADS (unless already set by the user), REPLICA_THREADS_PER_WORKER,
// REPLICA_ERROR_FILE. A failed worker's error file (written by the worker, or by the
// launcher when the worker died by a signal) is reported: message, rank and time.
int run(const LaunchOptions& options);

// Workers per node from "N" or "auto", for jobs on `gpus` GPUs (what this process sees, unless
// the job runs on the CPU: 0). With GPUs: auto = their count, and more workers than GPUs is an
// error naming both. On the CPU: auto = usable cores, and more than 4 workers per core is an
// error naming the limit. A spec that is neither is a replica::Error. `gpus_shared`: workers
// may share GPUs (ddp_backend gloo), so more workers than GPUs is allowed.
int resolve_nproc(const std::string& spec, int gpus, bool gpus_shared = false);
// The same for the GPUs this process sees (core/cuda.h; creates no CUDA context).
int resolve_nproc(const std::string& spec);

// 32 random bytes (OpenSSL RAND_bytes) as 64 hex digits: a fresh rendezvous secret.
std::string random_token();

// A TCP port that is free on `addr` right now (bind to port 0 and read it back).
int find_free_port(const std::string& addr = "127.0.0.1");

}  // namespace replica::launch
