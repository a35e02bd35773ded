// Where a run starts and what it leaves to start again from: the choice between a fresh start
// and the newest usable checkpoint (the same on every rank), restoring one (model and
// optimizer through the parallel engine, the trainer's position, the RNG), and writing one.
#pragma once

#include "replica/train/run_config.h"
#include "replica/train/checkpoint.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

namespace replica::distributed {
class ProcessGroup;
}

namespace replica::train {

class ParallelEngine;
class Workload;

// The step of the checkpoint to resume from, or -1 for a fresh start; decided by rank 0
// before anything is written and shared. A project holding an earlier run's outputs but no
// usable checkpoint is a replica::Error naming them (a fresh start needs --overwrite, which
// removes them here). `restart_count` > 0: the launcher restarted this run after a failure,
// so outputs without a checkpoint are its own and it starts over.
int64_t decide_start(const RunConfig& config, distributed::ProcessGroup& pg, int restart_count);

// Restores checkpoint-`step` of the project and returns the trainer state to continue from
// (its position re-cut when the world size or batch size changed).
TrainerState resume(const RunConfig& config, int64_t step, ParallelEngine& engine, Workload& workload,
                    torch::optim::Optimizer& optimizer, distributed::ProcessGroup& pg, int restart_count);

// Writes checkpoint-STEP of `state` (collective: every worker takes part).
void save_run_checkpoint(const RunConfig& config, const TrainerState& state, ParallelEngine& engine,
                         Workload& workload, torch::optim::Optimizer& optimizer, distributed::ProcessGroup& pg);

}  // namespace replica::train
