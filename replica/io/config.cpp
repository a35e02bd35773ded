#include "replica/io/config.h"

#include "replica/core/error.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

namespace replica::io {
namespace {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

const std::vector<std::string> kTasks = {"llm-sft", "image-classification", "two-tower"};
const std::vector<std::string> kTopKeys = {"task",         "backend", "base_model", "model",
                                           "project_name", "data",    "log",        "params"};
const std::vector<std::string> kDataKeys = {"path", "train_split", "valid_split", "chat_template",
                                            "column_mapping"};
const std::vector<std::string> kColumnKeys = {
    "text_column",        "messages_column",      "prompt_column", "completion_column",
    "prompt_text_column", "rejected_text_column", "image_column",  "target_column",
    "label_column",       "user_column",          "item_column"};
const std::vector<std::string> kChatTemplates = {"tokenizer", "chatml", "llama3", "none"};
const std::vector<std::string> kLogs = {"none", "jsonl", "tensorboard"};

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

// Shortest text that reads back as the same double and that YAML 1.1 readers (PyYAML)
// also take for a float: they need a '.' in the mantissa.
std::string float_text(double value) {
  const std::string text = fmt::format("{}", value);
  if (!std::isfinite(value)) return text;
  const auto e = text.find('e');
  std::string mantissa = text.substr(0, e);
  if (mantissa.find('.') == std::string::npos) mantissa += ".0";
  return e == std::string::npos ? mantissa : mantissa + text.substr(e);
}

// Where each key was found, so that checks made after parsing still name the line.
struct Context {
  std::string source;
  std::map<std::string, int> lines;  // "params.epochs" -> 1-based line
  bool has_lines = true;             // false for values that come from flags, not a file

  // "FILE:LINE: ", "FILE: " or "" (a config built from flags).
  std::string where(const std::string& key) const {
    auto it = lines.find(key);
    if (it != lines.end()) return fmt::format("{}:{}: ", source, it->second);
    return source.empty() ? "" : source + ": ";
  }
  std::string at(const YAML::Mark& mark) const {
    if (!has_lines || mark.is_null()) return source.empty() ? "" : source + ": ";
    return fmt::format("{}:{}: ", source, mark.line + 1);
  }
};

// ---------------------------------------------------------------------------------------
// Typed reading of YAML values. `key` is the dotted path used in messages.

std::string describe(const YAML::Node& node) {
  if (node.IsMap()) return "a mapping";
  if (node.IsSequence()) return "a list";
  if (node.IsNull()) return "null";
  return "'" + node.Scalar() + "'";
}

[[noreturn]] void wrong_type(const Context& ctx, const YAML::Node& node, const std::string& key,
                             const std::string& expected) {
  fail("{}key '{}' must be {}, got {}", ctx.at(node.Mark()), key, expected, describe(node));
}

std::optional<int64_t> parse_int(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' ||
      std::isspace(static_cast<unsigned char>(text[0]))) {
    return std::nullopt;
  }
  return static_cast<int64_t>(value);
}

std::optional<double> parse_float(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || *end != '\0' || !std::isfinite(value)) return std::nullopt;
  return value;
}

std::optional<bool> parse_bool(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text == "true" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "no" || text == "off") return false;
  return std::nullopt;
}

int64_t read_int64(const YAML::Node& node, const std::string& key, const Context& ctx) {
  if (!node.IsScalar()) wrong_type(ctx, node, key, "an integer");
  auto value = parse_int(node.Scalar());
  if (!value) wrong_type(ctx, node, key, "an integer");
  return *value;
}

int read_int(const YAML::Node& node, const std::string& key, const Context& ctx) {
  int64_t value = read_int64(node, key, ctx);
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
    fail("{}key '{}' is out of range, got {}", ctx.at(node.Mark()), key, value);
  }
  return static_cast<int>(value);
}

double read_float(const YAML::Node& node, const std::string& key, const Context& ctx) {
  if (!node.IsScalar()) wrong_type(ctx, node, key, "a number");
  auto value = parse_float(node.Scalar());
  if (!value) wrong_type(ctx, node, key, "a number");
  return *value;
}

bool read_bool(const YAML::Node& node, const std::string& key, const Context& ctx) {
  if (!node.IsScalar()) wrong_type(ctx, node, key, "true or false");
  auto value = parse_bool(node.Scalar());
  if (!value) wrong_type(ctx, node, key, "true or false");
  return *value;
}

std::string read_string(const YAML::Node& node, const std::string& key, const Context& ctx) {
  if (!node.IsScalar()) wrong_type(ctx, node, key, "a string");
  return node.Scalar();
}

