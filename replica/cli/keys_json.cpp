// `replica keys TASK --json` (keys_json.h).
#include "replica/cli/keys_json.h"

#include "replica/cli/llm_command.h"
#include "replica/core/error.h"
#include "replica/train/task.h"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace replica::cli {
namespace {

std::string flag_of(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return "--" + name;
}

nlohmann::json entry(const std::string& name, const std::string& help, nlohmann::json value) {
  return {{"name", name}, {"flag", flag_of(name)}, {"help", help}, {"default", std::move(value)}};
}

}  // namespace

std::string keys_json(const std::string& task) {
  using train::RunConfig;
  const RunConfig d = train::default_config(task);
  const bool llm = train::task_spec(task).models.empty();  // takes base_model (llm-sft)
  nlohmann::json out;
  out["task"] = task;
  out["command"] = llm ? "replica llm --train" : "replica --config FILE";

  // The run's own flags, as `replica llm` and `replica --config FILE` take them; each must be
  // a flag of the task (a renamed one fails here, not silently in Python).
  nlohmann::json run = nlohmann::json::array();
  auto add_run = [&](const std::string& name, const std::string& help, nlohmann::json value) {
    if (!train::is_flag(task, name)) fail("replica keys: '{}' is not a flag of task {}", name, task);
    run.push_back(entry(name, help, std::move(value)));
  };
  add_run("model", llm ? "Hugging Face model directory (base_model:)" : "the model (model:)",
          llm ? d.base_model : d.model);
  add_run("project_name", "the run's directory (checkpoints, metrics, final/)", d.project_name);
  add_run("data_path", "a data file, or a directory holding <train_split>.jsonl/.csv (data.path)", d.data.path);
  add_run("train_split", "data.train_split", d.data.train_split);
  add_run("valid_split", "data.valid_split (null: no evaluation)",
          d.data.valid_split ? nlohmann::json(*d.data.valid_split) : nlohmann::json());
  add_run("log", "none, jsonl or tensorboard", train::name_of(d.log));
  add_run("backend", "where the run goes: local", d.backend);
  if (llm) {
    for (const char* column : {"messages_column", "prompt_column", "completion_column"}) {
      add_run(column, std::string("data.column_mapping.") + column, nullptr);
    }
  }
  out["run"] = std::move(run);

  nlohmann::json keys = nlohmann::json::array();
  std::vector<const train::KeySpec*> specs;
  for (const auto& k : train::common_keys()) specs.push_back(&k);
  for (const auto& k : train::task_spec(task).keys) specs.push_back(&k);
  for (const train::KeySpec* k : specs) {
    nlohmann::json e = entry(k->name, k->help, k->secret || !k->json ? nlohmann::json() : k->json(d));
    e["group"] = k->group;
    e["kind"] = k->kind;
    e["hint"] = k->value_hint;
    e["switch"] = k->is_switch;
    e["secret"] = k->secret;
    e["known_as"] = k->known_as;
    keys.push_back(std::move(e));
  }
  out["keys"] = std::move(keys);

  nlohmann::json twins = nlohmann::json::array();
  for (const auto& twin : train::task_spec(task).twins) {
    nlohmann::json value;
    if (twin.name == "chat_template") {
      value = d.data.chat_template;
    } else if (auto it = d.data.column_mapping.find(twin.name); it != d.data.column_mapping.end()) {
      value = it->second;
    }
    twins.push_back(entry(twin.name, twin.help, std::move(value)));
  }
  out["twins"] = std::move(twins);

  // AutoTrain fields accepted at one value only: none since they became keys (push_to_hub,
  // auto_find_batch_size, ...: their checks say why another value is refused). Kept for readers.
  out["autotrain_only"] = nlohmann::json::array();
  return out.dump(2) + "\n";
}

}  // namespace replica::cli
