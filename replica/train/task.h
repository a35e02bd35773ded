// The task registry: each task (llm-sft, image-classification, two-tower) registers, beside
// its workload, its name, its own `params:` keys (a struct train/ holds as TaskParams), its
// defaults, the checks that need no worker, and the factory of its workload. The trainer, the config reader and the command line know tasks only
// through this table, so a new task is one folder under replica/tasks/ and one line in
// replica/tasks/registry.cpp (the llm trainers dpo, orpo and reward: tasks/llm_preference/).
#pragma once

#include "replica/train/keys.h"
#include "replica/train/run_config.h"

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace replica::train {

class Workload;
struct WorkloadContext;

// A `params:` key of a task that is stored in `data:` (AutoTrain's flat LLMTrainingParams carry
// chat_template and text_column; replica keeps them where the data's other keys are): chat_template
// is data.chat_template, any other twin data.column_mapping.<name>.
struct ParamsTwin {
  std::string name;
  std::string help;   // --help's text, without the default
  std::string unset;  // what --help shows as the default when the task's defaults leave it unset
};

// Another name `task:` may give (AutoTrain's llm-dpo): this task, with these params: keys set
// before the file's own are read (which still win over them, as in AutoTrain).
struct TaskAlias {
  std::string name;
  std::vector<std::pair<std::string, std::string>> keys;
};

struct TaskSpec {
  std::string name;                        // `task:` in YAML: llm-sft, image-classification, ...
  std::string summary;                     // one line for --help
  TaskParams params;                       // the task's own keys' struct, at its defaults
  std::vector<KeySpec> keys;               // the params: keys only this task has (fields of `params`)
  std::vector<std::string> models;         // allowed `model:` values; empty: the task takes base_model
  std::vector<std::string> columns;        // the data.column_mapping keys it reads
  std::vector<ParamsTwin> twins;           // its params: keys stored in data:
  std::vector<TaskAlias> aliases;
  void (*defaults)(RunConfig&) = nullptr;  // the task's defaults over the common ones
  // Lines for the run's start where the config left a key at a default of replica's that differs
  // from AutoTrain's and changes the result (loc.given("params.block_size"): the key was written).
  std::vector<std::string> (*default_notes)(const RunConfig&, const KeyLocation& loc) = nullptr;
  // What can be refused before any worker starts (files, unsupported features);
  // replica::Error naming the key.
  void (*check)(const RunConfig&) = nullptr;
  std::unique_ptr<Workload> (*make)(const RunConfig&, const WorkloadContext&) = nullptr;
};

// Every task, in the order --help lists them. Defined above train/, by the task registry
// (replica/tasks/registry.cpp): train/ knows tasks only through this table.
const std::vector<TaskSpec>& task_specs();
// The task registered as `name`; replica::Error listing the tasks for another name.
const TaskSpec& task_spec(const std::string& name);
// The task of a config that names none (`task:` left out): the registry's choice.
const std::string& default_task();
// "llm-sft, image-classification, two-tower", for messages.
std::string task_names();

// The keys every task has (run control, engine, training loop), in the order config.yaml
// writes them; run_config.cpp.
const std::vector<KeySpec>& common_keys();

}  // namespace replica::train