void read_value(const YAML::Node& n, const std::string& key, const Context& ctx, int& out) {
  out = read_int(n, key, ctx);
}
void read_value(const YAML::Node& n, const std::string& key, const Context& ctx, int64_t& out) {
  out = read_int64(n, key, ctx);
}
void read_value(const YAML::Node& n, const std::string& key, const Context& ctx, double& out) {
  out = read_float(n, key, ctx);
}
void read_value(const YAML::Node& n, const std::string& key, const Context& ctx, bool& out) {
  out = read_bool(n, key, ctx);
}
void read_value(const YAML::Node& n, const std::string& key, const Context& ctx, std::string& out) {
  out = read_string(n, key, ctx);
}

void emit_value(YAML::Emitter& out, int v) { out << v; }
void emit_value(YAML::Emitter& out, int64_t v) { out << static_cast<long long>(v); }
void emit_value(YAML::Emitter& out, double v) { out << float_text(v); }
void emit_value(YAML::Emitter& out, bool v) { out << (v ? "true" : "false"); }
void emit_value(YAML::Emitter& out, const std::string& v) { out << v; }

[[noreturn]] void unknown_key(const Context& ctx, const YAML::Mark& mark, const std::string& section,
                              const std::string& key, const std::vector<std::string>& candidates,
                              const std::string& elsewhere = "") {
  std::string suggestion = did_you_mean(key, candidates);
  if (suggestion.empty()) suggestion = elsewhere;
  fail("{}unknown key '{}{}'{}", ctx.at(mark), section, key,
       suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion));
}

// Calls `visit(key, key_node, value_node)` for each entry of a mapping, with hyphens in keys
// read as underscores (the `--batch-size` flag spelling) and duplicates refused.
void for_each_entry(
    const YAML::Node& map, const std::string& section, const Context& ctx,
    const std::function<void(const std::string&, const YAML::Node&, const YAML::Node&)>& visit) {
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    // Copies: the iterator hands out a temporary pair.
    const YAML::Node key_node = it->first;
    const YAML::Node value_node = it->second;
    if (!key_node.IsScalar())
      fail("{}keys under '{}' must be plain names", ctx.at(key_node.Mark()),
           section.empty() ? "the top level" : section.substr(0, section.size() - 1));
    std::string key = key_node.Scalar();
    std::replace(key.begin(), key.end(), '-', '_');
    if (!seen.insert(key).second) fail("{}key '{}{}' is given twice", ctx.at(key_node.Mark()), section, key);
    visit(key, key_node, value_node);
  }
}

// A section (data, params, column_mapping): a mapping, or empty.
bool check_section(const YAML::Node& node, const std::string& key, const Context& ctx) {
  if (node.IsNull()) return false;
  if (!node.IsMap()) wrong_type(ctx, node, key, "a mapping");
  return true;
}

// ---------------------------------------------------------------------------------------
// params: the typed fields of struct Params, in the order to_yaml writes them.

struct ParamField {
  std::string name;
  std::function<void(Params&, const YAML::Node&, const std::string&, const Context&)> read;
  std::function<void(YAML::Emitter&, const Params&)> write;  // empty: never written (token)
};

template <typename T>
ParamField plain(const char* name, T Params::*member) {
  return {name,
          [member](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
            read_value(n, key, ctx, p.*member);
          },
          [member](YAML::Emitter& out, const Params& p) { emit_value(out, p.*member); }};
}

