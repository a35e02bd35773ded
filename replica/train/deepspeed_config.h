// `deepspeed: ds_config.json`: a DeepSpeed JSON config, as DeepSpeed, Accelerate and the
// transformers Trainer users already have one, read into replica's own keys (Note [DeepSpeed
// config] in deepspeed_config.cpp lists every field and what it becomes).
#pragma once

#include "replica/train/keys.h"
#include "replica/train/run_config.h"

namespace replica::train {

// Reads params.deepspeed (nothing when empty) into the keys it names. A field replica does not
// implement, a value it cannot honour, or a value that contradicts a key the YAML file or a
// flag gave (`loc` knows which) is a replica::Error naming the JSON field (and the key);
// "auto" leaves replica's value. Idempotent: config.yaml, which keeps `deepspeed:` and the
// values read from it, reads back to the same run.
void apply_deepspeed_config(RunConfig& config, const KeyLocation& loc);
// For a config built from flags (`replica llm`): every key may take the file's value.
void apply_deepspeed_config(RunConfig& config);

}  // namespace replica::train
