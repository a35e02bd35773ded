// The run configuration: the AutoTrain-style YAML of docs/configuration.md, validated and
// resolved into typed fields.
//
// Every `params:` key is registered once, in a key table (train/keys.h): the run-control and
// training-loop keys every task has (run_config.cpp), and each task's own keys beside its
// workload (replica/tasks/<task>/; the registry is replica/tasks/registry.cpp, declared in
// train/task.h). From those tables come the YAML reader with FILE:LINE errors and "did you
// mean", config.yaml and training_params.json with real types, the flags of `replica llm`
// and `replica --config`, `--help`, validation of a config built in code, and equality. The
// structs below are the storage: a field's type and default are written here, its name,
// checks and help in its table.
//
// Validation happens entirely before any worker starts: an unknown key, a wrong type or a bad
// value is a replica::Error naming the file, line and key.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace replica::train {

// ---- Enumerations, parsed once. EnumNames<E>::names is each value's YAML spelling, in the
// order of the enumerators.
template <class E>
struct EnumNames;

enum class Task { LlmSft, ImageClassification, TwoTower };
template <>
struct EnumNames<Task> {
  static constexpr std::array<const char*, 3> names = {"llm-sft", "image-classification", "two-tower"};
};

enum class DistributedBackend { Ddp, Zero3 };
template <>
struct EnumNames<DistributedBackend> {
  static constexpr std::array<const char*, 2> names = {"ddp", "zero3"};
};

// Where offloaded optimizer state or parameters live (DeepSpeed's offload_*.device).
enum class OffloadDevice { None, Cpu, Nvme };
template <>
struct EnumNames<OffloadDevice> {
  static constexpr std::array<const char*, 3> names = {"none", "cpu", "nvme"};
};

enum class DeviceKind { Auto, Cpu, Cuda };
template <>
struct EnumNames<DeviceKind> {
  static constexpr std::array<const char*, 3> names = {"auto", "cpu", "cuda"};
};

enum class Precision { Fp32, Bf16, Fp16 };
template <>
struct EnumNames<Precision> {
  static constexpr std::array<const char*, 3> names = {"fp32", "bf16", "fp16"};
};

// AdamW8bit and PagedAdamW8bit: replica/train/optim_8bit.h; Adafactor: replica/train/adafactor.h.
enum class OptimizerKind { Sgd, AdamW, AdamW8bit, PagedAdamW8bit, Adafactor };
template <>
struct EnumNames<OptimizerKind> {
  static constexpr std::array<const char*, 5> names = {"sgd", "adamw", "adamw_bnb_8bit", "paged_adamw_8bit",
                                                       "adafactor"};
};

// Hugging Face's get_scheduler names (replica/train/schedule.h): constant has no warm-up there.
enum class SchedulerKind { Constant, Linear, Cosine, CosineWithRestarts, Polynomial, ConstantWithWarmup };
template <>
struct EnumNames<SchedulerKind> {
  static constexpr std::array<const char*, 6> names = {"constant",   "linear",    "cosine", "cosine_with_restarts",
                                                       "polynomial", "constant_with_warmup"};
};

// What a step whose training loss is NaN or Inf on some worker does (fp16's loss scaler
// handles its overflows itself, whatever this says).
enum class NonfiniteLoss { Stop, Skip };
template <>
struct EnumNames<NonfiniteLoss> {
  static constexpr std::array<const char*, 2> names = {"stop", "skip"};
};

enum class LogFormat { None, Jsonl, TensorBoard };
template <>
struct EnumNames<LogFormat> {
  static constexpr std::array<const char*, 3> names = {"none", "jsonl", "tensorboard"};
};

enum class ResnetStem { ImageNet, Pooled, Small };
template <>
struct EnumNames<ResnetStem> {
  static constexpr std::array<const char*, 3> names = {"imagenet", "pooled", "small"};
};

template <class E>
const char* name_of(E value) {
  return EnumNames<E>::names[static_cast<size_t>(value)];
}

template <class E>
std::optional<E> enum_from(const std::string& name) {
  for (size_t i = 0; i < EnumNames<E>::names.size(); ++i) {
    if (name == EnumNames<E>::names[i]) return static_cast<E>(i);
  }
  return std::nullopt;
}

// ---- The sections of a run.

struct DataConfig {
  std::string path;                         // image tasks default: /usr/share/datasets/fashion-mnist
  std::string train_split = "train";
  std::optional<std::string> valid_split;   // image tasks default: "t10k"; YAML null turns eval off
  std::string chat_template = "tokenizer";  // tokenizer | chatml | llama3 | none
  std::map<std::string, std::string> column_mapping;  // text_column: text, ...
};