const std::vector<ParamField>& param_fields() {
  static const std::vector<ParamField> fields = [] {
    std::vector<ParamField> f;
    f.push_back({"distributed_backend",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   // null (AutoTrain's default) means plain DDP; DeepSpeed users say deepspeed.
                   p.distributed_backend = n.IsNull() ? "ddp" : read_string(n, key, ctx);
                   if (p.distributed_backend == "deepspeed") p.distributed_backend = "zero3";
                 },
                 [](YAML::Emitter& out, const Params& p) { out << p.distributed_backend; }});
    f.push_back({"nproc_per_node",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   if (n.IsScalar() && n.Scalar() == "auto") {
                     p.nproc_per_node = 0;
                     return;
                   }
                   auto value = n.IsScalar() ? parse_int(n.Scalar()) : std::nullopt;
                   if (!value || *value < 1 || *value > std::numeric_limits<int>::max()) {
                     wrong_type(ctx, n, key, "a positive integer or 'auto'");
                   }
                   p.nproc_per_node = static_cast<int>(*value);
                 },
                 [](YAML::Emitter& out, const Params& p) {
                   if (p.nproc_per_node == 0) {
                     out << "auto";
                   } else {
                     out << p.nproc_per_node;
                   }
                 }});
    f.push_back(plain("master_addr", &Params::master_addr));
    f.push_back(plain("master_port", &Params::master_port));
    f.push_back(plain("rdzv_timeout", &Params::rdzv_timeout));
    f.push_back(plain("collective_timeout", &Params::collective_timeout));
    f.push_back(plain("max_restarts", &Params::max_restarts));
    f.push_back(plain("deterministic", &Params::deterministic));
    f.push_back(plain("stage3_prefetch_bucket_size", &Params::stage3_prefetch_bucket_size));
    f.push_back(plain("stage3_param_persistence_threshold", &Params::stage3_param_persistence_threshold));
    f.push_back(plain("stage3_max_live_parameters", &Params::stage3_max_live_parameters));
    f.push_back(plain("reduce_bucket_size", &Params::reduce_bucket_size));
    f.push_back(plain("overlap_comm", &Params::overlap_comm));
    f.push_back({"shard_optimizer",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   // auto (or null): decided by the trainer from where the workers run.
                   if (n.IsNull() || (n.IsScalar() && n.Scalar() == "auto")) {
                     p.shard_optimizer.reset();
                     return;
                   }
                   auto value = n.IsScalar() ? parse_bool(n.Scalar()) : std::nullopt;
                   if (!value) wrong_type(ctx, n, key, "true, false or 'auto'");
                   p.shard_optimizer = *value;
                 },
                 [](YAML::Emitter& out, const Params& p) {
                   if (p.shard_optimizer) {
                     out << *p.shard_optimizer;
                   } else {
                     out << "auto";
                   }
                 }});
    f.push_back({"token",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   p.token = read_string(n, key, ctx);
                 },
                 nullptr});  // a secret: never written back out
    f.push_back(plain("epochs", &Params::epochs));
    f.push_back(plain("max_steps", &Params::max_steps));
    f.push_back(plain("batch_size", &Params::batch_size));
    f.push_back(plain("gradient_accumulation", &Params::gradient_accumulation));
    f.push_back({"mixed_precision",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   // AutoTrain writes null for "no mixed precision", Accelerate writes "no".
                   std::string value = n.IsNull() ? "fp32" : read_string(n, key, ctx);
                   if (value == "no" || value == "none") value = "fp32";
                   p.mixed_precision = value;
                 },
                 [](YAML::Emitter& out, const Params& p) { out << p.mixed_precision; }});
    f.push_back({"optimizer",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   // AutoTrain's default spelling of the same optimizer.
                   p.optimizer = read_string(n, key, ctx);
                   if (p.optimizer == "adamw_torch") p.optimizer = "adamw";
                 },
                 [](YAML::Emitter& out, const Params& p) { out << p.optimizer; }});
    f.push_back(plain("lr", &Params::lr));
    f.push_back(plain("momentum", &Params::momentum));
    f.push_back(plain("weight_decay", &Params::weight_decay));
    f.push_back(plain("warmup_steps", &Params::warmup_steps));
    f.push_back(plain("warmup_ratio", &Params::warmup_ratio));
    f.push_back(plain("scheduler", &Params::scheduler));
    f.push_back(plain("max_grad_norm", &Params::max_grad_norm));
    f.push_back(plain("shuffle", &Params::shuffle));
    f.push_back(plain("seed", &Params::seed));
    f.push_back(plain("eval_every", &Params::eval_every));
    f.push_back(plain("checkpoint_every", &Params::checkpoint_every));
    f.push_back(plain("save_total_limit", &Params::save_total_limit));
    f.push_back(plain("threads_per_worker", &Params::threads_per_worker));
    f.push_back({"logging_steps",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   // AutoTrain's -1 means "pick for me"; replica picks the default.
                   p.logging_steps = read_int64(n, key, ctx);
                   if (p.logging_steps == -1) p.logging_steps = Params{}.logging_steps;
                 },
                 [](YAML::Emitter& out, const Params& p) { emit_value(out, p.logging_steps); }});
    f.push_back(plain("overwrite", &Params::overwrite));
    f.push_back(plain("timeline", &Params::timeline));
    f.push_back({"hidden_sizes",
                 [](Params& p, const YAML::Node& n, const std::string& key, const Context& ctx) {
                   if (!n.IsSequence()) wrong_type(ctx, n, key, "a list of positive integers");
                   p.hidden_sizes.clear();
                   for (const auto& item : n) {
                     int64_t size = read_int64(item, key, ctx);
                     if (size < 1) wrong_type(ctx, item, key, "a list of positive integers");
                     p.hidden_sizes.push_back(size);
                   }
                 },
                 [](YAML::Emitter& out, const Params& p) {
                   out << YAML::Flow << YAML::BeginSeq;
                   for (int64_t size : p.hidden_sizes) out << static_cast<long long>(size);
                   out << YAML::EndSeq;
                 }});
    f.push_back(plain("sync_batchnorm", &Params::sync_batchnorm));
    f.push_back(plain("augment", &Params::augment));
    f.push_back(plain("resnet_stem", &Params::resnet_stem));
    f.push_back(plain("embedding_dim", &Params::embedding_dim));
    f.push_back(plain("temperature", &Params::temperature));
    f.push_back(plain("top_k", &Params::top_k));
    return f;
  }();
  return fields;
}

std::vector<std::string> param_names() {
  std::vector<std::string> names;
  for (const auto& field : param_fields()) names.push_back(field.name);
  return names;
}

// ---------------------------------------------------------------------------------------
// params: AutoTrain's LLM keys, kept as text in Params::extra (task llm-sft only).

