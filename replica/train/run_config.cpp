// The run configuration: reading, checking and writing a whole configuration from the key tables
// (see run_config.h; the keys every task has: common_keys.cpp; the scalars: keys.cpp).
#include "replica/train/run_config.h"
#include "replica/train/schedule.h"

#include "replica/train/deepspeed_config.h"

#include "replica/core/error.h"
#include "replica/core/text.h"
#include "replica/core/files.h"
#include "replica/core/suggest.h"
#include "replica/train/keys.h"
#include "replica/train/task.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

namespace replica::train {

namespace {

const std::vector<std::string> kTopKeys = {"task", "backend", "base_model", "model", "project_name",
                                           "data", "log",     "params",     "hub"};
const std::vector<std::string> kDataKeys = {"path", "train_split", "valid_split", "chat_template",
                                            "column_mapping"};
const std::vector<std::string> kChatTemplates = {"tokenizer", "chatml", "llama3", "zephyr", "none"};

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

bool is_twin(const TaskSpec& spec, const std::string& name) {
  return std::any_of(spec.twins.begin(), spec.twins.end(), [&](const ParamsTwin& t) { return t.name == name; });
}

std::vector<const KeySpec*> keys_of(const std::string& task) {
  std::vector<const KeySpec*> out;
  for (const auto& k : common_keys()) out.push_back(&k);
  for (const auto& k : task_spec(task).keys) out.push_back(&k);
  return out;
}

// "task llm-sft", or "tasks image-classification, two-tower": the tasks that have `name`, by
// `has(spec, name)`; "" for none.
template <class Has>
std::string tasks_having(const std::string& name, Has has) {
  std::vector<std::string> owners;
  for (const auto& spec : task_specs()) {
    if (has(spec, name)) owners.emplace_back(spec.name);
  }
  if (owners.empty()) return "";
  return (owners.size() == 1 ? "task " : "tasks ") + join_names(owners, ", ");
}

// The tasks whose own key (or params twin) `name` is.
std::string owners_of(const std::string& name) {
  return tasks_having(name, [](const TaskSpec& spec, const std::string& n) {
    return is_twin(spec, n) ||
           std::any_of(spec.keys.begin(), spec.keys.end(), [&](const KeySpec& k) { return k.name == n; });
  });
}

// "task llm-sft": the tasks that take base_model (no `model:` choices), for messages.
std::string base_model_tasks() {
  return tasks_having("", [](const TaskSpec& spec, const std::string&) { return spec.models.empty(); });
}

// "tasks image-classification, two-tower": the tasks that take `model:`.
std::string model_tasks() {
  return tasks_having("", [](const TaskSpec& spec, const std::string&) { return !spec.models.empty(); });
}

// A data.column_mapping key the task does not read: another task's ("applies only to ..."), or
// none's ("unknown ... did you mean"); never accepted and ignored.
void check_column_key(const KeyLocation& loc, const TaskSpec& spec, const std::string& key, const std::string& column) {
  if (contains(spec.columns, column)) return;
  const std::string owners =
      tasks_having(column, [](const TaskSpec& s, const std::string& n) { return contains(s.columns, n); });
  if (!owners.empty()) {
    fail("{}key '{}' applies only to {}{}", loc.where(key), key, owners,
         spec.columns.empty() ? fmt::format(" (task {} reads no columns)", spec.name) : "");
  }
  std::vector<std::string> all;
  for (const auto& s : task_specs()) all.insert(all.end(), s.columns.begin(), s.columns.end());
  const std::string suggestion = did_you_mean(column, spec.columns.empty() ? all : spec.columns);
  fail("{}unknown key '{}'{}", loc.where(key), key, suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion));
}

// The key `name` reads (its own name, or a synonym: save_steps is checkpoint_every).
const KeySpec* find_key(const std::string& task, const std::string& name) {
  for (const KeySpec* k : keys_of(task)) {
    if (k->name == name || contains(k->synonyms, name)) return k;
  }
  return nullptr;
}

// `log`'s value, from the file (`where` "run.yaml:2: ") or the flag: wandb (AutoTrain's) is
// refused saying why, anything else must be one of LogFormat's names.
LogFormat log_format_of(const std::string& value, const std::string& where, bool from_flag) {
  if (value == "wandb") {
    fail("{}{} is not available in replica (no Weights & Biases client); use one of {}", where,
         from_flag ? "--log wandb" : "log 'wandb'", Codec<LogFormat>::names());
  }
  auto format = enum_from<LogFormat>(value);
  if (!format) fail("{}{} must be one of {}, got '{}'", where, from_flag ? "--log" : "key 'log'", Codec<LogFormat>::names(), excerpt(value));
  return *format;
}

std::string read_string(const YAML::Node& node, const std::string& key, const KeyLocation& loc) {
  if (!node.IsScalar()) fail("{}key '{}' must be a string, got {}", loc.at(node), key, describe(node));
  return node.Scalar();
}

[[noreturn]] void unknown_key(const KeyLocation& loc, const YAML::Node& key_node, const std::string& section,
                              const std::string& key, const std::vector<std::string>& candidates,
                              const std::string& elsewhere = "") {
  std::string suggestion = did_you_mean(key, candidates);
  if (suggestion.empty()) suggestion = elsewhere;
  // A key the file made up is shown by its excerpt (fuzz_config: a 4 KB key came back whole).
  fail("{}unknown key '{}{}'{}", loc.at(key_node), section, excerpt(key),
       suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion));
}

