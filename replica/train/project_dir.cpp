#include "replica/train/project_dir.h"

#include "replica/core/error.h"
#include "replica/core/files.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string_view>
#include <system_error>

namespace replica::train {
namespace fs = std::filesystem;

namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

// Names written whole (files and directories).
constexpr std::array<std::string_view, 8> kFixed = {"config.yaml", "training_params.json", "metrics.jsonl",
                                                    "metrics.png", "metrics.svg", "final", "merged", "errors"};

bool is_written_name(std::string_view name) {
  if (std::find(kFixed.begin(), kFixed.end(), name) != kFixed.end()) return true;
  if (starts_with(name, "events.out.tfevents.")) return true;
  if (starts_with(name, "checkpoint-") && all_digits(name.substr(11))) return true;
  return false;
}

}  // namespace

bool is_run_output(const std::string& name) {
  if (is_written_name(name)) return true;
  // Staging names of the atomic writes: .checkpoint-STEP.tmp-PID / .old-PID (checkpoint.cpp),
  // .zero-STEP (the ZeRO-3 shards being gathered), NAME.tmp.PID (write_file_atomically).
  if (starts_with(name, ".checkpoint-") || starts_with(name, ".zero-")) return true;
  const size_t tmp = name.rfind(".tmp.");
  return tmp != std::string::npos && all_digits(std::string_view(name).substr(tmp + 5)) &&
         is_written_name(std::string_view(name).substr(0, tmp));
}

std::vector<fs::path> run_outputs(const fs::path& project) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(project, ec)) return out;
  for (const auto& entry : fs::directory_iterator(project, ec)) {
    if (is_run_output(entry.path().filename().string())) out.push_back(entry.path());
  }
  if (ec) fail("cannot list the project directory '{}': {}", project.string(), ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

size_t remove_run_outputs(const fs::path& project) {
  const auto outputs = run_outputs(project);
  for (const auto& path : outputs) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) fail("--overwrite: cannot remove '{}': {}", path.string(), ec.message());
  }
  return outputs.size();
}

}  // namespace replica::train
