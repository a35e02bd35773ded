// Chat templates against Python's Jinja2: every case in chat_templates/expected.json (written
// by chat_templates/render_reference.py with the PyPI Jinja2 of scripts/requirements-test.txt,
// set up as transformers sets it up) must render byte for byte the same, or fail with the same
// message. chat_template_conformance_test.cpp runs the script live and compares again, and
// tokenizes a rendered chat with the real Llama 3 vocabulary.
#include "replica/text/chat_template.h"
#include "replica/text/tests/chat_fixture.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using replica::text::ChatTemplate;
using replica::text::ChatTemplateError;
using replica::text::chat_special_tokens;
using replica::text::chat_template_for;
using replica::text::render_chat;

namespace {

using namespace replica::testing::chat_fixture;

// ---- reference fixtures --------------------------------------------------------------------

TEST(ChatTemplateReference, MatchesCommittedJinja2Renderings) {
  ordered_json fx = load_json(kFixtures / "expected.json");
  Counts n = check_fixture(fx);
  // The fixture covers Llama 3/3.1/3.2, Llama 2, Qwen3, Qwen2.5, Mixtral, Mistral v0.3 and
  // ChatML over many conversations, plus the interpreter's semantics one construct at a time.
  EXPECT_GE(n.chat, 600);
  EXPECT_GE(n.chat_errors, 100);
  EXPECT_GE(n.snippets, 300);
  EXPECT_EQ(n.mismatches, 0);
  std::printf("[ compared ] %d chat renderings (%d of them errors), %d snippets\n", n.chat,
              n.chat_errors, n.snippets);
}

// ---- the requirements one by one -----------------------------------------------------------

TEST(ChatTemplate, Llama2NonAlternatingRolesRaisesTheTemplatesMessage) {
  ChatTemplate llama2(fixture_template("llama2_chat.jinja"));
  nlohmann::json messages = nlohmann::json::array(
      {{{"role", "user"}, {"content", "one"}}, {{"role", "user"}, {"content", "two"}}});
  try {
    llama2.render(messages, false, {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
    FAIL() << "non-alternating roles rendered";
  } catch (const ChatTemplateError& e) {
    EXPECT_STREQ(e.what(), "Conversation roles must alternate user/assistant/user/assistant/...");
    EXPECT_EQ(e.kind(), ChatTemplateError::Kind::Raised);
  }
  // replica::Error is what the CLI catches.
  EXPECT_THROW(llama2.render(messages, false, {{"bos_token", "<s>"}}), replica::Error);
  // Alternating roles render as Meta's format.
  nlohmann::json ok = nlohmann::json::array({{{"role", "system"}, {"content", "S"}},
                                             {{"role", "user"}, {"content", " hi "}},
                                             {{"role", "assistant"}, {"content", "yo"}}});
  EXPECT_EQ(llama2.render(ok, false, {{"bos_token", "<s>"}, {"eos_token", "</s>"}}),
            "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\n hi [/INST] yo </s>");
}

TEST(ChatTemplate, MessageContentIsDataNotTemplate) {
  nlohmann::json messages = nlohmann::json::array(
      {{{"role", "user"}, {"content", "{{ 7*7 }} {% if true %}x{% endif %} {# c #}"}}});
  EXPECT_EQ(render_chat(replica::text::kChatmlTemplate, messages, true),
            "<|im_start|>user\n{{ 7*7 }} {% if true %}x{% endif %} {# c #}<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render_chat(replica::text::kLlama3Template, messages, false,
                        {{"bos_token", "<|begin_of_text|>"}}),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
            "{{ 7*7 }} {% if true %}x{% endif %} {# c #}<|eot_id|>");
}

TEST(ChatTemplate, RenderedChatCarriesExactlyOneBos) {
  // The template writes the BOS; the tokenizer must then encode without adding special
  // tokens (as apply_chat_template does), so the model sees one BOS.
  nlohmann::json messages = nlohmann::json::array({{{"role", "system"}, {"content", "s"}},
                                                   {{"role", "user"}, {"content", "u"}},
                                                   {{"role", "assistant"}, {"content", "a"}},
                                                   {{"role", "user"}, {"content", "u2"}}});
  const std::string bos = "<|begin_of_text|>";
  for (const char* file : {"llama3_instruct.jinja", "llama3_1.jinja"}) {
    std::string text = render_chat(fixture_template(file), messages, true, {{"bos_token", bos}});
    EXPECT_EQ(text.rfind(bos, 0), 0u) << file;
    EXPECT_EQ(text.find(bos, bos.size()), std::string::npos) << file << ": second BOS in\n" << text;
  }
}

TEST(ChatTemplate, BuiltinTemplatesAreTheFixtures) {
  EXPECT_EQ(std::string(replica::text::kChatmlTemplate), fixture_template("chatml.jinja"));
  EXPECT_EQ(std::string(replica::text::kZephyrTemplate), fixture_template("zephyr.jinja"));
  EXPECT_EQ(std::string(replica::text::kLlama3Template), fixture_template("llama3_instruct.jinja"));
}

TEST(ChatTemplate, OrderedJsonKeepsKeyOrderAndJsonSortsIt) {
  const std::string tpl = "{{ tools[0] | tojson }}|{% for k, v in messages[0].items() %}{{ k }};{% endfor %}";
  ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "x", "b": 1, "a": 2}])");
  ordered_json extra = ordered_json::parse(R"({"tools": [{"type": "function", "function": {"name": "f"}}]})");
  EXPECT_EQ(render_chat(tpl, messages, false, extra),
            "{\"type\": \"function\", \"function\": {\"name\": \"f\"}}|role;content;b;a;");
  nlohmann::json sorted_messages = nlohmann::json::parse(messages.dump());
  nlohmann::json sorted_extra = nlohmann::json::parse(extra.dump());
  EXPECT_EQ(render_chat(tpl, sorted_messages, false, sorted_extra),
            "{\"function\": {\"name\": \"f\"}, \"type\": \"function\"}|a;b;content;role;");
}