// Calls `visit(key, key_node, value_node)` for each entry of a mapping, with hyphens in keys
// read as underscores (the `--batch-size` flag spelling) and duplicates refused.
template <class Visit>
void for_each_entry(const YAML::Node& map, const std::string& section, const KeyLocation& loc, Visit visit) {
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    // Copies: the iterator hands out a temporary pair.
    const YAML::Node key_node = it->first;
    const YAML::Node value_node = it->second;
    if (!key_node.IsScalar())
      fail("{}keys under '{}' must be plain names", loc.at(key_node),
           section.empty() ? "the top level" : section.substr(0, section.size() - 1));
    std::string key = key_node.Scalar();
    std::replace(key.begin(), key.end(), '-', '_');
    if (!seen.insert(key).second) fail("{}key '{}{}' is given twice", loc.at(key_node), section, key);
    visit(key, key_node, value_node);
  }
}

// A section (data, params, column_mapping): a mapping, or empty.
bool check_section(const YAML::Node& node, const std::string& key, const KeyLocation& loc) {
  if (node.IsNull()) return false;
  if (!node.IsMap()) fail("{}key '{}' must be a mapping, got {}", loc.at(node), key, describe(node));
  return true;
}

void check_one_of(const KeyLocation& loc, const std::string& key, const std::string& value,
                  const std::vector<std::string>& allowed) {
  if (contains(allowed, value)) return;
  fail("{}key '{}' must be one of {}, got '{}'", loc.where(key), key, join_names(allowed, ", "), excerpt(value));
}

void check_path(const KeyLocation& loc, const std::string& key, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("{}{} '{}' does not exist", loc.where(key), key, excerpt(path, 200));
}

// The ZeRO keys that only make sense together (DeepSpeed's own rules where it has them).
void check_zero_keys(const RunParams& p, const KeyLocation& loc) {
  const int stage = zero_stage_of(p);
  if (p.zero_stage == 3 && p.distributed_backend == DistributedBackend::Ddp) {
    fail("{}key 'params.zero_stage' is 3 (parameters sharded), which is distributed_backend deepspeed (zero3), "
         "but distributed_backend is ddp; set distributed_backend: deepspeed, or zero_stage 1 or 2",
         loc.where("params.zero_stage"));
  }
  if (p.zero_stage >= 0 && p.shard_optimizer && *p.shard_optimizer != (p.zero_stage == 1 || p.zero_stage == 2) &&
      p.zero_stage != 3) {
    fail("{}key 'params.shard_optimizer' is {} but zero_stage {} {} the optimizer step; give one of them",
         loc.where("params.shard_optimizer"), *p.shard_optimizer ? "true" : "false", p.zero_stage,
         p.zero_stage == 0 ? "does not shard" : "shards");
  }
  if (p.offload_param_device != OffloadDevice::None && stage != 3) {
    fail("{}key 'params.offload_param_device' needs zero_stage 3 (distributed_backend deepspeed): only ZeRO-3 "
         "shards parameters; the run is at stage {}",
         loc.where("params.offload_param_device"), stage);
  }
  if (p.offload_optimizer_device != OffloadDevice::None && stage == 0) {
    fail("{}key 'params.offload_optimizer_device' needs zero_stage 1, 2 or 3 (a sharded optimizer step, as in "
         "DeepSpeed); set zero_stage",
         loc.where("params.offload_optimizer_device"));
  }
  const bool nvme = p.offload_optimizer_device == OffloadDevice::Nvme || p.offload_param_device == OffloadDevice::Nvme;
  if (nvme && p.nvme_path.empty()) {
    fail("{}nvme offload needs params.nvme_path (a directory on a fast local disk for the swap files)",
         loc.where(p.offload_optimizer_device == OffloadDevice::Nvme ? "params.offload_optimizer_device"
                                                                     : "params.offload_param_device"));
  }
  if (!nvme && !p.nvme_path.empty()) {
    fail("{}key 'params.nvme_path' is used only with offload_optimizer_device or offload_param_device nvme",
         loc.where("params.nvme_path"));
  }
  // Note [Adafactor needs whole parameters] in adafactor.h.
  if (p.optimizer == OptimizerKind::Adafactor && (stage > 0 || p.shard_optimizer.value_or(false))) {
    fail("{}key 'params.optimizer' is adafactor, which needs whole parameters (it factors a matrix's second "
         "moment by rows and columns and clips by the update's RMS over the whole matrix), but {} gives the "
         "optimizer flat shards of them; use adamw or adamw_bnb_8bit there, or step unsharded",
         loc.where("params.optimizer"),
         stage == 3 ? "ZeRO-3 (distributed_backend deepspeed)"
                    : stage > 0 ? fmt::format("zero_stage {}", stage) : std::string("shard_optimizer: true"));
  }
  check_schedule(p.scheduler, p.lr, loc.where("params.lr"));
}