enum class Kind { Int, Float, Bool, String };

struct LlmKey {
  const char* name;
  Kind kind;
  const char* default_text;
  std::vector<std::string> allowed;  // enumerations (String only)
};

const std::vector<LlmKey>& llm_keys() {
  static const std::vector<LlmKey> keys = {
      {"trainer", Kind::String, "sft", {"sft"}},
      {"peft", Kind::Bool, "false", {}},
      {"lora_r", Kind::Int, "16", {}},
      {"lora_alpha", Kind::Int, "32", {}},
      {"lora_dropout", Kind::Float, "0.05", {}},
      {"target_modules", Kind::String, "all-linear", {}},
      {"merge_adapter", Kind::Bool, "false", {}},
      {"model_max_length", Kind::Int, "2048", {}},
      {"block_size", Kind::Int, "-1", {}},  // -1: model_max_length
      {"padding", Kind::String, "right", {"right", "left"}},
      {"add_eos_token", Kind::Bool, "true", {}},
      // AutoTrain's int4 default needs bitsandbytes on CUDA; replica trains unquantized
      // unless asked.
      {"quantization", Kind::String, "none", {"none", "int4", "int8"}},
      {"disable_gradient_checkpointing", Kind::Bool, "false", {}},
      {"use_flash_attention_2", Kind::Bool, "false", {}},
      {"unsloth", Kind::Bool, "false", {}},
  };
  return keys;
}

const LlmKey* find_llm_key(const std::string& name) {
  for (const auto& k : llm_keys()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

// The key's text, normalised, or nullopt when it is not of the key's kind.
std::optional<std::string> normalize_llm_value(const LlmKey& spec, const std::string& text) {
  switch (spec.kind) {
    case Kind::Int: {
      auto v = parse_int(text);
      return v ? std::optional<std::string>(std::to_string(*v)) : std::nullopt;
    }
    case Kind::Float: {
      auto v = parse_float(text);
      return v ? std::optional<std::string>(float_text(*v)) : std::nullopt;
    }
    case Kind::Bool: {
      auto v = parse_bool(text);
      return v ? std::optional<std::string>(*v ? "true" : "false") : std::nullopt;
    }
    case Kind::String:
      return text;
  }
  return std::nullopt;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::Int:
      return "an integer";
    case Kind::Float:
      return "a number";
    case Kind::Bool:
      return "true or false";
    case Kind::String:
      return "a string";
  }
  return "";
}

std::string read_llm_value(const LlmKey& spec, const YAML::Node& n, const std::string& key,
                           const Context& ctx) {
  const std::string name = spec.name;
  if (name == "quantization" && n.IsNull()) return "none";
  if (name == "target_modules" && n.IsSequence()) {
    // PEFT takes a list; AutoTrain a comma-separated string. Keep AutoTrain's form.
    std::string joined;
    for (const auto& item : n) joined += (joined.empty() ? "" : ",") + read_string(item, key, ctx);
    return joined;
  }
  if (!n.IsScalar()) wrong_type(ctx, n, key, kind_name(spec.kind));
  std::string text = n.Scalar();
  if (name == "trainer" && text == "default") text = "sft";  // AutoTrain's name for plain SFT
  auto value = normalize_llm_value(spec, text);
  if (!value) wrong_type(ctx, n, key, kind_name(spec.kind));
  return *value;
}

// ---------------------------------------------------------------------------------------
// Value checks, shared by parse_config and validate_config.

void check_enum(const Context& ctx, const std::string& key, const std::string& value,
                const std::vector<std::string>& allowed, const std::string& shown = "") {
  // No "did you mean" here: the list is short and a near value (fp16, fp32) is rarely a typo.
  if (contains(allowed, value)) return;
  fail("{}key '{}' must be one of {}, got '{}'", ctx.where(key), key, shown.empty() ? join(allowed) : shown,
       value);
}

template <typename T>
void check_at_least(const Context& ctx, const std::string& key, T value, T min) {
  if (value < min) fail("{}key '{}' must be >= {}, got {}", ctx.where(key), key, min, value);
}

void check_positive(const Context& ctx, const std::string& key, double value) {
  if (!(value > 0)) fail("{}key '{}' must be > 0, got {}", ctx.where(key), key, value);
}

void check_path(const Context& ctx, const std::string& key, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("{}{} '{}' does not exist", ctx.where(key), key, path);
}

void check_llm_extra(const RunConfig& c, const Context& ctx) {
  for (const auto& [name, text] : c.params.extra) {
    const std::string key = "params." + name;
    const LlmKey* spec = find_llm_key(name);
    if (spec == nullptr) {
      std::vector<std::string> names;
      for (const auto& k : llm_keys()) names.push_back(k.name);
      std::string suggestion = did_you_mean(name, names);
      fail("{}unknown key '{}'{}", ctx.where(key), key,
           suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion));
    }
    if (c.task != "llm-sft") fail("{}key '{}' applies only to task llm-sft", ctx.where(key), key);
    if (!normalize_llm_value(*spec, text)) {
      fail("{}key '{}' must be {}, got '{}'", ctx.where(key), key, kind_name(spec->kind), text);
    }
    if (!spec->allowed.empty()) check_enum(ctx, key, text, spec->allowed);
  }
  if (c.task != "llm-sft") return;
  auto int_of = [&](const char* name) { return parse_int(c.params.extra.at(name)).value(); };
  for (const auto& spec : llm_keys()) {
    if (!c.params.extra.count(spec.name)) fail("{}key 'params.{}' is missing", ctx.where(""), spec.name);
  }
  check_at_least<int64_t>(ctx, "params.lora_r", int_of("lora_r"), 1);
  check_at_least<int64_t>(ctx, "params.lora_alpha", int_of("lora_alpha"), 1);
  check_at_least<int64_t>(ctx, "params.model_max_length", int_of("model_max_length"), 1);
  const double dropout = parse_float(c.params.extra.at("lora_dropout")).value();
  if (dropout < 0 || dropout >= 1) {
    fail("{}key 'params.lora_dropout' must be in [0, 1), got {}", ctx.where("params.lora_dropout"), dropout);
  }
  const int64_t block_size = int_of("block_size");
  if (block_size != -1 && block_size < 1) {
    fail("{}key 'params.block_size' must be -1 (model_max_length) or >= 1, got {}",
         ctx.where("params.block_size"), block_size);
  }
}

