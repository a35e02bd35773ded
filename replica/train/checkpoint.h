// Checkpoints in Hugging Face Trainer's layout: project/checkpoint-STEP/ with
// model.safetensors, optimizer.safetensors, rng_state.safetensors and trainer_state.json.
//
// Why the care: a crash mid-save must leave the previous checkpoint intact, and a restart
// must find the newest checkpoint that is whole. A checkpoint is first written to a
// temporary directory and renamed into place only when every file is on disk; a directory
// whose trainer_state.json or tensors do not load is skipped with a warning naming it.
#pragma once

#include "replica/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace replica::train {

struct TrainerState {
  int64_t global_step = 0;       // optimizer steps done
  int64_t epoch = 0;             // epoch in progress
  int64_t micro_step = 0;        // micro-batches of `epoch` already consumed
  int world_size = 1;
  int64_t batch_size = 0;        // per worker, per micro-step, when saved (0: unknown)
  int64_t seed = 0;
  double loss_scale = 0;             // fp16's dynamic loss scale (0: none)
  int64_t loss_scale_good_steps = 0;  // steps since it last changed
  int64_t nonfinite_skipped_steps = 0;  // steps skipped for a NaN/Inf loss (nonfinite_loss: skip)
  nlohmann::json log_history = nlohmann::json::array();  // last metrics, for humans
  nlohmann::json to_json() const;
  static TrainerState from_json(const nlohmann::json& j, const std::string& where);
};

struct Checkpoint {
  std::string dir;
  TrainerState state;
  io::NamedTensors model;                 // written to model_file
  std::string model_file = "model.safetensors";  // or adapter_model.safetensors (PEFT)
  std::function<void(const std::string&)> extras;  // writes more files into the temporary dir
  io::NamedTensors optimizer;
  io::NamedTensors rng;
};

// Writes project/checkpoint-STEP atomically, then deletes the oldest complete checkpoints
// beyond save_total_limit (<= 0 keeps all). Returns the directory.
std::string save_checkpoint(const std::string& project_dir, const Checkpoint& checkpoint,
                            int save_total_limit);

// checkpoint-N directories under project_dir that replica wrote (is_replica_checkpoint in
// project_dir.h: real directories holding its completion marker; symbolic links, staging
// directories and anything else excluded), newest first. Rotation and resume use this list.
std::vector<std::string> list_checkpoints(const std::string& project_dir);

// Loads a checkpoint directory; replica::Error naming the file at fault.
Checkpoint load_checkpoint(const std::string& dir);

// The newest checkpoint that loads; corrupt ones are skipped with a warning on stderr.
// `skipped` receives the directories that did not load.
std::optional<Checkpoint> latest_checkpoint(const std::string& project_dir,
                                            std::vector<std::string>* skipped = nullptr);

// `replica consolidate CHECKPOINT_DIR OUT.safetensors`: a ZeRO-3 checkpoint's shards joined
// into what DDP writes for the same run. A full fine-tune: the whole model (the names and
// dtypes of model.safetensors). A LoRA run (adapter_config.json in the checkpoint): only the
// adapter, under PEFT's names (as adapter_model.safetensors), and adapter_config.json is
// copied beside OUT when that directory has none, so that a directory holding
// OUT = adapter_model.safetensors loads with PeftModel.from_pretrained. Returns the paths
// written. replica::Error naming the directory when it is not a ZeRO-3 checkpoint.
std::vector<std::string> consolidate_checkpoint(const std::string& checkpoint_dir, const std::string& out_path);

}  // namespace replica::train