// Keys of every task: run control, the engine, the training loop (table: run_config.cpp).
struct RunParams {
  DistributedBackend distributed_backend = DistributedBackend::Ddp;
  DeviceKind device = DeviceKind::Auto;     // auto: a GPU when one is visible, else the CPU
  std::string ddp_backend = "auto";         // auto | nccl | gloo (Note [worker device], engine.cpp)
  int nproc_per_node = 0;                   // 0 = auto (usable cores on CPU)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                      // 0 = pick a free port (single node)
  double rdzv_timeout = 300;                // seconds
  double collective_timeout = 600;          // seconds
  int max_restarts = 0;
  bool deterministic = false;
  std::string token;                        // never written back out
  // ZeRO-3: DeepSpeed's zero_optimization names and defaults.
  double stage3_prefetch_bucket_size = 5e7;
  double stage3_param_persistence_threshold = 1e5;
  double stage3_max_live_parameters = 1e9;
  double stage3_max_reuse_distance = 1e9;
  double reduce_bucket_size = 5e8;
  bool overlap_comm = true;
  // DDP's sharded optimizer step; nullopt = auto (decided from where the workers run).
  std::optional<bool> shard_optimizer;
  // DeepSpeed's memory knobs by their names (Note [ZeRO stages] in engine.cpp). zero_stage -1:
  // from distributed_backend (zero_stage_of).
  int zero_stage = -1;
  OffloadDevice offload_optimizer_device = OffloadDevice::None;
  OffloadDevice offload_param_device = OffloadDevice::None;
  std::string nvme_path;                    // the directory of nvme-offloaded state
  std::string deepspeed;                    // a DeepSpeed JSON config, read into these keys
  // The DeepSpeed config's train_batch_size when it gave a number: checked against
  // batch_size x gradient_accumulation x workers when the world is known (not a key).
  int64_t deepspeed_train_batch_size = 0;

  int epochs = 1;
  int64_t max_steps = -1;                   // > 0 wins over epochs
  int batch_size = 64;                      // per worker, per micro-step
  int gradient_accumulation = 1;
  Precision mixed_precision = Precision::Fp32;
  OptimizerKind optimizer = OptimizerKind::AdamW;
  double lr = 1e-3;
  double momentum = 0.9;                    // sgd
  double weight_decay = 0.0;
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;                // used when warmup_steps == 0
  SchedulerKind scheduler = SchedulerKind::Cosine;
  double max_grad_norm = 1.0;               // <= 0 disables clipping
  NonfiniteLoss nonfinite_loss = NonfiniteLoss::Stop;
  bool shuffle = true;
  int64_t seed = 42;
  int64_t eval_every = 0;                   // steps; 0 = at the end of every epoch
  int64_t checkpoint_every = 500;           // steps; 0 = no periodic checkpoints
  int save_total_limit = 1;                 // checkpoints kept; <= 0 keeps all
  int threads_per_worker = 0;               // 0 = cores / workers
  int64_t logging_steps = 10;
  bool overwrite = false;
  std::string timeline;                     // a Chrome trace of every rank to this file; "" = none
};

// Task image-classification (table: image_classification.cpp).
struct ImageParams {
  std::vector<int64_t> hidden_sizes = {256, 128};  // mlp
  bool sync_batchnorm = false;                     // resnet18
  bool augment = false;                            // resnet18
  ResnetStem resnet_stem = ResnetStem::ImageNet;   // resnet18
  bool gradient_checkpointing = false;             // resnet18: recompute each stage in backward
};

// Task two-tower (table: two_tower.cpp).
struct TwoTowerParams {
  std::vector<int64_t> hidden_sizes = {64};  // tower MLP
  int64_t embedding_dim = 32;
  double temperature = 0.05;
  int64_t top_k = 10;
};

// Task llm-sft: AutoTrain's LLMTrainingParams (table: llm_sft.cpp).
struct LlmParams {
  std::string trainer = "sft";
  bool peft = false;
  int64_t lora_r = 16;
  int64_t lora_alpha = 32;
  double lora_dropout = 0.05;
  std::vector<std::string> target_modules = {"all-linear"};
  bool merge_adapter = false;
  int64_t model_max_length = 2048;
  int64_t block_size = -1;                  // -1: model_max_length
  std::string padding = "right";
  bool packing = true;                      // false: one sample per row
  bool add_eos_token = true;
  std::string quantization = "none";
  bool quantize_embeddings = false;         // also the embeddings and lm_head (with quantization)
  bool disable_gradient_checkpointing = false;
  bool use_flash_attention_2 = false;
  bool unsloth = false;
  double router_aux_loss_coef = -1;         // -1: the model's config.json decides
  // The alignment trainers (dpo, orpo, reward; replica/tasks/llm_preference), AutoTrain's names
  // and defaults.
  std::string init_adapter;                 // peft: start from this PEFT adapter; "" = fresh adapters
  std::string model_ref;                    // dpo: the reference model; "" = the frozen base
  double dpo_beta = 0.1;                    // dpo and orpo: beta
  int64_t max_prompt_length = 128;          // prompt tokens kept (its end)
  int64_t max_completion_length = -1;       // completion tokens kept (their start); -1: no limit
};

