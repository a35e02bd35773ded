// Chat template API: built-in templates, the `chat_template:` resolver and the render entry
// points over the Jinja interpreter in jinja/*.cpp (jinja/jinja.h).
#include "replica/text/chat_template.h"

#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

namespace replica::text {

namespace fs = std::filesystem;

const char* const kChatmlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

const char* const kLlama3Template =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

// AutoTrain's ZEPHYR_CHAT_TEMPLATE (autotrain/trainers/clm/utils.py, 0.8.36), character for
// character: rendered with trim_blocks and lstrip_blocks as transformers renders every template.
const char* const kZephyrTemplate =
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token "
    "}}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token "
    "}}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% "
    "endfor %}";

namespace {

// Real chat templates are at most tens of KB (Qwen3-Coder's ~6 KB, the largest of the
// fixtures); parsing holds a few times the source's size in tokens and tree. Far above the
// real ones, far below what could exhaust memory.
constexpr size_t kMaxTemplateBytes = size_t{4} << 20;
nlohmann::json read_config(const std::string& path) {
  return parse_json(read_file(path, kMaxTokenizerConfigBytes), path);
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::string origin) : origin_(std::move(origin)) {
  try {
    if (source.size() > kMaxTemplateBytes) {
      throw ChatTemplateError(ChatTemplateError::Kind::Syntax,
                              "chat template is " + std::to_string(source.size()) + " bytes, more than the " +
                                  std::to_string(kMaxTemplateBytes >> 20) + " MiB a chat template may have");
    }
    program_ = detail::jinja_parse(source);
  } catch (const ChatTemplateError& e) {
    rethrow_located(e);
  }
}

ChatTemplate::ChatTemplate(const ChatTemplateSource& source) : ChatTemplate(source.text, source.origin) {}

void ChatTemplate::rethrow_located(const ChatTemplateError& e) const {
  if (origin_.empty()) throw e;
  // A syntax error's message names its line already.
  std::string where = origin_;
  if (e.kind() != ChatTemplateError::Kind::Syntax && e.line() > 0) where += ": line " + std::to_string(e.line());
  throw ChatTemplateError(e.kind(), where + ": " + e.what(), e.line());
}

namespace {

// Inputs nested deeper than this are refused before they are copied or converted (both
// recurse): JSON read through parse_json is at most kMaxJsonDepth deep, and the context
// wraps it one level more.
constexpr int kMaxInputDepth = kMaxJsonDepth + 2;

template <typename Json>
void check_input_depth(const Json& root, const char* what) {
  std::vector<std::pair<const Json*, int>> todo{{&root, 1}};
  while (!todo.empty()) {
    auto [j, depth] = todo.back();
    todo.pop_back();
    if (!j->is_structured()) continue;
    if (depth > kMaxInputDepth) {
      throw ChatTemplateError(ChatTemplateError::Kind::Type,
                              std::string("chat template: ") + what + " nested more than " +
                                  std::to_string(kMaxInputDepth) + " levels deep");
    }
    for (const auto& x : *j) todo.emplace_back(&x, depth + 1);
  }
}

nlohmann::ordered_json chat_context(nlohmann::ordered_json messages, bool add_generation_prompt,
                                    const nlohmann::ordered_json& extra) {
  // transformers: render(messages=chat, tools=tools, documents=documents,
  //                      add_generation_prompt=..., **special_tokens_map, **kwargs)
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = std::move(messages);
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) ctx[it.key()] = it.value();
  } else if (!extra.is_null()) {
    throw ChatTemplateError(ChatTemplateError::Kind::Type,
                            "chat template: extra_context must be a JSON object, not " +
                                std::string(extra.type_name()));
  }
  return ctx;
}

}  // namespace

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                 const nlohmann::json& extra_context) const {
  try {
    check_input_depth(messages, "messages");
    check_input_depth(extra_context, "extra context");
  } catch (const ChatTemplateError& e) {
    rethrow_located(e);
  }
  return render(nlohmann::ordered_json(messages), add_generation_prompt,
                nlohmann::ordered_json(extra_context));
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages,
                                 bool add_generation_prompt,
                                 const nlohmann::ordered_json& extra_context) const {
  try {
    check_input_depth(messages, "messages");
    check_input_depth(extra_context, "extra context");
    return detail::jinja_render(*program_, chat_context(messages, add_generation_prompt, extra_context));
  } catch (const ChatTemplateError& e) {
    rethrow_located(e);
  }
}

std::string ChatTemplate::render_context(const nlohmann::ordered_json& context) const {
  try {
    check_input_depth(context, "context");
    return detail::jinja_render(*program_, context);
  } catch (const ChatTemplateError& e) {
    rethrow_located(e);
  }
}

std::string render_chat(const std::string& template_source, const nlohmann::json& messages,
                        bool add_generation_prompt, const nlohmann::json& extra_context) {
  return ChatTemplate(template_source).render(messages, add_generation_prompt, extra_context);
}

std::string render_chat(const std::string& template_source,
                        const nlohmann::ordered_json& messages, bool add_generation_prompt,
                        const nlohmann::ordered_json& extra_context) {
  return ChatTemplate(template_source).render(messages, add_generation_prompt, extra_context);
}

