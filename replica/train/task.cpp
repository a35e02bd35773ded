// The task table (task.h).
#include "replica/train/task.h"

#include "replica/core/error.h"

namespace replica::train {

const std::vector<TaskSpec>& task_specs() {
  // In EnumNames<Task> order, so that task_spec() is an index.
  static const std::vector<TaskSpec> tasks = {llm_sft_task(), image_classification_task(), two_tower_task()};
  return tasks;
}

const TaskSpec& task_spec(Task task) {
  const auto& tasks = task_specs();
  const auto i = static_cast<size_t>(task);
  if (i >= tasks.size() || tasks[i].task != task) fail("task {} is not registered", static_cast<int>(task));
  return tasks[i];
}

}  // namespace replica::train