// resume_from_checkpoint naming a directory: one of project_name's checkpoint-STEP directories
// (a run continues in its own project; another project's checkpoint would be resumed into a
// directory whose checkpoints, metrics and rotation are not its own).
void check_resume_from(const RunConfig& c, const KeyLocation& loc) {
  const std::string& dir = c.params.resume_from_checkpoint;
  if (dir.empty() || dir == "false") return;
  const std::string key = "params.resume_from_checkpoint";
  std::error_code ec;
  const std::filesystem::path path(dir);
  if (!std::filesystem::is_directory(path, ec)) {
    fail("{}key '{}' '{}' is not a directory (auto, false, or a checkpoint-STEP directory of project_name)",
         loc.where(key), loc.name(key), excerpt(dir, 200));
  }
  const std::string name = path.filename().empty() ? path.parent_path().filename().string() : path.filename().string();
  const auto parent = std::filesystem::weakly_canonical(std::filesystem::absolute(path) / "..", ec);
  const auto project = std::filesystem::weakly_canonical(std::filesystem::absolute(c.project_name), ec);
  if (name.rfind("checkpoint-", 0) != 0 || !parse_int(name.substr(11)) || parent != project) {
    fail("{}key '{}' '{}' must be a checkpoint-STEP directory of project_name '{}' (a run resumes in its own "
         "project)",
         loc.where(key), loc.name(key), excerpt(dir, 200), excerpt(c.project_name, 200));
  }
}

void check_config(const RunConfig& c, const KeyLocation& loc) {
  if (c.backend != "local") {
    // AutoTrain's other backends (spaces-*, ep-*, ngc-*, nvcf-*, local-cli, ...) are its hosted
    // services or its own CLI; replica's runs go where it is started.
    fail("{}backend '{}' is not replica's: replica runs where it is started (backend: local); AutoTrain's hosted "
         "backends (Hugging Face Spaces, endpoints, NGC/DGX Cloud) need its service, and clusters take replica "
         "launch, Slurm, Ray, Spark or Kubernetes (docs/multi-node.md)",
         loc.where("backend"), excerpt(c.backend));
  }
  const TaskSpec& spec = task_spec(c.task);
  if (spec.models.empty()) {
    if (c.base_model.empty()) fail("{}base_model is required for task {}", loc.where("base_model"), c.task);
    check_path(loc, "base_model", c.base_model);
  } else {
    if (!c.base_model.empty()) {
      fail("{}key 'base_model' is for {} (task {} takes 'model')", loc.where("base_model"), base_model_tasks(), c.task);
    }
    check_one_of(loc, "model", c.model, spec.models);
  }
  if (c.project_name.empty()) {
    fail("{}project_name is required (the output directory of the run)", loc.where("project_name"));
  }
  const DataConfig& d = c.data;
  if (d.path.empty()) fail("{}data.path is required for task {}", loc.where("data.path"), c.task);
  check_path(loc, "data.path", d.path);
  if (d.train_split.empty()) fail("{}key 'data.train_split' must not be empty", loc.where("data.train_split"));
  if (d.valid_split && d.valid_split->empty()) {
    fail("{}key 'data.valid_split' must not be empty (null turns evaluation off)", loc.where("data.valid_split"));
  }
  check_one_of(loc, "data.chat_template", d.chat_template, kChatTemplates);
  for (const auto& [name, column] : d.column_mapping) {
    const std::string key = "data.column_mapping." + name;
    check_column_key(loc, spec, key, name);  // never fails for parsed configs
    if (column.empty()) fail("{}key '{}' must not be empty", loc.where(key), key);
  }
  for (const KeySpec* k : keys_of(c.task)) k->check(c, "params." + k->name, loc);
  check_zero_keys(c.params, loc);
  check_resume_from(c, loc);
}

