// The task registry: each task (llm-sft, image-classification, two-tower) registers, beside
// its workload, its own `params:` keys, its defaults, the checks that need no worker, and the
// factory of its workload. The trainer, the config reader and the command line know tasks only
// through this table, so a new task is one folder under replica/tasks/ and one line in
// replica/tasks/registry.cpp (the llm trainers dpo, orpo and reward: tasks/llm_preference/).
#pragma once

#include "replica/train/keys.h"
#include "replica/train/run_config.h"

#include <memory>
#include <string>
#include <vector>

namespace replica::train {

class Workload;
struct WorkloadContext;

struct TaskSpec {
  Task task;
  std::string summary;                     // one line for --help
  std::vector<KeySpec> keys;               // the params: keys only this task has
  std::vector<std::string> models;         // allowed `model:` values; empty: the task takes base_model
  // AutoTrain's flat LLMTrainingParams names of data keys (chat_template, text_column,
  // prompt_text_column, rejected_text_column) are params: keys of this task too.
  bool params_twins = false;
  void (*defaults)(RunConfig&) = nullptr;  // the task's defaults over the common ones
  // What can be refused before any worker starts (files, unsupported features);
  // replica::Error naming the key.
  void (*check)(const RunConfig&) = nullptr;
  std::unique_ptr<Workload> (*make)(const RunConfig&, const WorkloadContext&) = nullptr;
};

// Every task, in EnumNames<Task> order. Defined above train/, by the task registry
// (replica/tasks/registry.cpp): train/ knows tasks only through this table.
const std::vector<TaskSpec>& task_specs();
const TaskSpec& task_spec(Task task);

// The keys every task has (run control, engine, training loop), in the order config.yaml
// writes them; run_config.cpp.
const std::vector<KeySpec>& common_keys();

// The registrations, each beside its workload.
TaskSpec llm_sft_task();
TaskSpec image_classification_task();
TaskSpec two_tower_task();

}  // namespace replica::train
