// Chat templates (replica/text/chat_template.h, the Jinja interpreter in text/jinja/): parsing,
// rendering under the bounds of Note [bounded templates] (nesting, recursion, a budget of
// steps and bytes), tokenizer_config.json's chat_template and special tokens, and hostile
// conversations. Input byte 0: bits 0-1 pick what the rest is, bit 2 add_generation_prompt,
// bit 3 which built-in template renders a conversation:
//   0  a template, rendered with a small fixed conversation and bos/eos tokens;
//   1  a tokenizer_config.json: its chat_template rendered with its special tokens;
//   2  a conversation (JSON, as a data row's messages), rendered by chatml or llama3;
//   3  a template, a NUL byte, then the conversation it renders.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/core/json.h"
#include "replica/text/chat_template.h"

#include <cstring>

namespace {

using ordered_json = nlohmann::ordered_json;

const ordered_json& fixed_messages() {
  static const ordered_json messages = ordered_json::parse(R"([
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi! {{ 7*7 }}"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Tell me a joke."}
  ])");
  return messages;
}

const ordered_json& fixed_tokens() {
  static const ordered_json tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  return tokens;
}

void render(uint8_t mode, const std::string& rest) {
  using replica::text::ChatTemplate;
  const bool add_generation_prompt = mode & 4;
  switch (mode & 3) {
    case 0: {
      const ChatTemplate t(rest, "fuzz/chat_template.jinja");
      (void)t.render(fixed_messages(), add_generation_prompt, fixed_tokens());
      break;
    }
    case 1: {
      const std::string path = replica::fuzz::write_file(
          "tokenizer_config.json", reinterpret_cast<const uint8_t*>(rest.data()), rest.size());
      const ChatTemplate t(replica::text::chat_template_source("tokenizer", path));
      (void)t.render(fixed_messages(), add_generation_prompt, replica::text::chat_special_tokens(path));
      break;
    }
    case 2: {
      const ordered_json messages = replica::parse_ordered_json(rest, "fuzz/messages.json");
      const ChatTemplate t(mode & 8 ? replica::text::kLlama3Template : replica::text::kChatmlTemplate);
      (void)t.render(messages, add_generation_prompt, fixed_tokens());
      break;
    }
    case 3: {
      const size_t nul = rest.find('\0');
      if (nul == std::string::npos) return;
      const ordered_json messages = replica::parse_ordered_json(rest.substr(nul + 1), "fuzz/messages.json");
      const ChatTemplate t(rest.substr(0, nul), "fuzz/chat_template.jinja");
      (void)t.render(messages, add_generation_prompt, fixed_tokens());
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // Mode 1 reads chat_template.jinja beside tokenizer_config.json when it exists: never here.
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    render(data[0], rest);
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
