// The run's model card (model_card.h).
#include "replica/train/model_card.h"

#include "replica/core/files.h"
#include "replica/train/keys.h"
#include "replica/train/project_dir.h"
#include "replica/train/task.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace replica::train {

namespace fs = std::filesystem;

namespace {

// The last training and evaluation lines of metrics.jsonl (null when there is none).
std::pair<nlohmann::json, nlohmann::json> last_metrics(const fs::path& project) {
  nlohmann::json train, eval;
  std::ifstream in(project / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    if (j.contains("eval_loss")) {
      eval = j;
    } else if (j.contains("loss")) {
      train = j;
    }
  }
  return {train, eval};
}

std::string number(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return "";
  return fmt::format("{:.4f}", j[key].get<double>());
}

// A value in a markdown table cell.
std::string cell(std::string text) {
  for (char& c : text) {
    if (c == '|' || c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

}  // namespace

std::string model_card(const RunConfig& config, const ModelCardInfo& task_part) {
  const TaskSpec& spec = task_spec(config.task);
  const RunConfig defaults = default_config(config.task);
  std::string out = "---\n";
  if (!task_part.library_name.empty()) out += "library_name: " + task_part.library_name + "\n";
  if (!config.base_model.empty()) out += "base_model: " + config.base_model + "\n";
  out += "tags:\n- replica\n- " + config.task + "\n";
  for (const auto& tag : task_part.tags) out += "- " + tag + "\n";
  out += "---\n\n";
  out += "# " + fs::path(config.project_name).filename().string() + "\n\n";
  out += fmt::format("Trained with replica, task `{}`, on `{}` (split `{}`{}), from {}.\n\n", config.task,
                     config.data.path, config.data.train_split,
                     config.data.valid_split ? ", evaluated on `" + *config.data.valid_split + "`" : std::string(),
                     config.base_model.empty() ? "model `" + config.model + "`" : "`" + config.base_model + "`");
  out += "## Training\n\n| key | value |\n|---|---|\n";
  std::vector<const KeySpec*> keys;
  for (const auto& k : common_keys()) keys.push_back(&k);
  for (const auto& k : spec.keys) keys.push_back(&k);
  for (const KeySpec* k : keys) {
    if (k->secret || !k->text) continue;
    const std::string value = k->text(config);
    if (value != k->text(defaults)) out += "| " + k->name + " | " + cell(value) + " |\n";
  }
  out += "\nEvery key of the run: `config.yaml`; every step: `metrics.jsonl`.\n\n";
  const auto [train, eval] = last_metrics(config.project_name);
  out += "## Results\n\n| step | train_loss | eval_loss |\n|---|---|---|\n";
  const nlohmann::json& last = eval.is_object() && (!train.is_object() || eval.value("step", 0) >= train.value("step", 0))
                                   ? eval
                                   : train;
  out += fmt::format("| {} | {} | {} |\n\n", last.is_object() ? std::to_string(last.value("step", 0)) : "",
                     number(train, "loss"), number(eval, "eval_loss"));
  if (!task_part.usage.empty()) out += "## Usage\n\n" + task_part.usage + "\n";
  return out;
}

std::string write_model_card(const RunConfig& config, const ModelCardInfo& task_part) {
  const fs::path project(config.project_name), final_dir = project / "final";
  fs::create_directories(final_dir);
  const fs::path card = final_dir / "README.md";
  write_file_atomically(card.string(), model_card(config, task_part));
  return place_in_project(project, card, "README.md") ? (project / "README.md").string() : "";
}

}  // namespace replica::train