void check_config(const RunConfig& c, const Context& ctx) {
  check_enum(ctx, "task", c.task, kTasks);
  check_enum(ctx, "backend", c.backend, {"local"});
  if (c.task == "llm-sft") {
    if (c.base_model.empty()) fail("{}base_model is required for task llm-sft", ctx.where("base_model"));
    check_path(ctx, "base_model", c.base_model);
  } else {
    if (!c.base_model.empty())
      fail("{}key 'base_model' applies only to task llm-sft", ctx.where("base_model"));
    check_enum(ctx, "model", c.model,
               c.task == "two-tower" ? std::vector<std::string>{"two-tower"}
                                     : std::vector<std::string>{"mlp", "resnet18"});
  }
  if (c.project_name.empty()) {
    fail("{}project_name is required (the output directory of the run)", ctx.where("project_name"));
  }
  if (c.log == "wandb") {
    fail("{}log 'wandb' is not available in replica (no Weights & Biases client); use one of {}",
         ctx.where("log"), join(kLogs));
  }
  check_enum(ctx, "log", c.log, kLogs);

  const DataConfig& d = c.data;
  if (d.path.empty()) fail("{}data.path is required for task {}", ctx.where("data.path"), c.task);
  check_path(ctx, "data.path", d.path);
  if (d.train_split.empty())
    fail("{}key 'data.train_split' must not be empty", ctx.where("data.train_split"));
  if (d.valid_split && d.valid_split->empty()) {
    fail("{}key 'data.valid_split' must not be empty (null turns evaluation off)",
         ctx.where("data.valid_split"));
  }
  check_enum(ctx, "data.chat_template", d.chat_template, kChatTemplates);
  for (const auto& [name, column] : d.column_mapping) {
    const std::string key = "data.column_mapping." + name;
    check_enum(ctx, key, name, kColumnKeys);  // never fails for parsed configs
    if (column.empty()) fail("{}key '{}' must not be empty", ctx.where(key), key);
  }

  const Params& p = c.params;
  check_enum(ctx, "params.distributed_backend", p.distributed_backend, {"ddp", "zero3"},
             "null, ddp, deepspeed, zero3");
  check_at_least(ctx, "params.nproc_per_node", p.nproc_per_node, 0);
  if (p.master_addr.empty())
    fail("{}key 'params.master_addr' must not be empty", ctx.where("params.master_addr"));
  if (p.master_port < 0 || p.master_port > 65535) {
    fail("{}key 'params.master_port' must be a port number 0-65535, got {}", ctx.where("params.master_port"),
         p.master_port);
  }
  check_positive(ctx, "params.rdzv_timeout", p.rdzv_timeout);
  check_positive(ctx, "params.collective_timeout", p.collective_timeout);
  for (const auto& [key, value] : {std::pair<const char*, double>{"params.stage3_prefetch_bucket_size", p.stage3_prefetch_bucket_size},
                                   {"params.stage3_param_persistence_threshold", p.stage3_param_persistence_threshold},
                                   {"params.stage3_max_live_parameters", p.stage3_max_live_parameters},
                                   {"params.reduce_bucket_size", p.reduce_bucket_size}}) {
    check_at_least(ctx, key, value, 0.0);
  }
  check_at_least(ctx, "params.max_restarts", p.max_restarts, 0);
  check_at_least(ctx, "params.epochs", p.epochs, 1);
  if (p.max_steps != -1 && p.max_steps < 1) {
    fail("{}key 'params.max_steps' must be -1 (off) or >= 1, got {}", ctx.where("params.max_steps"),
         p.max_steps);
  }
  check_at_least(ctx, "params.batch_size", p.batch_size, 1);
  check_at_least(ctx, "params.gradient_accumulation", p.gradient_accumulation, 1);
  check_enum(ctx, "params.mixed_precision", p.mixed_precision, {"fp32", "bf16"});
  check_enum(ctx, "params.optimizer", p.optimizer, {"sgd", "adamw"});
  check_positive(ctx, "params.lr", p.lr);
  check_at_least(ctx, "params.momentum", p.momentum, 0.0);
  check_at_least(ctx, "params.weight_decay", p.weight_decay, 0.0);
  check_at_least<int64_t>(ctx, "params.warmup_steps", p.warmup_steps, 0);
  if (p.warmup_ratio < 0 || p.warmup_ratio >= 1) {
    fail("{}key 'params.warmup_ratio' must be in [0, 1), got {}", ctx.where("params.warmup_ratio"),
         p.warmup_ratio);
  }
  check_enum(ctx, "params.scheduler", p.scheduler, {"constant", "linear", "cosine"});
  check_at_least<int64_t>(ctx, "params.seed", p.seed, 0);
  check_at_least<int64_t>(ctx, "params.eval_every", p.eval_every, 0);
  check_at_least<int64_t>(ctx, "params.checkpoint_every", p.checkpoint_every, 0);
  check_at_least(ctx, "params.threads_per_worker", p.threads_per_worker, 0);
  check_at_least<int64_t>(ctx, "params.logging_steps", p.logging_steps, 1);
  for (int64_t size : p.hidden_sizes) check_at_least<int64_t>(ctx, "params.hidden_sizes", size, 1);
  check_enum(ctx, "params.resnet_stem", p.resnet_stem, {"imagenet", "pooled", "small"});
  check_at_least<int64_t>(ctx, "params.embedding_dim", p.embedding_dim, 1);
  check_positive(ctx, "params.temperature", p.temperature);
  check_at_least<int64_t>(ctx, "params.top_k", p.top_k, 1);
  check_llm_extra(c, ctx);
}

