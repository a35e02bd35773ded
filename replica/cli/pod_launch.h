// Kubernetes: `replica --config` and `replica llm --train` in a pod of Kubeflow's PyTorchJob.
//
// Note [PyTorchJob pods]: the training operator gives every pod torchrun's agent variables:
// PET_NNODES (the pods), PET_NODE_RANK (this pod), PET_NPROC_PER_NODE (spec.nprocPerNode, N or
// auto) and PET_MASTER_ADDR/PET_MASTER_PORT (the master pod's service; operators before v1.7
// set only MASTER_ADDR/MASTER_PORT), beside RANK = the pod's index and WORLD_SIZE = pods x
// nprocPerNode. That RANK/WORLD_SIZE pair is meant for torchrun in the pod, not for a worker:
// with nprocPerNode 2 it names a world of 4 of which each pod would start one rank, and even
// with 1 it does not say where the ranks live (a worker would take them all for one host and
// join them through shared memory). So replica does what torchrun does there: `replica launch`
// takes PET_* as the defaults of its flags (torchrun's own convention, main.cpp), and a run
// started in a pod (PET_NNODES set, LOCAL_RANK not: no launcher started it) starts this pod's
// workers through the launcher, with the nodes, node rank, workers and master from PET_*.
// A master pod told MASTER_ADDR=localhost (some operators do) listens on its host name instead.
#pragma once

#include "replica/train/run_config.h"

#include <optional>
#include <string>
#include <vector>

namespace replica::cli {

// torchrun's variable `name` (PET_NNODES, PET_NODE_RANK, ...) as an integer, nullopt when unset;
// replica::Error naming it otherwise (PET_NNODES: an elastic range such as 1:4 is not supported).
std::optional<int> torchrun_env_int(const char* name);

// In a PyTorchJob pod: starts this pod's workers (re-running `self_argv`) and returns the
// launcher's exit code. Elsewhere nullopt (the caller runs train::run). replica::Error naming
// the variable for a PET_NNODES range (elastic jobs) or a missing PET_NODE_RANK / master.
std::optional<int> run_in_pytorchjob_pod(const train::RunConfig& config, const std::vector<std::string>& self_argv);

}  // namespace replica::cli
