#include "replica/train/project_dir.h"

#include "replica/core/error.h"
#include "replica/core/files.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <optional>
#include <string_view>
#include <system_error>

namespace replica::train {
namespace fs = std::filesystem;

namespace {

// A step or a PID: 1 to 18 decimal digits (so that it fits an int64_t), nothing else.
std::optional<int64_t> number_of(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t n = 0;
  for (unsigned char c : s) {
    if (!std::isdigit(c)) return std::nullopt;
    n = n * 10 + (c - '0');
  }
  return n;
}

// The names written whole: files and directories.
constexpr std::array<std::string_view, 6> kFiles = {"config.yaml", "training_params.json", "metrics.jsonl",
                                                    "metrics.png", "metrics.svg", kRootOutputsList};
constexpr std::array<std::string_view, 3> kDirectories = {"final", "merged", "errors"};

bool is_fixed_file_name(std::string_view name) {
  return std::find(kFiles.begin(), kFiles.end(), name) != kFiles.end() || starts_with(name, "events.out.tfevents.");
}

// The staging names of checkpoint.cpp: ".checkpoint-STEP.tmp-PID" / ".checkpoint-STEP.old-PID".
struct Staging {
  int64_t step = -1;
  int64_t pid = -1;
  bool old = false;  // .old-PID: a complete checkpoint moved aside
};
std::optional<Staging> checkpoint_staging(std::string_view name) {
  if (!starts_with(name, ".checkpoint-")) return std::nullopt;
  name.remove_prefix(12);
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  const auto step = number_of(name.substr(0, dot));
  const std::string_view rest = name.substr(dot + 1);
  const bool tmp = starts_with(rest, "tmp-"), old = starts_with(rest, "old-");
  const auto pid = tmp || old ? number_of(rest.substr(4)) : std::nullopt;
  if (!step || !pid) return std::nullopt;
  return Staging{*step, *pid, old};
}

// ".zero-STEP": ZeRO-3 shards being gathered (run_state.cpp).
bool is_zero_staging(std::string_view name) { return starts_with(name, ".zero-") && number_of(name.substr(6)); }

// "NAME.tmp.PID" of write_file_atomically over one of the files above; the PID.
std::optional<int64_t> atomic_write_pid(std::string_view name) {
  const size_t tmp = name.rfind(".tmp.");
  if (tmp == std::string_view::npos || !is_fixed_file_name(name.substr(0, tmp))) return std::nullopt;
  return number_of(name.substr(tmp + 5));
}

enum class Kind { Output, Lookalike, Other };

// A name a run may list in .replica-outputs: one plain file name, not one of the fixed ones.
bool is_listable_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name.size() <= 255 && !is_fixed_file_name(name);
}

// What `entry` is, by its name and its own type (a symbolic link is never followed); `listed`:
// root_outputs of its directory.
Kind classify(const fs::path& entry, const std::vector<std::string>& listed) {
  const std::string name = entry.filename().string();
  const bool named_dir = std::find(kDirectories.begin(), kDirectories.end(), name) != kDirectories.end() ||
                         checkpoint_step(name) >= 0 || checkpoint_staging(name) || is_zero_staging(name);
  bool named_file = is_fixed_file_name(name) || atomic_write_pid(name).has_value();
  if (!named_dir && !named_file && is_listable_name(name)) {
    named_file = std::find(listed.begin(), listed.end(), name) != listed.end();
  }
  if (!named_dir && !named_file) return Kind::Other;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(entry, ec);
  if (ec) return Kind::Lookalike;  // vanished or unreadable: not ours to touch
  if (named_file) return fs::is_regular_file(st) ? Kind::Output : Kind::Lookalike;
  if (!fs::is_directory(st)) return Kind::Lookalike;
  if (checkpoint_step(name) >= 0 && !is_replica_checkpoint(entry)) return Kind::Lookalike;
  return Kind::Output;
}

std::vector<fs::path> entries_of_kind(const fs::path& project, Kind kind) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(project, ec)) return out;
  const std::vector<std::string> listed = root_outputs(project);  // read once for the whole listing
  for (const auto& entry : fs::directory_iterator(project, ec)) {
    if (classify(entry.path(), listed) == kind) out.push_back(entry.path());
  }
  if (ec) fail("cannot list the project directory '{}': {}", project.string(), ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

// Whether process `pid` may still be writing: alive on this host and not this process (a
// file named with this process's PID is an earlier life's: this one has not saved yet).
bool may_be_writing(int64_t pid) {
  if (pid <= 0 || pid > 0x3fffffff || pid == static_cast<int64_t>(::getpid())) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// A real directory holding the files a save writes last: trainer_state.json, then the
// checksum manifest (either, so that a checkpoint missing one is still skipped by name).
bool holds_completion_marker(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(dir, ec))) return false;
  for (const char* marker : {"trainer_state.json", "checksums.sha256"}) {
    if (fs::is_regular_file(fs::symlink_status(dir / marker, ec))) return true;
  }
  return false;
}

}  // namespace