// ---------------------------------------------------------------------------------------
// Reading the sections.

void read_data(const YAML::Node& node, RunConfig& c, Context& ctx) {
  if (!check_section(node, "data", ctx)) return;
  for_each_entry(node, "data.", ctx, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    const std::string path = "data." + key;
    ctx.lines[path] = k.Mark().line + 1;
    if (key == "path") {
      c.data.path = read_string(v, path, ctx);
    } else if (key == "train_split") {
      c.data.train_split = read_string(v, path, ctx);
    } else if (key == "valid_split") {
      if (v.IsNull()) {
        c.data.valid_split.reset();
      } else {
        c.data.valid_split = read_string(v, path, ctx);
      }
    } else if (key == "chat_template") {
      c.data.chat_template = v.IsNull() ? "none" : read_string(v, path, ctx);
    } else if (key == "column_mapping") {
      // A mapping given replaces the task's default one as a whole.
      c.data.column_mapping.clear();
      if (!check_section(v, path, ctx)) return;
      for_each_entry(v, "data.column_mapping.", ctx,
                     [&](const std::string& column, const YAML::Node& ck, const YAML::Node& cv) {
                       const std::string column_path = path + "." + column;
                       if (!contains(kColumnKeys, column)) {
                         unknown_key(ctx, ck.Mark(), "data.column_mapping.", column, kColumnKeys);
                       }
                       ctx.lines[column_path] = ck.Mark().line + 1;
                       c.data.column_mapping[column] = read_string(cv, column_path, ctx);
                     });
    } else {
      unknown_key(ctx, k.Mark(), "data.", key, kDataKeys);
    }
  });
}

// AutoTrain's flat LLMTrainingParams also carry chat_template and text_column; replica keeps
// them in `data:`, so a params twin is applied there after both sections are read.
struct ParamsTwins {
  std::optional<std::string> chat_template;
  std::optional<std::string> text_column;
};

void read_params(const YAML::Node& node, RunConfig& c, Context& ctx, ParamsTwins& twins) {
  if (!check_section(node, "params", ctx)) return;
  const bool llm = c.task == "llm-sft";
  std::vector<std::string> candidates = param_names();
  if (llm) {
    for (const auto& k : llm_keys()) candidates.push_back(k.name);
    candidates.push_back("chat_template");
    candidates.push_back("text_column");
  }
  const auto& fields = param_fields();
  for_each_entry(node, "params.", ctx, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    const std::string path = "params." + key;
    ctx.lines[path] = k.Mark().line + 1;
    auto field =
        std::find_if(fields.begin(), fields.end(), [&](const ParamField& f) { return f.name == key; });
    if (field != fields.end()) {
      field->read(c.params, v, path, ctx);
      return;
    }
    const LlmKey* spec = find_llm_key(key);
    const bool twin = key == "chat_template" || key == "text_column";
    if ((spec != nullptr || twin) && !llm) {
      fail("{}key '{}' applies only to task llm-sft", ctx.at(k.Mark()), path);
    }
    if (spec != nullptr) {
      c.params.extra[key] = read_llm_value(*spec, v, path, ctx);
    } else if (key == "chat_template") {
      twins.chat_template = v.IsNull() ? "none" : read_string(v, path, ctx);
    } else if (key == "text_column") {
      twins.text_column = read_string(v, path, ctx);
    } else {
      // A top-level or data key put under params by mistake is named with its section.
      std::string elsewhere = contains(kDataKeys, key) ? "data." + key : contains(kTopKeys, key) ? key : "";
      unknown_key(ctx, k.Mark(), "params.", key, candidates, elsewhere);
    }
  });
}

