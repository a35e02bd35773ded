// Chat template API: built-in templates, the `chat_template:` resolver and the render entry
// points over the Jinja interpreter in jinja/*.cpp (jinja/jinja.h).
#include "replica/text/chat_template.h"

#include "replica/core/files.h"

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

ChatTemplate::ChatTemplate(const std::string& source) : program_(detail::jinja_parse(source)) {}

namespace {

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
  return render(nlohmann::ordered_json(messages), add_generation_prompt,
                nlohmann::ordered_json(extra_context));
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages,
                                 bool add_generation_prompt,
                                 const nlohmann::ordered_json& extra_context) const {
  return detail::jinja_render(*program_, chat_context(messages, add_generation_prompt, extra_context));
}

std::string ChatTemplate::render_context(const nlohmann::ordered_json& context) const {
  return detail::jinja_render(*program_, context);
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

std::string template_from_config(const fs::path& config_path) {
  fs::path dir = config_path.parent_path();
  // Newer transformers save the template as chat_template.jinja, which wins on loading.
  fs::path jinja = dir / "chat_template.jinja";
  if (!dir.empty() && fs::is_regular_file(jinja)) return read_file(jinja.string());
  if (!fs::is_regular_file(config_path)) {
    fail("chat_template: tokenizer: {} not found (set chat_template to chatml, llama3 or none, "
         "or point the model path at a directory with tokenizer_config.json)",
         config_path.string());
  }
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(read_file(config_path.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", config_path.string(), e.what());
  }
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) {
    fail("chat_template: tokenizer: {} has no chat_template (set chat_template to chatml, "
         "llama3 or none)",
         config_path.string());
  }
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    std::vector<std::string> names;
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template")) continue;
      names.push_back(entry["name"].is_string() ? entry["name"].get<std::string>() : "?");
      if (entry["name"] == "default" && entry["template"].is_string()) {
        return entry["template"].get<std::string>();
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

nlohmann::json read_json_file(const fs::path& p) {
  try {
    return nlohmann::json::parse(read_file(p.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", p.string(), e.what());
  }
}

}  // namespace

nlohmann::ordered_json chat_special_tokens(const std::string& tokenizer_config_json_path) {
  fs::path cfg_path = tokenizer_config_json_path;
  if (fs::is_directory(cfg_path)) cfg_path /= "tokenizer_config.json";
  static const char* const kNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                       "pad_token", "cls_token", "mask_token"};
  std::vector<nlohmann::json> sources;
  if (fs::is_regular_file(cfg_path)) sources.push_back(read_json_file(cfg_path));
  fs::path map_path = cfg_path.parent_path() / "special_tokens_map.json";
  if (fs::is_regular_file(map_path)) sources.push_back(read_json_file(map_path));
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
  if (mode == "chatml") return kChatmlTemplate;
  if (mode == "llama3") return kLlama3Template;
  if (mode == "none") return "";
  if (mode == "tokenizer") {
    fs::path p = tokenizer_config_json_path;
    if (fs::is_directory(p)) p /= "tokenizer_config.json";
    return template_from_config(p);
  }
  fail("chat_template: unknown value '{}' (valid: tokenizer, chatml, llama3, none)", mode);
}

}  // namespace replica::text
