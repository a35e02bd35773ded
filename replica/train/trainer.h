// The trainer: one command from a validated RunConfig to a finished project directory.
//
// run() is what `replica --config` calls. Started by a launcher (RANK/WORLD_SIZE, mpirun or
// Slurm variables set) it is that one worker. Otherwise, with nproc_per_node > 1, it starts
// its own workers through replica's launcher (the user types one command); with one worker
// it trains in-process.
//
// The loop (run_worker): epochs or max_steps; per-worker micro-batches of batch_size;
// gradient_accumulation micro-steps per optimizer step (communication only on the last where
// the engine can defer it); warm-up then constant/linear/cosine decay; gradient clipping;
// evaluation on the valid split; metrics.jsonl; checkpoint-STEP/ and resume from the newest
// whole one; final/. Only rank 0 writes shared files. Parallelism (DDP, sharded DDP, ZeRO-3)
// is applied once, by the engine (train/engine.h); reporting is train/step_log.h, starting
// and checkpointing train/run_state.h.
// Around the loop (replica/obs): rank 0's progress bar or plain lines, metrics.jsonl with the
// time split, TensorBoard events (log: tensorboard), the plot at the end, and with
// params.timeline (`--timeline FILE`, or REPLICA_TIMELINE) a Chrome trace of every rank.
//
// Thread-safety: one run per process (it sets the process's thread count, RNG seed and
// process-wide timeline); call it from the main thread.
#pragma once

#include "replica/train/run_config.h"

#include <torch/types.h>

#include <string>
#include <vector>

namespace replica::train {

// self_argv: the arguments that re-run this command (used to start workers).
int run(const RunConfig& config, const std::vector<std::string>& self_argv);

// One worker of the job (world from the environment, or a single process).
int run_worker(const RunConfig& config);

}  // namespace replica::train
