// What a run writes into its project directory (PRODUCT.md, "What a run leaves in
// project_name/"), in one place. Rotation, resume discovery and `--overwrite` act only on
// what is recognised here, so a user's own files beside the outputs stay, and a directory
// holding outputs but no checkpoint to resume from is refused rather than silently reused
// (starting over would replace its metrics.jsonl and config.yaml).
//
// An entry is replica's by its name AND its type, both read without following symbolic
// links: a symbolic link is never replica's (a `checkpoint-999 -> elsewhere` must neither be
// taken for the newest checkpoint, with every real one rotated away, nor have its target
// touched), and a checkpoint-N directory is replica's only when it holds the completion
// marker a save writes last (trainer_state.json, then checksums.sha256).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace replica::train {

// N of a name "checkpoint-N" (1 to 18 decimal digits), else -1.
int64_t checkpoint_step(const std::string& name);

// A real directory (not a symbolic link) named checkpoint-N (N decimal digits) holding
// trainer_state.json or checksums.sha256 as regular files. Corrupt contents are the loader's
// business (checkpoint.h): such a directory is still replica's, to skip with a warning or rotate.
bool is_replica_checkpoint(const std::filesystem::path& dir);

// Whether `entry`, directly inside a project directory, is one a run writes: the files
// config.yaml, training_params.json, metrics.jsonl, metrics.png/svg (replica plot),
// events.out.tfevents.*, .replica-outputs and the files it lists; the directories checkpoint-N (is_replica_checkpoint), final/,
// merged/, errors/; and the staging names of their atomic writes (the directories
// .checkpoint-N.tmp-PID / .checkpoint-N.old-PID / .zero-N, the files NAME.tmp.PID).
bool is_run_output(const std::filesystem::path& entry);

// Files a run writes directly into project_name beside the fixed names above (the model card
// README.md, a merged model's files where AutoTrain writes them) are listed, one name a line, in
// project_name/.replica-outputs: is_run_output knows them (and --overwrite removes them) by it.
constexpr const char* kRootOutputsList = ".replica-outputs";
std::vector<std::string> root_outputs(const std::filesystem::path& project);
// Puts `source`, a file the run wrote, into project as `name` (a hard link, else a copy; atomic),
// listing it. False, and nothing done, when project holds a `name` replica did not write (a
// user's README.md stays).
bool place_in_project(const std::filesystem::path& project, const std::filesystem::path& source,
                      const std::string& name);

// The entries of `project` that a run wrote, sorted by name (empty when it does not exist).
std::vector<std::filesystem::path> run_outputs(const std::filesystem::path& project);

// Entries named like run outputs that are not (a symbolic link, a checkpoint-N without the
// marker, a file where a directory belongs): left alone by everything here; named in a
// warning when a run starts.
// `why`: "a symbolic link", "no trainer_state.json or checksums.sha256 in it", ...
struct Lookalike {
  std::filesystem::path path;
  std::string why;
};
std::vector<Lookalike> lookalikes(const std::filesystem::path& project);

// Removes run_outputs(project); every other entry stays (and no symbolic link is followed).
// The number of entries removed.
size_t remove_run_outputs(const std::filesystem::path& project);

// What a killed save left behind, dealt with when a run starts in `project` (before it saves
// anything). The staging names that carry a PID are dealt with only when that process is not
// alive on this host (or is this very process, from an earlier life under the same PID): a
// save still going on in another process is left to finish. .checkpoint-N.tmp-PID is
// removed; .checkpoint-N.old-PID (a complete checkpoint moved aside while a save of the same
// step replaced it) is renamed back to checkpoint-N when that is missing, else removed;
// NAME.tmp.PID files are removed. .zero-N (ZeRO-3 shards being gathered; written by every
// rank, so it carries no PID) is removed because the starting run owns its project: its
// workers are all waiting on rank 0 while this runs, and two runs sharing one project_name
// at once would overwrite each other's checkpoints and metrics anyway. Returns the entries
// removed or restored, for a log line.
std::vector<std::string> clean_stale_staging(const std::filesystem::path& project);

}  // namespace replica::train