struct RunConfig {
  std::string source;                       // the YAML file it came from ("" for flags)
  Task task = Task::ImageClassification;
  std::string backend = "local";
  std::string model = "mlp";                // image tasks: mlp | resnet18; two-tower: two-tower
  std::string base_model;                   // llm-sft
  std::string project_name;
  LogFormat log = LogFormat::Jsonl;
  DataConfig data;
  RunParams params;
  ImageParams image;                        // task image-classification
  TwoTowerParams two_tower;                 // task two-tower
  LlmParams llm;                            // task llm-sft
};

// Every key compared (through the key tables); `source` (where it came from) is not.
bool operator==(const RunConfig& a, const RunConfig& b);
inline bool operator!=(const RunConfig& a, const RunConfig& b) { return !(a == b); }

// The defaults of a task (its table's defaults over the common ones: llm-sft takes AutoTrain's
// LLMTrainingParams defaults). replica::Error listing the tasks for an unknown name.
RunConfig default_config(Task task);
RunConfig default_config(const std::string& task);

// The ZeRO stage of a run (Note [ZeRO stages] in engine.cpp): zero_stage when given; else 3
// for distributed_backend zero3 (deepspeed: AutoTrain's meaning) and 0 for ddp (whose
// shard_optimizer may still shard the optimizer step, as stage 2 does).
int zero_stage_of(const RunParams& params);

// The checks parse_config applies (ranges, required keys, existing paths), for a RunConfig
// built another way (flags, code).
void validate_config(const RunConfig& config);

// Sets one `params:` key (or a params twin of a data key: chat_template, text_column) from
// text, as a flag gives it (`key` may be spelled with hyphens), by the YAML rules: types,
// aliases (deepspeed, auto, null), "did you mean" for unknown keys, a task's keys for that
// task only. replica::Error on a bad key or value; validate_config afterwards checks ranges.
void set_param(RunConfig& config, const std::string& key, const std::string& value);

// One flag of `replica llm` or of `replica --config FILE`, its name as typed (--lora-r or
// --lora_r, without the dashes): a params: key, a params twin, or one of the run's own
// (model, project_name, data_path, train_split, valid_split, log, backend, messages_column,
// prompt_column, completion_column). An unknown flag is an error naming it as typed and the
// nearest valid one; a bad value names the flag.
void set_flag(RunConfig& config, const std::string& name, const std::string& value);
bool is_flag(Task task, const std::string& name);

// Parses and validates a YAML file; fills the task's defaults; checks that paths exist.
// Errors name "FILE:LINE: key 'params.lrr' ...". With flags (`replica --config run.yaml
// --max-steps 20`): each applied over the file as set_flag does, before the checks; a check
// that fails on a flag's value names the flag.
RunConfig load_config(const std::string& path);
RunConfig load_config(const std::string& path, const std::vector<std::pair<std::string, std::string>>& flags);
RunConfig parse_config(const std::string& yaml_text, const std::string& source_name);

// The resolved configuration as YAML, every default written out, the token left out.
std::string to_yaml(const RunConfig& config);

// training_params.json: every key of the run with its real type (AutoTrain writes the same
// file), the token left out; the ZeRO-3 keys only when distributed_backend is zero3.
std::string training_params_json(const RunConfig& config);

// The `params:` keys of a task, as flags: each key's flag, value, default and help, grouped;
// `replica llm --help` and `replica keys TASK` print it.
std::string keys_help(Task task);

// Whether `name` (underscores) is a params: key of the task (or a params twin), and whether
// it is a switch (true/false: a bare flag means true).
bool is_param_key(Task task, const std::string& name);
bool is_switch_key(Task task, const std::string& name);

// "unknown flag --lerning-rate (did you mean --lr?)": the flag as typed and the nearest of
// the task's keys or `other_flags` (underscores), also by the names other tools give a key
// (learning_rate, num_train_epochs); "flag --lora-r applies only to task llm-sft" for
// another task's key.
std::string unknown_flag_message(Task task, const std::string& typed, const std::vector<std::string>& other_flags);

}  // namespace replica::train