void apply_twins(RunConfig& c, const Context& ctx, const ParamsTwins& twins) {
  auto apply = [&](const std::optional<std::string>& twin, const std::string& data_key, std::string& target) {
    if (!twin) return;
    const std::string param_key = "params." + data_key.substr(data_key.rfind('.') + 1);
    if (ctx.lines.count(data_key) && target != *twin) {
      fail("{}key '{}' is '{}' but '{}' is '{}'; give one of them", ctx.where(param_key), param_key, *twin,
           data_key, target);
    }
    target = *twin;
  };
  apply(twins.chat_template, "data.chat_template", c.data.chat_template);
  if (twins.text_column) {
    apply(twins.text_column, "data.column_mapping.text_column", c.data.column_mapping["text_column"]);
  }
}

int levenshtein(const std::string& a, const std::string& b) {
  std::vector<int> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int diagonal = row[0];
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      int above = row[j];
      int cost = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                         std::tolower(static_cast<unsigned char>(b[j - 1]))
                     ? 0
                     : 1;
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + cost});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

// ---------------------------------------------------------------------------------------

bool operator==(const DataConfig& a, const DataConfig& b) {
  return std::tie(a.path, a.train_split, a.valid_split, a.chat_template, a.column_mapping) ==
         std::tie(b.path, b.train_split, b.valid_split, b.chat_template, b.column_mapping);
}

bool operator==(const Params& a, const Params& b) {
  auto fields = [](const Params& p) {
    return std::tie(p.distributed_backend, p.nproc_per_node, p.master_addr, p.master_port, p.rdzv_timeout,
                    p.collective_timeout, p.max_restarts, p.deterministic, p.stage3_prefetch_bucket_size,
                    p.stage3_param_persistence_threshold, p.stage3_max_live_parameters, p.reduce_bucket_size,
                    p.overlap_comm, p.shard_optimizer, p.token, p.epochs, p.max_steps,
                    p.batch_size, p.gradient_accumulation, p.mixed_precision, p.optimizer, p.lr, p.momentum,
                    p.weight_decay, p.warmup_steps, p.warmup_ratio, p.scheduler, p.max_grad_norm, p.shuffle,
                    p.seed, p.eval_every, p.checkpoint_every, p.save_total_limit, p.threads_per_worker,
                    p.logging_steps, p.overwrite, p.hidden_sizes, p.sync_batchnorm, p.augment, p.resnet_stem,
                    p.embedding_dim, p.temperature, p.top_k, p.extra);
  };
  return fields(a) == fields(b);
}