void read_data(const YAML::Node& node, RunConfig& c, KeyLocation& loc) {
  if (!check_section(node, "data", loc)) return;
  for_each_entry(node, "data.", loc, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    const std::string path = "data." + key;
    loc.note(path, k);
    if (key == "path") {
      c.data.path = read_string(v, path, loc);
    } else if (key == "train_split") {
      c.data.train_split = read_string(v, path, loc);
    } else if (key == "valid_split") {
      if (v.IsNull()) {
        c.data.valid_split.reset();
      } else {
        c.data.valid_split = read_string(v, path, loc);
      }
    } else if (key == "chat_template") {
      c.data.chat_template = v.IsNull() ? "none" : read_string(v, path, loc);
    } else if (key == "column_mapping") {
      // A mapping given replaces the task's default one as a whole.
      c.data.column_mapping.clear();
      if (!check_section(v, path, loc)) return;
      for_each_entry(v, "data.column_mapping.", loc,
                     [&](const std::string& column, const YAML::Node& ck, const YAML::Node& cv) {
                       const std::string column_path = path + "." + column;
                       const TaskSpec& spec = task_spec(c.task);
                       if (!contains(spec.columns, column)) {
                         loc.note(column_path, ck);
                         check_column_key(loc, spec, column_path, column);
                       }
                       loc.note(column_path, ck);
                       c.data.column_mapping[column] = read_string(cv, column_path, loc);
                     });
    } else {
      unknown_key(loc, k, "data.", key, kDataKeys);
    }
  });
}

// The params twins given (name -> value), applied to their data key once the file is read.
using ParamsTwins = std::map<std::string, std::string>;

// Where a params twin lives in `data:`.
std::string twin_data_key(const std::string& twin) {
  return twin == "chat_template" ? "data.chat_template" : "data.column_mapping." + twin;
}

void read_params(const YAML::Node& node, RunConfig& c, KeyLocation& loc, ParamsTwins& twins) {
  if (!check_section(node, "params", loc)) return;
  const TaskSpec& spec = task_spec(c.task);
  std::vector<std::string> candidates;
  for (const KeySpec* k : keys_of(c.task)) candidates.push_back(k->name);
  for (const auto& twin : spec.twins) candidates.push_back(twin.name);
  std::map<std::string, std::string> written_as;  // a key -> the name it was given by (a synonym's)
  for_each_entry(node, "params.", loc, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    const std::string path = "params." + key;
    if (const KeySpec* ks = find_key(c.task, key)) {
      const auto [it, fresh] = written_as.emplace(ks->name, path);
      if (!fresh) fail("{}key '{}' and '{}' are the same key; give one of them", loc.at(k), path, it->second);
      const std::string own = "params." + ks->name;
      loc.note_as(own, k, path);
      ks->read(c, v, own, loc);
      return;
    }
    loc.note(path, k);
    if (const std::string owners = owners_of(key); !owners.empty() && !is_param_key(c.task, key)) {
      fail("{}key '{}' applies only to {}", loc.at(k), path, owners);
    }
    if (is_twin(spec, key)) {
      twins[key] = key == "chat_template" && v.IsNull() ? "none" : read_string(v, path, loc);
    } else {
      // A top-level or data key put under params by mistake is named with its section.
      std::string elsewhere = contains(kDataKeys, key) ? "data." + key : contains(kTopKeys, key) ? key : "";
      unknown_key(loc, k, "params.", key, candidates, elsewhere);
    }
  });
}

// A twin given with its data key too must agree with it (a file's, or an earlier flag's).
void apply_twins(RunConfig& c, const KeyLocation& loc, const ParamsTwins& twins) {
  for (const auto& [name, value] : twins) {
    const std::string data_key = twin_data_key(name), param_key = "params." + name;
    std::string& target = name == "chat_template" ? c.data.chat_template : c.data.column_mapping[name];
    if (loc.has(data_key) && target != value) {
      fail("{}key '{}' is '{}' but '{}' is '{}'; give one of them", loc.where(param_key), param_key, value,
           data_key, target);
    }
    target = value;
  }
}

// `task:`: a registered task's name, or one of its aliases (AutoTrain's llm-dpo) with the keys
// the alias sets.
struct TaskChoice {
  std::string name;
  std::vector<std::pair<std::string, std::string>> keys;
};

TaskChoice read_task(const YAML::Node& node, KeyLocation& loc, const YAML::Node& key_node) {
  const std::string name = read_string(node, "task", loc);
  loc.note("task", key_node);
  std::vector<std::string> names;
  for (const auto& spec : task_specs()) {
    if (spec.name == name) return {spec.name, {}};
    names.push_back(spec.name);
    for (const auto& alias : spec.aliases) {
      if (alias.name == name) return {spec.name, alias.keys};
      names.push_back(alias.name);
    }
  }
  fail("{}key 'task' must be one of {}, got '{}'", loc.where("task"), join_names(names, ", "), excerpt(name));
}

