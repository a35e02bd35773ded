// ZeRO-3 checkpoints: every worker writes its own shard, so no worker ever holds the whole
// model state. Layout inside a checkpoint directory:
//   zero/metadata.json        world size and, per group, its parameters (name, shape, offset)
//   zero/rank-K.safetensors   worker K's fp32 master shards ("group.G"), its optimizer state
//                             ("group.G.<field>", train/optim.h's names) and, on rank 0, the
//                             model's buffers ("buffers.<name>")
// Loading at another world size re-shards: the old shards of a group are joined into the
// flat buffer and cut again; per-group scalars (AdamW's step) are taken from rank 0.
// consolidate() rebuilds the full model with the names and dtypes DDP saves.
#pragma once

#include "replica/io/safetensors.h"
#include "replica/zero/zero3.h"

#include <string>

namespace replica::zero {

// Collective only in that every worker calls it with its own state; rank 0 also writes
// metadata.json (after which the caller should barrier before using the directory).
void save_shards(const std::string& zero_dir, Zero3& engine, const io::NamedTensors& optimizer_state);

struct ShardSlice {
  io::NamedTensors masters;    // "group.G" -> [S] for this worker
  io::NamedTensors optimizer;  // "group.G.<field>"
  io::NamedTensors buffers;    // model buffer name -> tensor
  int saved_world_size = 0;
};
// This worker's slice of what zero_dir holds, for `rank` of `world` workers (re-sharded when
// the checkpoint was written by another number of workers). replica::Error names the file at
// fault (missing rank file, metadata that does not match the shards).
ShardSlice load_shards(const std::string& zero_dir, int rank, int world);

// The full model as DDP would save it (parameters in the model's order, then buffers).
io::NamedTensors consolidate(const std::string& zero_dir);
// The zero/ directory of `checkpoint_dir` (a checkpoint-STEP directory holding zero/, or the
// zero/ directory itself); replica::Error naming it when it is neither.
std::string zero_dir_of(const std::string& checkpoint_dir);

}  // namespace replica::zero