bool operator==(const RunConfig& a, const RunConfig& b) {
  return std::tie(a.task, a.backend, a.model, a.base_model, a.project_name, a.log, a.data, a.params) ==
         std::tie(b.task, b.backend, b.model, b.base_model, b.project_name, b.log, b.data, b.params);
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates) {
  if (key.empty()) return "";
  const int limit = std::max<int>(2, static_cast<int>(key.size()) / 3);
  std::string best;
  int best_distance = std::numeric_limits<int>::max();
  for (const auto& candidate : candidates) {
    int distance = levenshtein(key, candidate);
    // Replacing every character is no typo, however short the words.
    if (distance >= static_cast<int>(std::max(key.size(), candidate.size()))) continue;
    if (distance <= limit && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

RunConfig default_config(const std::string& task) {
  RunConfig c;
  c.task = task;
  if (task == "image-classification") {
    c.model = "mlp";
    c.data.path = kFashionMnistDir;
    c.data.valid_split = "t10k";
  } else if (task == "llm-sft") {
    // AutoTrain's LLMTrainingParams defaults.
    c.model = "";
    c.data.column_mapping = {{"text_column", "text"}};
    Params& p = c.params;
    p.lr = 3e-5;
    p.epochs = 1;
    p.batch_size = 2;
    p.gradient_accumulation = 4;
    p.warmup_ratio = 0.1;
    p.optimizer = "adamw";
    p.scheduler = "linear";
    p.weight_decay = 0.0;
    p.max_grad_norm = 1.0;
    p.seed = 42;
    p.mixed_precision = "fp32";  // AutoTrain's default is none
    p.save_total_limit = 1;
    for (const auto& k : llm_keys()) p.extra[k.name] = k.default_text;
  } else if (task == "two-tower") {
    c.model = "two-tower";
    c.data.valid_split = "valid";       // the split directories `replica mds synthetic` writes
    c.params.batch_size = 128;          // in-batch negatives: a larger batch, more negatives
    c.params.hidden_sizes = {64};       // tower MLP
  } else {
    fail("unknown task '{}'; use one of {}", task, join(kTasks));
  }
  return c;
}

void validate_config(const RunConfig& config) { check_config(config, Context{config.source, {}, true}); }

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
  Context ctx{"", {}, false};
  ParamsTwins twins;
  read_params(params, config, ctx, twins);
  if (twins.chat_template) config.data.chat_template = *twins.chat_template;
  if (twins.text_column) config.data.column_mapping["text_column"] = *twins.text_column;
}

RunConfig parse_config(const std::string& yaml_text, const std::string& source_name) {
  Context ctx{source_name, {}, true};
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail("{}invalid YAML: {}", ctx.at(e.mark), e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);  // empty file: missing keys below
  if (!root.IsMap()) fail("{}the configuration must be a mapping of keys to values", ctx.at(root.Mark()));

  // The task decides the defaults and which keys exist, so it is read first.
  std::string task = "image-classification";
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it->first.IsScalar() && it->first.Scalar() == "task") {
      task = read_string(it->second, "task", ctx);
      ctx.lines["task"] = it->first.Mark().line + 1;
    }
  }
  check_enum(ctx, "task", task, kTasks);
  RunConfig c = default_config(task);
  c.source = source_name;

  ParamsTwins twins;
  std::vector<std::string> params = param_names();
  for_each_entry(root, "", ctx, [&](const std::string& key, const YAML::Node& k, const YAML::Node& v) {
    ctx.lines[key] = k.Mark().line + 1;
    if (key == "task") {
      // read above
    } else if (key == "backend") {
      c.backend = read_string(v, key, ctx);
    } else if (key == "base_model") {
      if (task != "llm-sft")
        fail("{}key 'base_model' applies only to task llm-sft (use 'model')", ctx.at(k.Mark()));
      c.base_model = read_string(v, key, ctx);
    } else if (key == "model") {
      if (task == "llm-sft")
        fail("{}key 'model' is for image and two-tower tasks; llm-sft takes 'base_model'", ctx.at(k.Mark()));
      c.model = read_string(v, key, ctx);
    } else if (key == "project_name") {
      c.project_name = read_string(v, key, ctx);
    } else if (key == "log") {
      c.log = read_string(v, key, ctx);
    } else if (key == "data") {
      read_data(v, c, ctx);
    } else if (key == "params") {
      read_params(v, c, ctx, twins);
    } else {
      std::string elsewhere = contains(params, key)      ? "params." + key
                              : contains(kDataKeys, key) ? "data." + key
                                                         : "";
      unknown_key(ctx, k.Mark(), "", key, kTopKeys, elsewhere);
    }
  });
  apply_twins(c, ctx, twins);
  check_config(c, ctx);
  return c;
}

RunConfig load_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read config file: {}", path, std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{}: cannot read config file: {}", path, std::strerror(errno));
  return parse_config(text.str(), path);
}

std::string to_yaml(const RunConfig& c) {
  YAML::Emitter out;
  out.SetNullFormat(YAML::LowerNull);
  out << YAML::BeginMap;
  out << YAML::Key << "task" << YAML::Value << c.task;
  out << YAML::Key << "backend" << YAML::Value << c.backend;
  if (c.task == "llm-sft") {
    out << YAML::Key << "base_model" << YAML::Value << c.base_model;
  } else {
    out << YAML::Key << "model" << YAML::Value << c.model;
  }
  out << YAML::Key << "project_name" << YAML::Value << c.project_name;

  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "path" << YAML::Value << c.data.path;
  out << YAML::Key << "train_split" << YAML::Value << c.data.train_split;
  out << YAML::Key << "valid_split" << YAML::Value;
  if (c.data.valid_split) {
    out << *c.data.valid_split;
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "chat_template" << YAML::Value << c.data.chat_template;
  out << YAML::Key << "column_mapping" << YAML::Value << YAML::BeginMap;
  for (const auto& [name, column] : c.data.column_mapping) out << YAML::Key << name << YAML::Value << column;
  out << YAML::EndMap;
  out << YAML::EndMap;

  out << YAML::Key << "log" << YAML::Value << c.log;

  out << YAML::Key << "params" << YAML::Value << YAML::BeginMap;
  for (const auto& field : param_fields()) {
    if (!field.write) continue;
    out << YAML::Key << field.name << YAML::Value;
    field.write(out, c.params);
  }
  for (const auto& [name, text] : c.params.extra) out << YAML::Key << name << YAML::Value << text;
  out << YAML::EndMap;

  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace replica::io