// AutoTrain's `hub:` section (username, token, push_to_hub): the same keys as under params:,
// which win when both give one (AutoTrain reads params: last).
void read_hub(const YAML::Node& node, RunConfig& c, KeyLocation& loc) {
  if (!check_section(node, "hub", loc)) return;
  static const std::vector<std::string> kHubKeys = {"username", "token", "push_to_hub"};
  for_each_entry(node, "hub.", loc, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    if (!contains(kHubKeys, key)) unknown_key(loc, k, "hub.", key, kHubKeys);
    const std::string own = "params." + key;
    if (loc.given(own)) return;
    loc.note_as(own, k, "hub." + key);
    find_key(c.task, key)->read(c, v, own, loc);
  });
}

// The run's notes (RunConfig::notes): each key given that does nothing in this run, and the
// task's defaults that differ from AutoTrain's.
void add_notes(RunConfig& c, const KeyLocation& loc) {
  c.notes.clear();
  for (const KeySpec* k : keys_of(c.task)) {
    const std::string key = "params." + k->name;
    if (!k->unused || !loc.given(key)) continue;
    const std::string why = k->unused(c);
    if (!why.empty()) c.notes.push_back(fmt::format("{}{} has no effect {}", loc.where(key), loc.name(key), why));
  }
  if (const auto notes = task_spec(c.task).default_notes) {
    for (auto& line : notes(c, loc)) c.notes.push_back(std::move(line));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------

bool operator==(const RunConfig& a, const RunConfig& b) {
  auto top = [](const RunConfig& c) {
    return std::tie(c.task, c.backend, c.model, c.base_model, c.project_name, c.log, c.data.path, c.data.train_split,
                    c.data.valid_split, c.data.chat_template, c.data.column_mapping);
  };
  if (top(a) != top(b)) return false;
  // The same task (compared above): the same keys, its own struct's included.
  for (const KeySpec* k : keys_of(a.task)) {
    if (!k->same(a, b)) return false;
  }
  return true;
}

RunConfig default_config(const std::string& task) {
  const TaskSpec& spec = task_spec(task);
  RunConfig c;
  c.task = spec.name;
  c.task_params = spec.params;
  c.model = spec.models.empty() ? "" : spec.models.front();
  if (spec.defaults) spec.defaults(c);
  return c;
}

int zero_stage_of(const RunParams& p) {
  if (p.zero_stage >= 0) return p.zero_stage;
  return p.distributed_backend == DistributedBackend::Zero3 ? 3 : 0;
}

void validate_config(const RunConfig& config) { check_config(config, KeyLocation(config.source, true)); }

void set_param(RunConfig& config, const std::string& key, const std::string& value) {
  // The value is read as a YAML scalar would be, so "null", "auto" and "[64, 32]" mean what
  // they mean in a file.
  YAML::Node node;
  try {
    node = YAML::Load(value);
  } catch (const YAML::Exception&) {
    node = YAML::Node(value);
  }
  YAML::Node params(YAML::NodeType::Map);
  params[key] = node;
  KeyLocation loc("", false);
  ParamsTwins twins;
  read_params(params, config, loc, twins);
  apply_twins(config, loc, twins);  // `loc` has no lines: nothing to agree with
}

namespace {

// Every key and scalar value of the tree is UTF-8, or a replica::Error naming its line. An
// explicit stack: the nesting was bounded by the reader, this walk adds no recursion. Aliases
// are walked where they are used, so a tree of aliases of aliases (a "billion laughs") is
// bounded by a count of values no configuration comes near.
void check_scalars_are_utf8(const YAML::Node& root, const KeyLocation& loc) {
  constexpr int64_t kMaxValues = 100000;
  int64_t visited = 0;
  std::vector<YAML::Node> pending = {root};
  while (!pending.empty()) {
    if (++visited > kMaxValues) {
      fail("{}the configuration holds more than {} values once its aliases are expanded (a YAML alias bomb?)",
           loc.at(root), kMaxValues);
    }
    const YAML::Node node = pending.back();
    pending.pop_back();
    if (node.IsScalar()) {
      if (invalid_utf8_offset(node.Scalar())) {
        fail("{}a key or value is not valid UTF-8 text (after YAML's reading: control characters such as NUL "
             "in a plain scalar come out as invalid bytes; quote the text and escape them)",
             loc.at(node));
      }
    } else if (node.IsMap()) {
      for (auto it = node.begin(); it != node.end(); ++it) {
        pending.push_back(it->first);
        pending.push_back(it->second);
      }
    } else if (node.IsSequence()) {
      for (auto it = node.begin(); it != node.end(); ++it) pending.push_back(*it);
    }
  }
}

// The keys of a YAML file, unchecked: flags may still set what it leaves out.
RunConfig read_config(const std::string& yaml_text, const std::string& source_name, KeyLocation& loc) {
  // YAML is Unicode text; yaml-cpp takes any bytes, and a string that is not UTF-8 could not be
  // written back (config.yaml's emitter replaces the bytes: another project_name; nlohmann's
  // dump of training_params.json throws). Refused where it is read, naming the line.
  if (const auto bad = invalid_utf8_offset(yaml_text)) {
    const auto line = 1 + std::count(yaml_text.begin(), yaml_text.begin() + static_cast<std::ptrdiff_t>(*bad), '\n');
    fail("{}:{}: not valid UTF-8 (byte {} of the file)", source_name, line, *bad);
  }
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail("{}invalid YAML: {}", e.mark.is_null() ? source_name + ": " : fmt::format("{}:{}: ", source_name, e.mark.line + 1),
         e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);  // empty file: missing keys below
  if (!root.IsMap()) fail("{}the configuration must be a mapping of keys to values", loc.at(root));
  // yaml-cpp's reader also turns some valid input into invalid UTF-8 (a NUL byte and control
  // characters in a plain scalar came out as a lone 0xA0): every scalar is checked as read.
  check_scalars_are_utf8(root, loc);

  // The task decides the defaults and which keys exist, so it is read first.
  TaskChoice choice{default_task(), {}};
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it->first.IsScalar() && it->first.Scalar() == "task") choice = read_task(it->second, loc, it->first);
  }
  const std::string& task = choice.name;
  RunConfig c = default_config(task);
  c.source = source_name;
  for (const auto& [key, value] : choice.keys) set_param(c, key, value);
  const bool takes_base_model = task_spec(task).models.empty();

  ParamsTwins twins;
  YAML::Node hub;  // read after params:, whose keys win
  std::vector<std::string> params;
  for (const KeySpec* k : keys_of(task)) params.push_back(k->name);
  for_each_entry(root, "", loc, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    loc.note(key, k);
    if (key == "task") {
      // read above
    } else if (key == "backend") {
      c.backend = read_string(v, key, loc);
    } else if (key == "base_model") {
      if (!takes_base_model)
        fail("{}key 'base_model' is for {} (task {} takes 'model')", loc.at(k), base_model_tasks(), task);
      c.base_model = read_string(v, key, loc);
    } else if (key == "model") {
      if (takes_base_model)
        fail("{}key 'model' is for {}; {} takes 'base_model'", loc.at(k), model_tasks(), task);
      c.model = read_string(v, key, loc);
    } else if (key == "project_name") {
      c.project_name = read_string(v, key, loc);
    } else if (key == "log") {
      c.log = log_format_of(read_string(v, key, loc), loc.at(k), /*from_flag=*/false);
    } else if (key == "data") {
      read_data(v, c, loc);
    } else if (key == "params") {
      read_params(v, c, loc, twins);
    } else if (key == "hub") {
      hub = v;
    } else {
      std::string elsewhere = contains(params, key)      ? "params." + key
                              : contains(kDataKeys, key) ? "data." + key
                                                         : "";
      unknown_key(loc, k, "", key, kTopKeys, elsewhere);
    }
  });
  apply_twins(c, loc, twins);
  if (hub) read_hub(hub, c, loc);
  return c;
}