TEST(ChatTemplate, TransformersDefaultsToolsAndDocumentsToNone) {
  const std::string tpl =
      "{{ tools is defined }} {{ tools is none }} {{ documents is none }} {{ add_generation_prompt }} "
      "{{ bos_token is defined }}";
  EXPECT_EQ(render_chat(tpl, nlohmann::json::array(), true), "True True True True False");
  EXPECT_EQ(render_chat(tpl, nlohmann::json::array(), false, {{"tools", {1}}, {"bos_token", "<s>"}}),
            "True False True False True");
}

TEST(ChatTemplate, ParsedOnceRendersTheSameFromManyThreads) {
  ChatTemplate qwen3(fixture_template("qwen3.jinja"));
  ordered_json fx = load_json(kFixtures / "expected.json");
  const ordered_json& messages = fx["conversations"]["multi_step_tool"];
  ordered_json extra = {{"tools", fx["extras"]["tools"]["tools"]}, {"eos_token", "<|im_end|>"}};
  const std::string want = qwen3.render(messages, true, extra);
  std::vector<std::string> got(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 20; ++k) got[t] = qwen3.render(messages, true, extra);
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

// ---- chat_template: tokenizer | chatml | llama3 | none -------------------------------------

class ChatTemplateFor : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir(); }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string error_of(const std::string& mode, const std::string& path) {
    try {
      chat_template_for(mode, path);
    } catch (const replica::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "no error for mode " << mode << " path " << path;
    return "";
  }
  fs::path dir_;
};

TEST_F(ChatTemplateFor, BuiltinModes) {
  EXPECT_EQ(chat_template_for("chatml", ""), replica::text::kChatmlTemplate);
  EXPECT_EQ(chat_template_for("llama3", "/nonexistent"), replica::text::kLlama3Template);
  EXPECT_EQ(chat_template_for("zephyr", "/nonexistent"), replica::text::kZephyrTemplate);
  EXPECT_EQ(chat_template_for("none", ""), "");
}

TEST_F(ChatTemplateFor, TokenizerReadsTheConfigsTemplate) {
  const std::string qwen3 = fixture_template("qwen3.jinja");
  nlohmann::json cfg = {{"chat_template", qwen3}, {"eos_token", "<|im_end|>"}};
  write_file(dir_ / "tokenizer_config.json", cfg.dump(2));
  EXPECT_EQ(chat_template_for("tokenizer", (dir_ / "tokenizer_config.json").string()), qwen3);
  EXPECT_EQ(chat_template_for("tokenizer", dir_.string()), qwen3);  // the model directory
  // transformers' chat_template.jinja next to it wins
  write_file(dir_ / "chat_template.jinja", "{{ messages | length }}");
  EXPECT_EQ(chat_template_for("tokenizer", dir_.string()), "{{ messages | length }}");
}

TEST_F(ChatTemplateFor, TokenizerTakesTheDefaultOfNamedTemplates) {
  nlohmann::json cfg = {{"chat_template",
                         {{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}}}};
  write_file(dir_ / "tokenizer_config.json", cfg.dump());
  EXPECT_EQ(chat_template_for("tokenizer", dir_.string()), "D");
  cfg = {{"chat_template", {{{"name", "tool_use"}, {"template", "T"}}}}};
  write_file(dir_ / "tokenizer_config.json", cfg.dump());
  EXPECT_NE(error_of("tokenizer", dir_.string()).find("tool_use"), std::string::npos);
}

