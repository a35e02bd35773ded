// The run configuration: the AutoTrain-style YAML of PRODUCT.md, validated and resolved.
//
// Why one typed struct: every concern reads its knobs from here, and config.yaml in the
// project directory is written back from it with every default filled in. Validation
// happens entirely before any worker starts: an unknown key (with a "did you mean"
// suggestion), a wrong type or a bad value is a replica::Error naming the file, line and key.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace replica::io {

struct DataConfig {
  std::string path;                         // image tasks default: /usr/share/datasets/fashion-mnist
  std::string train_split = "train";
  std::optional<std::string> valid_split;   // image tasks default: "t10k"; YAML null turns eval off
  std::string chat_template = "tokenizer";  // tokenizer | chatml | llama3 | none
  std::map<std::string, std::string> column_mapping;  // text_column: text, ...
};

struct Params {
  // Run control (PRODUCT.md "Run-control keys").
  std::string distributed_backend = "ddp";  // ddp | zero3 ("deepspeed" and null normalised)
  int nproc_per_node = 0;                   // 0 = auto (usable cores on CPU)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                      // 0 = pick a free port (single node)
  double rdzv_timeout = 300;                // seconds
  double collective_timeout = 600;          // seconds
  int max_restarts = 0;
  bool deterministic = false;
  std::string token;                        // never written back out
  // ZeRO-3 (distributed_backend zero3): DeepSpeed's zero_optimization names and defaults.
  double stage3_prefetch_bucket_size = 5e7;         // elements gathered ahead of use
  double stage3_param_persistence_threshold = 1e5;  // smaller layers stay gathered
  double stage3_max_live_parameters = 1e9;          // elements gathered at once
  double reduce_bucket_size = 5e8;                  // accepted (each layer is reduced whole)
  bool overlap_comm = true;                         // prefetch the next layer's gather
  // DDP: each worker steps only its 1/N shard of the parameters (reduce-scatter, sharded
  // optimizer state, all-gather; ZeRO stage 2 inside DDP). Same result as plain DDP.
  // nullopt = auto: on when the workers share one host's memory and train on the CPU (there
  // the parameters are kept once for all of them), off otherwise.
  std::optional<bool> shard_optimizer;

  // Training loop.
  int epochs = 1;
  int64_t max_steps = -1;                   // > 0 wins over epochs
  int batch_size = 64;                      // per worker, per micro-step
  int gradient_accumulation = 1;
  std::string mixed_precision = "fp32";     // fp32 | bf16
  std::string optimizer = "adamw";          // sgd | adamw
  double lr = 1e-3;
  double momentum = 0.9;                    // sgd
  double weight_decay = 0.0;
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;                // used when warmup_steps == 0
  std::string scheduler = "cosine";         // constant | linear | cosine
  double max_grad_norm = 1.0;               // <= 0 disables clipping
  bool shuffle = true;
  int64_t seed = 42;
  int64_t eval_every = 0;                   // steps; 0 = at the end of every epoch
  int64_t checkpoint_every = 500;           // steps; 0 = no periodic checkpoints
  int save_total_limit = 1;                 // checkpoints kept; <= 0 keeps all
  int threads_per_worker = 0;               // 0 = cores / workers
  int64_t logging_steps = 10;
  bool overwrite = false;
  std::string timeline;                     // a Chrome trace of every rank to this file; "" = none

  // Image models.
  std::vector<int64_t> hidden_sizes = {256, 128};
  bool sync_batchnorm = false;              // resnet18: batch statistics across all workers
  bool augment = false;                     // resnet18: random crop (padding 4) + horizontal flip
  std::string resnet_stem = "imagenet";     // imagenet (7x7/2 conv + max-pool) | pooled (3x3/1 + max-pool) | small (3x3/1)

  // Two-tower recommender.
  int64_t embedding_dim = 32;               // id and feature embeddings; also the tower output size
  double temperature = 0.05;                // in-batch softmax temperature
  int64_t top_k = 10;                       // eval_recall_at_k / eval_ndcg_at_k

  // LLM keys of AutoTrain's LLMTrainingParams (lora_r, lora_alpha, lora_dropout, peft,
  // target_modules, model_max_length, block_size, merge_adapter, trainer, quantization, ...),
  // accepted for task llm-sft only. The value is the YAML scalar text, already checked to be
  // of the key's type (numbers normalised for std::stoll/std::stod, booleans as "true" or
  // "false", a target_modules list joined with ","); llm-sft configs hold every key, defaults
  // included. params.chat_template / params.text_column go to data.chat_template /
  // data.column_mapping["text_column"] instead.
  std::map<std::string, std::string> extra;
};

struct RunConfig {
  std::string source;                       // the YAML file it came from ("" for flags)
  std::string task = "image-classification";  // llm-sft | image-classification | two-tower
  std::string backend = "local";
  std::string model = "mlp";                // image tasks: mlp | resnet18
  std::string base_model;                   // llm tasks
  std::string project_name;
  std::string log = "jsonl";                // none | jsonl | tensorboard
  DataConfig data;
  Params params;
};

// Field-by-field equality; RunConfig's `source` (where it came from) is not compared.
bool operator==(const DataConfig& a, const DataConfig& b);
bool operator==(const Params& a, const Params& b);
bool operator==(const RunConfig& a, const RunConfig& b);
inline bool operator!=(const RunConfig& a, const RunConfig& b) { return !(a == b); }

// The defaults of one task (the struct initializers hold the image task's): llm-sft takes
// AutoTrain's LLMTrainingParams defaults. replica::Error listing the tasks for an unknown one.
RunConfig default_config(const std::string& task);

// The value checks parse_config applies (enumerations, ranges, required keys, existing
// paths), for a RunConfig built another way (e.g. from command-line flags).
void validate_config(const RunConfig& config);

// Sets one `params:` key from text, as a command-line flag gives it (`key` may be spelled
// with hyphens), by the same rules as the YAML twin: types, aliases (deepspeed, auto, null),
// "did you mean" for unknown keys, LLM keys for llm-sft only. replica::Error on a bad key or
// value; call validate_config afterwards for ranges and required keys.
void set_param(RunConfig& config, const std::string& key, const std::string& value);

// Parses and validates a YAML file; fills task-dependent defaults; checks that data.path
// exists. Errors name "FILE:LINE: key 'params.lrr' ...".
RunConfig load_config(const std::string& path);

// Same, from YAML text (`source_name` is used in messages).
RunConfig parse_config(const std::string& yaml_text, const std::string& source_name);

// The resolved configuration as YAML, every default written out, the token left out.
std::string to_yaml(const RunConfig& config);

// Closest candidate by edit distance when it is close enough to be a likely typo, else "".
std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates);

}  // namespace replica::io