const std::vector<std::string> kTopFlags = {"model",         "base_model",    "project_name",    "data_path",
                                            "train_split",   "valid_split",   "log",             "backend",
                                            "messages_column", "prompt_column", "completion_column"};

void apply_flag(RunConfig& c, const std::string& typed, const std::string& value, KeyLocation& loc) {
  if (invalid_utf8_offset(value)) fail("--{}: the value is not valid UTF-8", excerpt(typed));
  std::string name = typed;
  std::replace(name.begin(), name.end(), '-', '_');
  const bool takes_base_model = task_spec(c.task).models.empty();
  auto top = [&](const std::string& key, std::string& field) {
    field = value;
    loc.note_flag(key, "--" + typed);
  };
  if (name == "task") {
    fail("--task cannot change the task of a run; set task: in the YAML file");
  } else if (name == "model" || name == "base_model") {
    if (name == "base_model" && !takes_base_model) {
      fail("--base-model is for {} (task {} takes --model)", base_model_tasks(), c.task);
    }
    top(takes_base_model ? "base_model" : "model", takes_base_model ? c.base_model : c.model);
  } else if (name == "project_name") {
    top("project_name", c.project_name);
  } else if (name == "data_path") {
    top("data.path", c.data.path);
  } else if (name == "train_split") {
    top("data.train_split", c.data.train_split);
  } else if (name == "valid_split") {
    if (value == "null" || value == "none" || value.empty()) {
      c.data.valid_split.reset();
    } else {
      c.data.valid_split = value;
    }
    loc.note_flag("data.valid_split", "--" + typed);
  } else if (name == "log") {
    c.log = log_format_of(value, "", /*from_flag=*/true);
  } else if (name == "backend") {
    top("backend", c.backend);
  } else if (name == "messages_column" || name == "prompt_column" || name == "completion_column") {
    top("data.column_mapping." + name, c.data.column_mapping[name]);
  } else if (is_param_key(c.task, name)) {
    try {
      set_param(c, name, value);
    } catch (const Error& e) {
      fail("--{} {}: {}", typed, value, e.what());
    }
    const KeySpec* k = find_key(c.task, name);
    loc.note_flag(k == nullptr ? twin_data_key(name) : "params." + k->name, "--" + typed);
  } else {
    fail("{}", unknown_flag_message(c.task, typed, kTopFlags));
  }
}

}  // namespace

