// The task registry: every task of replica, one line each (train/task.h declares the table;
// the trainer, the config reader and the command line find tasks only through it).
#include "replica/tasks/image_classification/image_classification.h"
#include "replica/tasks/llm_preference/preference_workload.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/tasks/two_tower/two_tower.h"
#include "replica/train/task.h"

namespace replica::train {

namespace {

// Task llm-sft is AutoTrain's `llm` task: params.trainer picks the workload (sft, or an
// alignment trainer over preference data).
TaskSpec llm_task() {
  TaskSpec t = llm_sft_task();
  t.make = [](const RunConfig& c, const WorkloadContext& context) {
    return llm_params(c).trainer == "sft" ? make_llm_sft(c, context) : tasks::make_preference_workload(c, context);
  };
  t.check = [](const RunConfig& c) {
    check_llm_sft_config(c);
    tasks::check_preference_config(c);
  };
  return t;
}

}  // namespace

const std::vector<TaskSpec>& task_specs() {
  static const std::vector<TaskSpec> tasks = {llm_task(), image_classification_task(), two_tower_task()};
  return tasks;
}

const std::string& default_task() {
  // A config without `task:` is the image classifier, as the first replica configs were.
  static const std::string name = "image-classification";
  return name;
}

}  // namespace replica::train