TEST_F(ChatTemplateFor, ErrorsNameTheFileOrTheMode) {
  std::string missing = (dir_ / "nope" / "tokenizer_config.json").string();
  EXPECT_NE(error_of("tokenizer", missing).find(missing), std::string::npos);
  write_file(dir_ / "tokenizer_config.json", R"({"chat_template": null, "eos_token": "</s>"})");
  std::string e = error_of("tokenizer", dir_.string());
  EXPECT_NE(e.find("tokenizer_config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("has no chat_template"), std::string::npos) << e;
  write_file(dir_ / "tokenizer_config.json", "{not json");
  EXPECT_NE(error_of("tokenizer", dir_.string()).find("not valid JSON"), std::string::npos);
  e = error_of("chatm1", "");
  EXPECT_NE(e.find("chatm1"), std::string::npos) << e;
  EXPECT_NE(e.find("tokenizer, chatml, llama3, zephyr, none"), std::string::npos) << e;
}

TEST_F(ChatTemplateFor, SpecialTokensAsTransformersPassesThem) {
  write_file(dir_ / "tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>", "pad_token": null, "add_bos_token": true,
    "additional_special_tokens": ["<tool>", {"content": "</tool>"}]})");
  write_file(dir_ / "special_tokens_map.json", R"({"unk_token": "<unk>", "eos_token": "<other>"})");
  ordered_json t = chat_special_tokens(dir_.string());
  EXPECT_EQ(t, ordered_json::parse(R"({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "additional_special_tokens": ["<tool>", "</tool>"]})"));
  fs::create_directories(dir_ / "empty");
  EXPECT_EQ(chat_special_tokens((dir_ / "empty").string()), ordered_json::object());
}

// ---- interpreter details the fixtures do not pin down --------------------------------------

TEST(JinjaInterpreter, SyntaxErrorsAreReplicaErrorsWithLine) {
  try {
    ChatTemplate t("line one\n{% for m in messages %}\n{{ m.content }");
    FAIL() << "parsed";
  } catch (const ChatTemplateError& e) {
    EXPECT_EQ(e.kind(), ChatTemplateError::Kind::Syntax);
    EXPECT_NE(std::string(e.what()).find("(line 3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ChatTemplate("{% include 'x.j2' %}"), replica::Error);
  EXPECT_THROW(ChatTemplate("{% for x in y recursive %}{% endfor %}"), replica::Error);
  EXPECT_THROW(ChatTemplate("{{ x | groupby('a') }}"), replica::Error);
}

TEST(JinjaInterpreter, StrftimeNowIsTheLocalTime) {
  auto today = [] {
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[64];
    std::strftime(buf, sizeof buf, "%d %b %Y", &tm);
    return std::string(buf);
  };
  std::string before = today();
  std::string got = ChatTemplate("{{ strftime_now('%d %b %Y') }}").render_context(ordered_json::object());
  std::string after = today();
  EXPECT_TRUE(got == before || got == after) << got;
}

TEST(JinjaInterpreter, UndefinedPrintsEmptyButAttributeAccessFails) {
  ChatTemplate t("[{{ missing }}][{{ m.nothing }}]");
  EXPECT_EQ(t.render_context({{"m", {{"a", 1}}}}), "[][]");
  try {
    ChatTemplate("{{ missing.attr }}").render_context(ordered_json::object());
    FAIL() << "rendered";
  } catch (const ChatTemplateError& e) {
    EXPECT_EQ(e.kind(), ChatTemplateError::Kind::Undefined);
    EXPECT_STREQ(e.what(), "'missing' is undefined");
  }
}

TEST(JinjaInterpreter, LimitsAreErrorsNotCrashes) {
  // Python has arbitrary-precision integers; replica's are 64-bit and say so.
  try {
    ChatTemplate("{{ 2 ** n }}").render_context({{"n", 100}});
    FAIL() << "rendered";
  } catch (const ChatTemplateError& e) {
    EXPECT_NE(std::string(e.what()).find("64-bit"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ChatTemplate("{{ 2 ** n }}").render_context({{"n", 62}}), "4611686018427387904");
  // Runaway recursion stops like Python's RecursionError instead of overflowing the stack.
  EXPECT_THROW(ChatTemplate("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}").render_context(ordered_json::object()),
               ChatTemplateError);
  std::string deep(1000, '(');
  EXPECT_THROW(ChatTemplate("{{ " + deep + "1" + std::string(1000, ')') + " }}"), ChatTemplateError);
}

TEST(JinjaInterpreter, InvalidUtf8InContentSurvivesUnchanged) {
  ordered_json ctx = {{"s", std::string("a\xff\xfe") + "b"}};
  // nlohmann keeps the bytes; the renderer copies them through untouched (and counts them
  // as one character each, like Python's surrogateescape).
  EXPECT_EQ(ChatTemplate("{{ s }}|{{ s | length }}|{{ s[1:] }}").render_context(ctx),
            std::string("a\xff\xfe") + "b|4|" + std::string("\xff\xfe") + "b");
}

}  // namespace