RunConfig parse_config(const std::string& yaml_text, const std::string& source_name) {
  KeyLocation loc(source_name, true);
  RunConfig c = read_config(yaml_text, source_name, loc);
  apply_deepspeed_config(c, loc);
  check_config(c, loc);
  add_notes(c, loc);
  return c;
}

void set_flag(RunConfig& config, const std::string& name, const std::string& value) {
  KeyLocation loc("", false);
  apply_flag(config, name, value, loc);
}

void note_flags(RunConfig& config, const std::vector<std::string>& flags) {
  KeyLocation loc("", false);
  for (const auto& typed : flags) {
    std::string name = typed;
    std::replace(name.begin(), name.end(), '-', '_');
    if (const KeySpec* k = find_key(config.task, name)) {
      loc.note_flag("params." + k->name, "--" + typed);
    } else if (is_twin(task_spec(config.task), name)) {
      loc.note_flag(twin_data_key(name), "--" + typed);
    }
  }
  add_notes(config, loc);
}

bool is_flag(const std::string& task, const std::string& name) {
  std::string n = name;
  std::replace(n.begin(), n.end(), '-', '_');
  return contains(kTopFlags, n) || is_param_key(task, n);
}

RunConfig load_config(const std::string& path, const std::vector<std::pair<std::string, std::string>>& flags) {
  KeyLocation loc(path, true);
  RunConfig c = read_config(read_file(path), path, loc);
  for (const auto& [name, value] : flags) apply_flag(c, name, value, loc);
  apply_deepspeed_config(c, loc);
  check_config(c, loc);
  add_notes(c, loc);
  return c;
}

RunConfig load_config(const std::string& path) { return load_config(path, {}); }

