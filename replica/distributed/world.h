// Who this process is in the job: rank, world size, node and rendezvous address.
//
// Read from the environment the way torchrun sets it (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); under mpirun the same facts come
// from OMPI_COMM_WORLD_*, under Slurm from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/...
//
// Thread-safety: world_from_env() only reads the environment; safe from any thread as long
// as nothing calls setenv concurrently.
#pragma once

#include <optional>
#include <string>

namespace replica::distributed {

struct WorldInfo {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int restart_count = 0;
  std::string launched_by = "none";  // torchrun-env | mpirun | slurm | none

  bool is_distributed() const { return world_size > 1; }
  bool is_main() const { return rank == 0; }
};

// The worker's identity from the environment, or nullopt when no launcher set one
// (no RANK/WORLD_SIZE, no OMPI_COMM_WORLD_*, no SLURM_PROCID). Inconsistent values
// (RANK >= WORLD_SIZE, a non-integer) are a replica::Error naming the variable.
std::optional<WorldInfo> world_from_env();

// The first host of a Slurm hostlist ("node[01-02],gpu7" -> "node01", "10.0.0.[3-4]" ->
// "10.0.0.3"): under Slurm the master is the first node of the job unless MASTER_ADDR is set.
// replica::Error naming the list when it is empty or its brackets do not close.
std::string first_host_of_hostlist(const std::string& hostlist);

}  // namespace replica::distributed
