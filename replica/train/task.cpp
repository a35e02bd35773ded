// Looking a task up in the registry (task.h; the table itself is replica/tasks/registry.cpp).
#include "replica/train/task.h"

#include "replica/core/error.h"
#include "replica/core/text.h"

namespace replica::train {

std::string task_names() {
  std::string out;
  for (const auto& spec : task_specs()) out += (out.empty() ? "" : ", ") + spec.name;
  return out;
}

const TaskSpec& task_spec(const std::string& name) {
  for (const auto& spec : task_specs()) {
    if (spec.name == name) return spec;
  }
  fail("unknown task '{}'; use one of {}", excerpt(name), task_names());
}

void TaskParams::wrong_type(const std::type_info& wanted) const {
  // A task's code reading another task's struct: a bug, not an input.
  fail("internal error: the run's task params hold {}, not {}", value_.has_value() ? value_.type().name() : "nothing",
       wanted.name());
}

}  // namespace replica::train