std::string to_yaml(const RunConfig& c) {
  YAML::Emitter out;
  out.SetNullFormat(YAML::LowerNull);
  out << YAML::BeginMap;
  out << YAML::Key << "task" << YAML::Value << c.task;
  out << YAML::Key << "backend" << YAML::Value; write_text(out, c.backend);
  if (task_spec(c.task).models.empty()) {
    out << YAML::Key << "base_model" << YAML::Value; write_text(out, c.base_model);
  } else {
    out << YAML::Key << "model" << YAML::Value; write_text(out, c.model);
  }
  out << YAML::Key << "project_name" << YAML::Value; write_text(out, c.project_name);

  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "path" << YAML::Value; write_text(out, c.data.path);
  out << YAML::Key << "train_split" << YAML::Value; write_text(out, c.data.train_split);
  out << YAML::Key << "valid_split" << YAML::Value;
  if (c.data.valid_split) {
    write_text(out, *c.data.valid_split);
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "chat_template" << YAML::Value; write_text(out, c.data.chat_template);
  out << YAML::Key << "column_mapping" << YAML::Value << YAML::BeginMap;
  for (const auto& [name, column] : c.data.column_mapping) {
    out << YAML::Key;
    write_text(out, name);
    out << YAML::Value;
    write_text(out, column);
  }
  out << YAML::EndMap;
  out << YAML::EndMap;

  out << YAML::Key << "log" << YAML::Value << name_of(c.log);

  out << YAML::Key << "params" << YAML::Value << YAML::BeginMap;
  for (const KeySpec* k : keys_of(c.task)) {
    if (!k->write) continue;  // the token
    out << YAML::Key << k->name << YAML::Value;
    k->write(out, c);
  }
  out << YAML::EndMap;

  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string training_params_json(const RunConfig& c) {
  nlohmann::json j = {
      {"task", c.task},
      {"model", task_spec(c.task).models.empty() ? c.base_model : c.model},
      {"project_name", c.project_name},
      {"data_path", c.data.path},
      {"train_split", c.data.train_split},
      {"valid_split", c.data.valid_split ? nlohmann::json(*c.data.valid_split) : nlohmann::json()},
      {"log", name_of(c.log)},
  };
  for (const auto& twin : task_spec(c.task).twins) {
    if (twin.name == "chat_template") {
      j["chat_template"] = c.data.chat_template;
    } else if (auto it = c.data.column_mapping.find(twin.name); it != c.data.column_mapping.end()) {
      j[twin.name] = it->second;
    }
  }
  for (const KeySpec* k : keys_of(c.task)) {
    if (k->json && k->in_json(c)) j[k->name] = k->json(c);
  }
  // Every string here is UTF-8 (read_config and apply_flag refuse any other).
  return j.dump(2) + "\n";
}

namespace {

// "  --flag VALUE   what it does [default]", the text wrapped at 100 columns under itself.
std::string help_line(const std::string& flag, const std::string& text) {
  constexpr size_t kIndent = 41, kWidth = 100;
  std::string out = fmt::format("  {:<37}  ", flag);  // two spaces at least before the help
  if (out.size() > kIndent) out += "\n" + std::string(kIndent, ' ');
  size_t column = kIndent;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(start, end - start);
    if (column > kIndent && column + 1 + word.size() > kWidth) {
      out += "\n" + std::string(kIndent, ' ');
      column = kIndent;
    } else if (column > kIndent) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
    start = end + 1;
  }
  return out + "\n";
}

}  // namespace

std::string keys_help(const std::string& task) {
  const RunConfig defaults = default_config(task);
  std::vector<std::string> groups;
  for (const KeySpec* k : keys_of(task)) {
    if (!contains(groups, k->group)) groups.push_back(k->group);
  }
  std::string out;
  for (const auto& group : groups) {
    out += group + ":\n";
    for (const KeySpec* k : keys_of(task)) {
      if (k->group != group) continue;
      std::string flag = "--" + k->name;
      std::replace(flag.begin(), flag.end(), '_', '-');
      if (!k->value_hint.empty()) flag += " " + k->value_hint;
      const std::string value = k->secret ? "" : fmt::format(" [{}]", k->text(defaults));
      out += help_line(flag, k->help + value);
    }
  }
  const TaskSpec& spec = task_spec(task);
  if (!spec.twins.empty()) out += "Twins of data: keys (AutoTrain's flat names):\n";
  for (const auto& twin : spec.twins) {
    std::string flag = "--" + twin.name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    std::string value = twin.unset;
    if (twin.name == "chat_template") {
      value = defaults.data.chat_template;
    } else if (auto it = defaults.data.column_mapping.find(twin.name); it != defaults.data.column_mapping.end()) {
      value = it->second;
    }
    out += help_line(flag + " NAME", twin.help + (value.empty() ? "" : " [" + value + "]"));
  }
  return out;
}

bool is_param_key(const std::string& task, const std::string& name) {
  return find_key(task, name) != nullptr || is_twin(task_spec(task), name);
}

bool is_switch_key(const std::string& task, const std::string& name) {
  const KeySpec* k = find_key(task, name);
  return k != nullptr && k->is_switch;
}

std::string unknown_flag_message(const std::string& task, const std::string& typed, const std::vector<std::string>& other_flags) {
  std::string name = typed;
  std::replace(name.begin(), name.end(), '-', '_');
  if (!is_param_key(task, name)) {
    if (const std::string owners = owners_of(name); !owners.empty()) {
      return fmt::format("flag --{} applies only to {}", typed, owners);
    }
  }
  std::vector<std::string> candidates = other_flags;
  std::map<std::string, std::string> known_as;  // another tool's name -> our key
  for (const KeySpec* k : keys_of(task)) {
    candidates.push_back(k->name);
    for (const auto& other : k->known_as) {
      candidates.push_back(other);
      known_as[other] = k->name;
    }
  }
  for (const auto& twin : task_spec(task).twins) candidates.push_back(twin.name);
  std::string suggestion = did_you_mean(name, candidates);
  if (auto it = known_as.find(suggestion); it != known_as.end()) suggestion = it->second;
  std::replace(suggestion.begin(), suggestion.end(), '_', '-');
  return fmt::format("unknown flag --{}{}", typed, suggestion.empty() ? "" : fmt::format(" (did you mean --{}?)", suggestion));
}

}  // namespace replica::train