int64_t checkpoint_step(const std::string& name) {
  if (!starts_with(name, "checkpoint-")) return -1;
  return number_of(std::string_view(name).substr(11)).value_or(-1);
}

bool is_replica_checkpoint(const fs::path& dir) {
  return checkpoint_step(dir.filename().string()) >= 0 && holds_completion_marker(dir);
}

bool is_run_output(const fs::path& entry) {
  return classify(entry, root_outputs(entry.parent_path())) == Kind::Output;
}

std::vector<std::string> root_outputs(const fs::path& project) {
  const fs::path list = project / kRootOutputsList;
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(list, ec))) return {};
  // A few names; a list larger than this was not written by a run.
  constexpr uintmax_t kMaxBytes = 1 << 20;
  if (fs::file_size(list, ec) > kMaxBytes || ec) return {};
  std::vector<std::string> names;
  std::string text = read_file(list.string(), kMaxBytes);
  for (size_t from = 0; from < text.size();) {
    const size_t end = std::min(text.find('\n', from), text.size());
    std::string name = text.substr(from, end - from);
    if (is_listable_name(name)) names.push_back(std::move(name));
    from = end + 1;
  }
  return names;
}

bool place_in_project(const fs::path& project, const fs::path& source, const std::string& name) {
  if (!is_listable_name(name)) fail("internal error: '{}' cannot be placed in a project directory", name);
  const fs::path target = project / name;
  std::vector<std::string> listed = root_outputs(project);
  const bool ours = std::find(listed.begin(), listed.end(), name) != listed.end();
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(target, ec);
  if (fs::exists(st) && !(ours && fs::is_regular_file(st))) return false;  // the user's: left alone
  if (!ours) {
    // Recorded before the file appears: a run killed in between leaves a name that lists nothing.
    listed.push_back(name);
    std::string text;
    for (const auto& n : listed) text += n + "\n";
    write_file_atomically((project / kRootOutputsList).string(), text);
  }
  const fs::path staging = project / (name + ".tmp." + std::to_string(::getpid()));
  fs::remove(staging, ec);
  fs::create_hard_link(source, staging, ec);
  if (ec) {
    ec.clear();
    fs::copy_file(source, staging, fs::copy_options::overwrite_existing, ec);
    if (ec) fail("cannot write '{}' into '{}': {}", name, project.string(), ec.message());
  }
  fs::rename(staging, target, ec);
  if (ec) fail("cannot write '{}': {}", target.string(), ec.message());
  return true;
}

std::vector<fs::path> run_outputs(const fs::path& project) { return entries_of_kind(project, Kind::Output); }

std::vector<Lookalike> lookalikes(const fs::path& project) {
  std::vector<Lookalike> out;
  for (auto& path : entries_of_kind(project, Kind::Lookalike)) {
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(path, ec);
    std::string why = fs::is_symlink(st)  ? "a symbolic link"
                      : fs::is_directory(st) && checkpoint_step(path.filename().string()) >= 0
                          ? "no trainer_state.json or checksums.sha256 in it"
                      : fs::is_directory(st) ? "a directory where replica writes a file"
                                             : "not a directory, where replica writes one";
    out.push_back({std::move(path), std::move(why)});
  }
  return out;
}

size_t remove_run_outputs(const fs::path& project) {
  const auto outputs = run_outputs(project);
  for (const auto& path : outputs) {
    // remove_all does not follow symbolic links inside a directory: it removes the links.
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) fail("--overwrite: cannot remove '{}': {}", path.string(), ec.message());
  }
  return outputs.size();
}

std::vector<std::string> clean_stale_staging(const fs::path& project) {
  std::vector<std::string> done;
  for (const auto& path : run_outputs(project)) {
    const std::string name = path.filename().string();
    std::error_code ec;
    if (const auto staging = checkpoint_staging(name)) {
      if (may_be_writing(staging->pid)) continue;
      const fs::path target = project / fmt::format("checkpoint-{}", staging->step);
      if (staging->old && !is_replica_checkpoint(target)) {
        // A save killed between moving the complete checkpoint-N aside and renaming its
        // replacement into place: this is that step's only copy, and it goes back. When
        // something else holds the name now, it is left for the user to see.
        if (fs::exists(fs::symlink_status(target, ec))) continue;
        if (holds_completion_marker(path)) {
          fs::rename(path, target, ec);
          if (ec) fail("cannot restore '{}' as '{}': {}", path.string(), target.string(), ec.message());
          done.push_back(fmt::format("{} restored as {}", name, target.filename().string()));
          continue;
        }
      }
    } else if (const auto pid = atomic_write_pid(name)) {
      if (may_be_writing(*pid)) continue;
    } else if (!is_zero_staging(name)) {
      continue;  // an output proper, not staging
    }
    fs::remove_all(path, ec);
    if (ec) fail("cannot remove '{}', left by a killed save: {}", path.string(), ec.message());
    done.push_back(name + " removed");
  }
  return done;
}

}  // namespace replica::train
