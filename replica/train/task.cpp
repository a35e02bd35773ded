// Looking a task up in the registry (task.h; the table itself is replica/tasks/registry.cpp).
#include "replica/train/task.h"

#include "replica/core/error.h"

namespace replica::train {

const TaskSpec& task_spec(Task task) {
  const auto& tasks = task_specs();
  const auto i = static_cast<size_t>(task);
  if (i >= tasks.size() || tasks[i].task != task) fail("task {} is not registered", static_cast<int>(task));
  return tasks[i];
}

}  // namespace replica::train
