// The model card a run leaves, as AutoTrain leaves one: README.md in project_name/final and in
// project_name itself (placed there only where no file of the user's has that name,
// project_dir.h). Hugging Face's card layout: YAML front matter (library_name, base_model, tags),
// then what was trained on what, every key that differs from the task's defaults, the final
// losses of metrics.jsonl, and the task's note on loading final/.
#pragma once

#include "replica/train/run_config.h"
#include "replica/train/workload.h"

#include <string>

namespace replica::train {

// The card's text for a finished run whose metrics.jsonl is in project_name.
std::string model_card(const RunConfig& config, const ModelCardInfo& task_part);

// Writes project_name/final/README.md and places it as project_name/README.md. Returns the
// card's path in project_name, or "" when a README.md of the user's is there (left alone).
std::string write_model_card(const RunConfig& config, const ModelCardInfo& task_part);

}  // namespace replica::train