namespace {

ChatTemplateSource template_from_config(const fs::path& config_path) {
  fs::path dir = config_path.parent_path();
  // Newer transformers save the template as chat_template.jinja, which wins on loading.
  // Whatever exists under that name is read (read_file refuses a FIFO or a directory with
  // its name) rather than skipped.
  fs::path jinja = dir / "chat_template.jinja";
  std::error_code ec;
  if (!dir.empty() && (fs::exists(jinja, ec) || fs::is_symlink(jinja, ec))) {
    return {read_file(jinja.string(), kMaxTemplateBytes), jinja.string()};
  }
  if (!fs::exists(config_path, ec)) {
    fail("chat_template: tokenizer: {} not found (set chat_template to chatml, llama3 or none, "
         "or point the model path at a directory with tokenizer_config.json)",
         config_path.string());
  }
  const nlohmann::json cfg = read_config(config_path.string());
  if (!cfg.is_object()) fail("{}: must be a JSON object, not {}", config_path.string(), cfg.type_name());
  const std::string origin = config_path.string() + ": chat_template";
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) {
    fail("chat_template: tokenizer: {} has no chat_template (set chat_template to chatml, "
         "llama3 or none)",
         config_path.string());
  }
  if (it->is_string()) return {it->get<std::string>(), origin};
  if (it->is_array()) {
    // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    std::vector<std::string> names;
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template")) continue;
      names.push_back(entry["name"].is_string() ? entry["name"].get<std::string>() : "?");
      if (entry["name"] == "default" && entry["template"].is_string()) {
        return {entry["template"].get<std::string>(), origin + " \"default\""};
      }
    }
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    fail("{}: chat_template holds several templates ({}) and none is named \"default\"",
         config_path.string(), list);
  }
  fail("{}: chat_template must be a string or a list of {{name, template}}, not {}",
       config_path.string(), it->type_name());
}

}  // namespace

namespace {

// A special token as transformers' special_tokens_map holds it: str(AddedToken) is its content.
std::optional<std::string> token_string(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

nlohmann::ordered_json chat_special_tokens(const std::string& tokenizer_config_json_path) {
  fs::path cfg_path = tokenizer_config_json_path;
  if (fs::is_directory(cfg_path)) cfg_path /= "tokenizer_config.json";
  static const char* const kNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                       "pad_token", "cls_token", "mask_token"};
  std::vector<nlohmann::json> sources;
  // Whatever exists under these names is read: read_json_file refuses what is not a regular
  // file (a FIFO would block) instead of passing over it.
  std::error_code ec;
  if (fs::exists(cfg_path, ec)) sources.push_back(read_config(cfg_path.string()));
  fs::path map_path = cfg_path.parent_path() / "special_tokens_map.json";
  if (fs::exists(map_path, ec)) sources.push_back(read_config(map_path.string()));
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const char* name : kNames) {
    for (const auto& src : sources) {
      if (!src.is_object() || !src.contains(name)) continue;
      if (auto t = token_string(src[name])) {
        out[name] = *t;
        break;
      }
    }
  }
  for (const auto& src : sources) {
    if (!src.is_object() || !src.contains("additional_special_tokens") ||
        !src["additional_special_tokens"].is_array()) {
      continue;
    }
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& t : src["additional_special_tokens"]) {
      if (auto s = token_string(t)) list.push_back(*s);
    }
    out["additional_special_tokens"] = list;
    break;
  }
  return out;
}

std::string chat_template_for(const std::string& mode, const std::string& tokenizer_config_json_path) {
  return chat_template_source(mode, tokenizer_config_json_path).text;
}

ChatTemplateSource chat_template_source(const std::string& mode,
                                        const std::string& tokenizer_config_json_path) {
  if (mode == "chatml") return {kChatmlTemplate, "chat_template chatml (built in)"};
  if (mode == "llama3") return {kLlama3Template, "chat_template llama3 (built in)"};
  if (mode == "zephyr") return {kZephyrTemplate, "chat_template zephyr (built in, AutoTrain's)"};
  if (mode == "none") return {"", "chat_template none"};
  if (mode == "tokenizer") {
    fs::path p = tokenizer_config_json_path;
    if (fs::is_directory(p)) p /= "tokenizer_config.json";
    return template_from_config(p);
  }
  fail("chat_template: unknown value '{}' (valid: tokenizer, chatml, llama3, zephyr, none)", mode);
}

ModelChatTemplate::ModelChatTemplate(std::string mode, std::string model_dir)
    : mode_(std::move(mode)), model_dir_(std::move(model_dir)), special_tokens_(chat_special_tokens(model_dir_)) {}

ModelChatTemplate::ModelChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens)
    : special_tokens_(std::move(special_tokens)), loaded_(true) {
  if (!source.empty()) template_ = std::make_shared<const ChatTemplate>(source);
}

const ChatTemplate& ModelChatTemplate::get(const std::string& where) const {
  if (!loaded_) {
    const ChatTemplateSource source = chat_template_source(mode_, model_dir_);
    if (!source.text.empty()) template_ = std::make_shared<const ChatTemplate>(source);
    loaded_ = true;
  }
  if (!template_) {
    fail("{}: a chat (list of messages) needs a chat template, but chat_template is none "
         "(use tokenizer, chatml or llama3)",
         where);
  }
  return *template_;
}

std::string ModelChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                      const std::string& where) const {
  return get(where).render(messages, add_generation_prompt, special_tokens_);
}

}  // namespace replica::text
