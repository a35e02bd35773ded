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

#include <any>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace replica::train {

// ---- Enumerations, parsed once. EnumNames<E>::names is each value's YAML spelling, in the
// order of the enumerators.
template <class E>
struct EnumNames;

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

// When the run evaluates (HF TrainingArguments' eval_strategy): at the end of each epoch (or
// every eval_every steps when that is set), every eval_every steps (logging_steps when 0), never.
enum class EvalStrategy { Epoch, Steps, No };
template <>
struct EnumNames<EvalStrategy> {
  static constexpr std::array<const char*, 3> names = {"epoch", "steps", "no"};
};

// When the run writes a checkpoint (save_strategy): every checkpoint_every (save_steps) steps,
// at the end of each epoch, never; each also at the end of training, but for `no`.
enum class SaveStrategy { Steps, Epoch, No };
template <>
struct EnumNames<SaveStrategy> {
  static constexpr std::array<const char*, 3> names = {"steps", "epoch", "no"};
};

enum class LogFormat { None, Jsonl, TensorBoard };
template <>
struct EnumNames<LogFormat> {
  static constexpr std::array<const char*, 3> names = {"none", "jsonl", "tensorboard"};
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
  EvalStrategy eval_strategy = EvalStrategy::Epoch;
  int64_t checkpoint_every = 500;           // steps (save_steps); 0 = no periodic checkpoints
  SaveStrategy save_strategy = SaveStrategy::Steps;
  // "" (auto): resume from the project's latest checkpoint when it has one; "false": a fresh
  // start only; a checkpoint-STEP directory of the project: resume from it.
  std::string resume_from_checkpoint;
  bool auto_find_batch_size = false;        // AutoTrain's; only false
  // The Hugging Face Hub (AutoTrain's hub: section): replica does not upload.
  bool push_to_hub = false;                 // only false
  std::string username;
  int save_total_limit = 1;                 // checkpoints kept; <= 0 keeps all
  int threads_per_worker = 0;               // 0 = cores / workers
  int64_t logging_steps = 10;
  bool overwrite = false;
  std::string timeline;                     // a Chrome trace of every rank to this file; "" = none
};

// The task's own `params:` keys: a struct each task defines in its folder (replica/tasks/<task>/)
// and registers with its TaskSpec (train/task.h). train/ holds it without knowing its type; the
// task's code and its key table reach it by type (get<LlmParams>()).
class TaskParams {
 public:
  TaskParams() = default;
  template <class P>
  explicit TaskParams(P params) : value_(std::move(params)) {}
  template <class P>
  P& get() {
    P* p = std::any_cast<P>(&value_);
    if (p == nullptr) wrong_type(typeid(P));
    return *p;
  }
  template <class P>
  const P& get() const {
    const P* p = std::any_cast<P>(&value_);
    if (p == nullptr) wrong_type(typeid(P));
    return *p;
  }
  template <class P>
  bool holds() const {
    return std::any_cast<P>(&value_) != nullptr;
  }

 private:
  [[noreturn]] void wrong_type(const std::type_info& wanted) const;
  std::any value_;
};

struct RunConfig {
  std::string source;                       // the YAML file it came from ("" for flags)
  std::string task;                         // a registered task's name (task.h); default_config sets it
  std::string backend = "local";
  std::string model;                        // one of the task's models (TaskSpec::models), when it has some
  std::string base_model;                   // tasks without `model:` choices (llm-sft)
  std::string project_name;
  LogFormat log = LogFormat::Jsonl;
  DataConfig data;
  RunParams params;
  TaskParams task_params;                   // the task's own keys (its TaskSpec's struct)
  // What the run's first lines say about the config as read (not a key; not compared, not
  // written): keys given that do nothing in this run, defaults that differ from AutoTrain's.
  std::vector<std::string> notes;
};

// Every key compared (through the key tables); `source` (where it came from) is not.
bool operator==(const RunConfig& a, const RunConfig& b);
inline bool operator!=(const RunConfig& a, const RunConfig& b) { return !(a == b); }

// The defaults of a task (its table's defaults over the common ones: llm-sft takes AutoTrain's
// LLMTrainingParams defaults). replica::Error listing the tasks for an unknown name.
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
bool is_flag(const std::string& task, const std::string& name);

// The notes of a config built by set_flag (`replica llm`): `flags` are the flags given, as
// typed; RunConfig::notes is filled as load_config fills it for a file.
void note_flags(RunConfig& config, const std::vector<std::string>& flags);

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
std::string keys_help(const std::string& task);

// Whether `name` (underscores) is a params: key of the task (or a params twin), and whether
// it is a switch (true/false: a bare flag means true).
bool is_param_key(const std::string& task, const std::string& name);
bool is_switch_key(const std::string& task, const std::string& name);

// "unknown flag --lerning-rate (did you mean --lr?)": the flag as typed and the nearest of
// the task's keys or `other_flags` (underscores), also by the names other tools give a key
// (learning_rate, num_train_epochs); "flag --lora-r applies only to task llm-sft" for
// another task's key.
std::string unknown_flag_message(const std::string& task, const std::string& typed, const std::vector<std::string>& other_flags);

}  // namespace replica::train
