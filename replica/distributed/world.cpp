#include "replica/distributed/world.h"

#include "replica/core/error.h"
#include "replica/core/system.h"

#include <cctype>
#include <cstdlib>

namespace replica::distributed {
namespace {

int required_int(const char* name) {
  auto v = env_int(name);
  if (!v) fail("environment variable {} is not set", name);
  return static_cast<int>(*v);
}

int int_or(const char* name, int fallback) {
  auto v = env_int(name);
  return v ? static_cast<int>(*v) : fallback;
}

void read_master(WorldInfo& w) {
  if (auto a = env("MASTER_ADDR")) w.master_addr = *a;
  if (auto p = env_int("MASTER_PORT")) w.master_port = static_cast<int>(*p);
}

void validate(const WorldInfo& w, const char* rank_var, const char* size_var) {
  if (w.world_size < 1) fail("{}={} must be at least 1", size_var, w.world_size);
  if (w.rank < 0 || w.rank >= w.world_size) {
    fail("{}={} is outside the world of {}={} ranks", rank_var, w.rank, size_var, w.world_size);
  }
  if (w.local_world_size < 1 || w.local_rank < 0 || w.local_rank >= w.local_world_size) {
    fail("local rank {} is outside the local world of {} ranks", w.local_rank, w.local_world_size);
  }
  if (w.master_port < 1 || w.master_port > 65535) {
    fail("MASTER_PORT={} is not a TCP port (1..65535)", w.master_port);
  }
}

// SLURM_TASKS_PER_NODE looks like "2(x3),1": the leading count is this node's on uniform jobs.
int leading_int_or(const char* name, int fallback) {
  auto v = env(name);
  if (!v || v->empty() || !std::isdigit(static_cast<unsigned char>((*v)[0]))) return fallback;
  return std::atoi(v->c_str());
}

}  // namespace

std::string first_host_of_hostlist(const std::string& hostlist) {
  std::string host;
  int depth = 0;
  bool skipping = false;  // inside brackets, past the first element of the range list
  for (char c : hostlist) {
    if (c == '[') {
      if (depth++ > 0) fail("SLURM_NODELIST '{}' has nested brackets", hostlist);
      skipping = false;
      continue;
    }
    if (c == ']') {
      if (depth-- == 0) fail("SLURM_NODELIST '{}' has a ']' without '['", hostlist);
      continue;
    }
    if (depth == 0 && c == ',') break;  // the first host ends here
    if (depth > 0 && (c == '-' || c == ',')) skipping = true;
    if (depth > 0 && skipping) continue;
    if (c != ' ') host += c;
  }
  if (depth != 0) fail("SLURM_NODELIST '{}' has a '[' that is not closed", hostlist);
  if (host.empty()) fail("SLURM_NODELIST '{}' names no host", hostlist);
  return host;
}

std::optional<WorldInfo> world_from_env() {
  WorldInfo w;
  if (env("RANK") || env("WORLD_SIZE")) {
    // torchrun / replica launch.
    w.rank = required_int("RANK");
    w.world_size = required_int("WORLD_SIZE");
    w.local_rank = int_or("LOCAL_RANK", w.rank);
    w.local_world_size = int_or("LOCAL_WORLD_SIZE", w.world_size);
    w.node_rank = int_or("GROUP_RANK", 0);
    w.restart_count = int_or("REPLICA_RESTART_COUNT", int_or("TORCHELASTIC_RESTART_COUNT", 0));
    w.launched_by = "torchrun-env";
    read_master(w);
    validate(w, "RANK", "WORLD_SIZE");
    return w;
  }
  if (env("OMPI_COMM_WORLD_RANK")) {
    w.rank = required_int("OMPI_COMM_WORLD_RANK");
    w.world_size = required_int("OMPI_COMM_WORLD_SIZE");
    w.local_rank = int_or("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    w.local_world_size = int_or("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    // OMPI_COMM_WORLD_NODE_RANK is the rank among the processes of a node (like LOCAL_RANK),
    // not the node's index. With mpirun's default placement (--map-by slot: consecutive ranks
    // fill a node) the node index is rank / local size.
    w.node_rank = w.local_world_size > 0 ? w.rank / w.local_world_size : 0;
    w.launched_by = "mpirun";
    read_master(w);
    validate(w, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    return w;
  }
  if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    w.rank = required_int("SLURM_PROCID");
    w.world_size = required_int("SLURM_NTASKS");
    w.local_rank = int_or("SLURM_LOCALID", 0);
    w.local_world_size = int_or("SLURM_NTASKS_PER_NODE", leading_int_or("SLURM_TASKS_PER_NODE", 1));
    w.node_rank = int_or("SLURM_NODEID", 0);
    w.restart_count = int_or("SLURM_RESTART_COUNT", 0);
    w.launched_by = "slurm";
    // The master: the job's first node, on a port derived from the job id (PyTorch
    // Lightning's convention) so that jobs sharing a node do not collide; MASTER_* win.
    auto nodes = env("SLURM_STEP_NODELIST");
    if (!nodes) nodes = env("SLURM_JOB_NODELIST");
    if (!nodes) nodes = env("SLURM_NODELIST");
    if (nodes) w.master_addr = first_host_of_hostlist(*nodes);
    if (auto job = env_int("SLURM_JOB_ID")) w.master_port = 10000 + static_cast<int>(*job % 20000);
    read_master(w);
    validate(w, "SLURM_PROCID", "SLURM_NTASKS");
    return w;
  }
  return std::nullopt;
}

}  // namespace replica::distributed
