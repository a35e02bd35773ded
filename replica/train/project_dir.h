// What a run writes into its project directory (PRODUCT.md, "What a run leaves in
// project_name/"), in one place. `--overwrite` removes exactly these entries and nothing else
// (a user's own notes, data or scripts beside them stay), and a directory holding any of them
// but no checkpoint to resume from is refused rather than silently reused, since starting
// over would replace its metrics.jsonl and config.yaml.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace replica::train {

// Whether `name`, an entry directly inside a project directory, is one a run writes:
// config.yaml, training_params.json, metrics.jsonl, metrics.png/svg (replica plot),
// events.out.tfevents.*, checkpoint-STEP/, final/, merged/, errors/, and the temporary
// names of their atomic writes (.checkpoint-*, .zero-*, NAME.tmp.PID).
bool is_run_output(const std::string& name);

// The entries of `project` that a run wrote, sorted by name (empty when it does not exist).
std::vector<std::filesystem::path> run_outputs(const std::filesystem::path& project);

// Removes run_outputs(project); every other entry stays. The number of entries removed.
size_t remove_run_outputs(const std::filesystem::path& project);

}  // namespace replica::train
