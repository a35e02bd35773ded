// Hostile tokenizers and chat templates (issue 35): inputs that used to overflow the stack,
// hang, allocate without bound, fail without saying where, or were accepted without a word.
// Each now ends in one replica::Error naming the file (and template line) at fault, or, for
// a renumbered added token, in a warning.
//
// The inputs run in a child process (a GoogleTest death test) under an alarm and an
// address-space limit, so that on code without the bounds a stack overflow, a hang or a
// runaway allocation fails the one test instead of taking the test program (or the machine)
// down: the child prints the error message it got and exits 0; the parent matches it.
#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "replica/core/error.h"
#include "replica/testing/paths.h"
#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;
using replica::text::ChatTemplate;
using replica::text::ChatTemplateError;
using replica::text::Tokenizer;

namespace {

// The replica::Error message of `f`, or a line saying what else happened.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const replica::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a replica::Error: ") + e.what();
  }
  return "no error";
}

// In the child: at most 2 GiB more address space than it has, and 120 s.
void bound_child() {
  ::alarm(120);
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{2} << 30);
  const rlimit rl{limit, limit};
  ::setrlimit(RLIMIT_AS, &rl);
}

// Expects `body` (a statement) to end in a replica::Error whose message matches `regex`
// (POSIX extended), in a bounded child process.
#define EXPECT_ERROR_IN_CHILD(body, regex)                                 \
  EXPECT_EXIT(                                                            \
      {                                                                   \
        bound_child();                                                    \
        std::cerr << "[" << error_of([&] { body; }) << "]" << std::endl; \
        std::_Exit(0);                                                    \
      },                                                                  \
      ::testing::ExitedWithCode(0), regex)

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() / ("replica-hostile-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).string();
  }
  std::string fifo(const std::string& name) const {
    const fs::path p = path / name;
    EXPECT_EQ(::mkfifo(p.c_str(), 0600), 0);
    return p.string();
  }
};

std::string repeat(const std::string& s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t k = 0; k < n; ++k) out += s;
  return out;
}

// A byte-level BPE tokenizer.json with a pre-tokenizer of our choosing.
json tokenizer_json(const json& pre_tokenizer) {
  json vocab = json::object();
  for (int b = 0; b < 26; ++b) vocab[std::string(1, static_cast<char>('a' + b))] = b;
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", nullptr},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
}

std::string render(const std::string& tmpl) { return ChatTemplate(tmpl).render_context(ordered_json::object()); }

// ---- stack overflows: nesting is bounded while parsing and in every walk ---------------------

TEST(HostileTemplate, DeepExpressionsAreErrorsNotStackOverflows) {
  // Each of these used to recurse once per level (in the parser, the constant folder, the
  // name checks or the evaluator) and overflow the stack.
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ " + repeat("not ", 1'000'000) + "x }}"),
                        "\\[chat template syntax error: template nested too deeply .*\\(line 1\\)\\]");
  const size_t n = 100'000;  // far beyond what the stack held (~1 KB per level)
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ x" + repeat(".a", n) + " }}"),
                        "\\[chat template syntax error: expression nested too deeply .*\\(line 1\\)\\]");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ x" + repeat("|string", n) + " }}"),
                        "\\[chat template syntax error: expression nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ 1" + repeat(" + 1", n) + " }}"),
                        "\\[chat template syntax error: expression nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ x" + repeat("[0]", n) + " }}"),
                        "\\[chat template syntax error: expression nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ " + repeat("[", n) + repeat("]", n) + " }}"),
                        "\\[chat template syntax error: template nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ " + repeat("{'a': ", n) + "1" + repeat("}", n) + " }}"),
                        "\\[chat template syntax error: template nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate(repeat("{% if x %}", n) + repeat("{% endif %}", n)),
                        "\\[chat template syntax error: template nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{% if x %}" + repeat("{% elif x %}", n) + "{% endif %}"),
                        "\\[chat template syntax error: template nested too deeply");
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ x" + repeat(" if x", n) + " }}"),
                        "\\[chat template syntax error: expression nested too deeply");
  // Nesting real templates use stays fine.
  EXPECT_EQ(render("{{ " + repeat("not ", 100) + "true }}"), "True");
  EXPECT_EQ(render("{{ " + repeat("[", 50) + "1" + repeat("]", 50) + " | length }}"), "1");
}

TEST(HostileTemplate, ValuesBuiltDeepByLoopsAreFreedAndPrintedInBoundedStack) {
  // A loop nests a list 200,000 deep: freeing it used to recurse once per level.
  const std::string build =
      "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [[ns.x]] %}{% endfor %}";
  EXPECT_ERROR_IN_CHILD(std::cerr << render(build + "{{ ns.x | length }}"), "\\[1no error\\]");
  // Printing, comparing or serialising it recurses: an error at the bound.
  for (const char* use : {"{{ ns.x }}", "{{ ns.x | tojson }}", "{{ ns.x == ns.x[0] }}"}) {
    EXPECT_ERROR_IN_CHILD(render(build + use), "\\[maximum recursion depth exceeded");
  }
  // A generator over a generator over ... 100,000 deep.
  EXPECT_ERROR_IN_CHILD(render("{% set ns = namespace(g=[1]) %}{% for i in range(100000) %}"
                               "{% set ns.g = ns.g | map('string') %}{% endfor %}{{ ns.g | list }}"),
                        "\\[maximum recursion depth exceeded");
}

// {"x": [[[...["leaf"]...]]]}, built without copies (nlohmann copies recursively).
ordered_json deep_context(int depth) {
  ordered_json deep = "leaf";
  for (int k = 0; k < depth; ++k) {
    ordered_json wrap = ordered_json::array();
    wrap.push_back(std::move(deep));
    deep = std::move(wrap);
  }
  ordered_json context = ordered_json::object();
  context["x"] = std::move(deep);
  return context;
}

// Runs `f` on a thread with a stack of `bytes` (threads get 8 MiB by default).
void on_small_stack(size_t bytes, const std::function<void()>& f) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, bytes);
  pthread_t thread;
  auto run = [](void* arg) -> void* {
    (*static_cast<const std::function<void()>*>(arg))();
    return nullptr;
  };
  ASSERT_EQ(pthread_create(&thread, &attr, run, const_cast<std::function<void()>*>(&f)), 0);
  pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
}

TEST(HostileTemplate, EveryRecursionBoundFitsInAQuarterOfAThreadsStack) {
  // The deepest each walk can go before its bound, on a 2 MiB stack (a quarter of the
  // default): expressions nested to the parser's bound inside recursive macros, values,
  // generators, JSON and comparisons nested to the recursion bound.
  const std::string deep_expr = repeat("not ", 190) + "m(n + 1)";
  const std::string deep_value =
      "{% set ns = namespace(x=[]) %}{% for i in range(3000) %}{% set ns.x = [ns.x] %}{% endfor %}";
  const std::vector<std::string> templates = {
      "{% macro m(n) %}{% if true %}{% for x in [1] %}{{ " + deep_expr + " }}{% endfor %}{% endif %}{% endmacro %}{{ m(0) }}",
      "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
      deep_value + "{{ ns.x }}",
      deep_value + "{{ ns.x | tojson(indent=1) }}",
      deep_value + "{{ ns.x == ns.x[0] }}",
      deep_value + "{{ [ns.x] | sort }}",
      "{% set ns = namespace(g=[1]) %}{% for i in range(3000) %}{% set ns.g = ns.g | select %}{% endfor %}{{ ns.g | list }}",
  };
  for (const auto& t : templates) {
    EXPECT_ERROR_IN_CHILD(on_small_stack(2 << 20, [&] { std::cerr << error_of([&] { render(t); }); }),
                          "maximum recursion depth exceeded");
  }
}

TEST(HostileTemplate, DeepInputJsonIsRefusedBeforeItIsConverted) {
  EXPECT_ERROR_IN_CHILD(ChatTemplate("{{ x }}").render_context(deep_context(1'000'000)),
                        "\\[chat template: context nested more than [0-9]+ levels deep\\]");
  EXPECT_EQ(ChatTemplate("{{ x | tojson }}").render_context(deep_context(3)), "[[[\"leaf\"]]]");
}

// ---- hangs and unbounded work: every render has a budget ------------------------------------

TEST(HostileTemplate, NestedHugeLoopsExhaustTheBudgetQuickly) {
  // 10**10 iterations: hours without a budget.
  // (Each inner range is 100,000 values: the bytes run out before the steps.)
  EXPECT_ERROR_IN_CHILD(render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
                        "\\[the template exceeded its budget of ");
  EXPECT_ERROR_IN_CHILD(render("{% for i in range(100000) %}{% for j in 'x' * 100000 %}{% endfor %}{% endfor %}"),
                        "\\[the template exceeded its budget of [0-9]+ steps");
  EXPECT_ERROR_IN_CHILD(render("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"),
                        "\\[the template exceeded its budget");
  // Runaway macro recursion stops as before.
  EXPECT_ERROR_IN_CHILD(render("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}"),
                        "\\[maximum recursion depth exceeded");
}

TEST(HostileTemplate, HugeStringsAndListsAreChargedBeforeTheyAreAllocated) {
  EXPECT_ERROR_IN_CHILD(render("{{ 'x' * 10**12 }}"), "\\[the template exceeded its budget of [0-9]+ MiB");
  EXPECT_ERROR_IN_CHILD(render("{{ ([1, 2] * 10**12) | length }}"), "\\[the template exceeded its budget");
  EXPECT_ERROR_IN_CHILD(render("{{ 'x' | center(10**12) }}"), "\\[the template exceeded its budget");
  EXPECT_ERROR_IN_CHILD(render("{{ '{:>999999999999}'.format('x') }}"), "\\[the template exceeded its budget");
  EXPECT_ERROR_IN_CHILD(render("{{ ('x' * 1000000).replace('', 'yyyyyyyyyy' * 100000) }}"),
                        "\\[the template exceeded its budget");
  // Doubling a string 60 times, and output that never ends.
  EXPECT_ERROR_IN_CHILD(render("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                               "{% endfor %}{{ ns.s | length }}"),
                        "\\[the template exceeded its budget");
  EXPECT_ERROR_IN_CHILD(render("{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"),
                        "\\[the template exceeded its budget");
  // The template itself: real ones are tens of KB.
  EXPECT_EQ(error_of([] { ChatTemplate(std::string(5 << 20, 'x')); }),
            "chat template is 5242880 bytes, more than the 4 MiB a chat template may have");
}

TEST(HostileTemplate, RealTemplatesAreFarInsideTheBudget) {
  // A long conversation with the largest template of the fixtures.
  std::ifstream in(fs::path(REPLICA_SOURCE_DIR) / "replica/text/tests/chat_templates/qwen3.jinja");
  std::stringstream text;
  text << in.rdbuf();
  ordered_json messages = ordered_json::array();
  for (int k = 0; k < 2000; ++k) {
    messages.push_back({{"role", k % 2 ? "assistant" : "user"}, {"content", repeat("word ", 200)}});
  }
  const std::string out = ChatTemplate(text.str()).render(messages, true);
  EXPECT_GT(out.size(), 2000u * 1000u);
}

// ---- errors say where: the template's source and line ---------------------------------------

TEST(HostileTemplate, EveryTemplateErrorNamesTheTemplateAndLine) {
  TempDir dir;
  const std::string config = dir.write(
      "tokenizer_config.json",
      json({{"chat_template", "{% macro m() %}\n{{ m() }}\n{% endmacro %}\n{{ m() }}"}}).dump());
  const auto source = replica::text::chat_template_source("tokenizer", dir.path.string());
  EXPECT_EQ(source.origin, config + ": chat_template");
  const ChatTemplate recursive(source);
  EXPECT_ERROR_IN_CHILD(recursive.render(json::array(), false),
                        "\\[.*/tokenizer_config.json: chat_template: line 2: maximum recursion depth exceeded");

  dir.write("tokenizer_config.json",
            json({{"chat_template", "{% for m in messages %}\n{{ m.content }\n{% endfor %}"}}).dump());
  EXPECT_ERROR_IN_CHILD(ChatTemplate(replica::text::chat_template_source("tokenizer", dir.path.string())),
                        "\\[.*/tokenizer_config.json: chat_template: chat template syntax error: .*\\(line 2\\)\\]");

  dir.write("chat_template.jinja", "{% for i in range(100000) %}\n{% for j in range(100000) %}{% endfor %}{% endfor %}");
  const ChatTemplate endless(replica::text::chat_template_source("tokenizer", dir.path.string()));
  EXPECT_EQ(endless.origin(), (dir.path / "chat_template.jinja").string());
  EXPECT_ERROR_IN_CHILD(endless.render(json::array(), false),
                        "\\[.*/chat_template.jinja: line 2: the template exceeded its budget");

  dir.write("chat_template.jinja", "{{ raise_exception('no system role') }}");
  try {
    ChatTemplate(replica::text::chat_template_source("tokenizer", dir.path.string())).render(json::array(), false);
    FAIL() << "rendered";
  } catch (const ChatTemplateError& e) {
    EXPECT_EQ(e.kind(), ChatTemplateError::Kind::Raised);
    EXPECT_EQ(std::string(e.what()), (dir.path / "chat_template.jinja").string() + ": line 1: no system role");
  }
  // Without an origin the message is Jinja2's own (what the conformance tests compare).
  try {
    ChatTemplate("{{ raise_exception('no system role') }}").render_context(ordered_json::object());
    FAIL() << "rendered";
  } catch (const ChatTemplateError& e) {
    EXPECT_STREQ(e.what(), "no system role");
    EXPECT_EQ(e.line(), 1);
  }
}

TEST(HostileTemplate, TemplateFilesThatAreNotRegularFilesAreRefused) {
  TempDir dir;
  dir.write("tokenizer_config.json", R"({"chat_template": "{{ 1 }}"})");
  const std::string fifo = dir.fifo("chat_template.jinja");
  // It was passed over before: the template of tokenizer_config.json was used instead.
  EXPECT_ERROR_IN_CHILD(replica::text::chat_template_for("tokenizer", dir.path.string()),
                        "\\['.*/chat_template.jinja' is a FIFO \\(named pipe\\), not a regular file");
  fs::remove(fifo);
  dir.write("tokenizer_config.json", repeat("[", 1'000'000) + repeat("]", 1'000'000));
  EXPECT_ERROR_IN_CHILD(replica::text::chat_template_for("tokenizer", dir.path.string()),
                        "\\[.*/tokenizer_config.json: JSON nested more than 128 levels deep\\]");
  EXPECT_ERROR_IN_CHILD(replica::text::chat_special_tokens(dir.path.string()),
                        "\\[.*/tokenizer_config.json: JSON nested more than 128 levels deep\\]");
}

// ---- tokenizers -----------------------------------------------------------------------------

TEST(HostileTokenizer, DeepJsonIsRefusedNamingTheFile) {
  TempDir dir;
  // Sequence in Sequence in ... : make_pre_tokenizer used to recurse once per level.
  const size_t n = 100'000;
  const std::string pre = repeat(R"({"type": "Sequence", "pretokenizers": [)", n) + R"({"type": "Whitespace"})" +
                          repeat("]}", n);
  std::string text = tokenizer_json(nullptr).dump();
  const std::string slot = R"("pre_tokenizer":null)";
  ASSERT_NE(text.find(slot), std::string::npos);
  text.replace(text.find(slot), slot.size(), R"("pre_tokenizer":)" + pre);
  dir.write("tokenizer.json", text);
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_dir(dir.path.string()),
                        "\\[.*/tokenizer.json: JSON nested more than 128 levels deep\\]");
  dir.write("tokenizer.json", tokenizer_json({{"type", "Whitespace"}}).dump());
  dir.write("tokenizer_config.json", "{\"x\": " + repeat("[", 1'000'000) + repeat("]", 1'000'000) + "}");
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_dir(dir.path.string()),
                        "\\[.*/tokenizer_config.json: JSON nested more than 128 levels deep\\]");
}

TEST(HostileTokenizer, FifosAreRefusedNotWaitedOn) {
  TempDir dir;
  const std::string fifo = dir.fifo("tokenizer.json");
  // Opening a FIFO with no writer blocked forever.
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_json_file(fifo), "\\['.*/tokenizer.json' is a FIFO \\(named pipe\\)");
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_dir(dir.path.string()), "\\['.*/tokenizer.json' is a FIFO \\(named pipe\\)");
  fs::remove(fifo);
  dir.write("tokenizer.json", tokenizer_json({{"type", "Whitespace"}}).dump());
  dir.fifo("tokenizer_config.json");
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_dir(dir.path.string()),
                        "\\['.*/tokenizer_config.json' is a FIFO \\(named pipe\\)");
}

TEST(HostileTokenizer, CatastrophicRegexNamesTheFileAndThePreTokenizer) {
  TempDir dir;
  const json pre = {{"type", "Split"}, {"pattern", {{"Regex", "(a|aa)+$"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const std::string path = dir.write("tokenizer.json", tokenizer_json(pre).dump());
  const Tokenizer tok = Tokenizer::from_json_file(path);
  const std::string message = error_of([&] { tok.encode(repeat("a", 100) + "!"); });
  EXPECT_EQ(message.rfind("tokenizer.json '" + path + "': pre_tokenizer Split: regex /(a|aa)+$/ failed on a 101-byte piece", 0), 0u)
      << message;
  EXPECT_NE(message.find("limit"), std::string::npos) << message;
}

TEST(HostileTokenizer, RenumberedAddedTokenIsAWarning) {
  json j = tokenizer_json({{"type", "Whitespace"}});
  j["added_tokens"] = json::parse(R"([{"id": 2000000000, "content": "<|huge|>", "special": true}])");
  std::ostringstream log;
  auto capture = std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  const auto saved = spdlog::default_logger();
  spdlog::set_default_logger(capture);
  const Tokenizer tok = Tokenizer::from_json_string(j.dump(), "huge.json");
  spdlog::set_default_logger(saved);
  EXPECT_EQ(tok.token_to_id("<|huge|>"), 26);
  EXPECT_EQ(tok.vocab_size(), 27);
  EXPECT_NE(log.str().find("huge.json: added token '<|huge|>' has id 2000000000 in the file but gets id 26"),
            std::string::npos)
      << log.str();
}

TEST(HostileTokenizer, HugeIdsCostNoHugeAllocation) {
  // A vocabulary of two tokens, one of them at id 2,000,000,000: the id -> token table was a
  // vector indexed by id (64 GB).
  json j = tokenizer_json({{"type", "Whitespace"}});
  j["model"]["vocab"] = {{"a", 0}, {"b", 2'000'000'000}};
  EXPECT_ERROR_IN_CHILD(
      {
        const Tokenizer tok = Tokenizer::from_json_string(j.dump(), "sparse.json");
        std::cerr << tok.vocab_size() << " " << tok.id_to_token(2'000'000'000) << " " << tok.encode("ab").size();
      },
      "\\[2000000001 b 2no error\\]");
  j["model"]["vocab"] = {{"a", 0}, {"b", 2147483647}};
  EXPECT_ERROR_IN_CHILD(Tokenizer::from_json_string(j.dump(), "sparse.json"),
                        "\\[tokenizer.json 'sparse.json': model BPE: vocab id of 'b' must be an integer in "
                        "0..2147483646, not 2147483647\\]");
}

TEST(HostileTokenizer, DeepChatLinesOnStdinAreRefusedNamingTheLine) {
  TempDir dir;
  dir.write("tokenizer.json", tokenizer_json({{"type", "Whitespace"}}).dump());
  std::istringstream in("[]\n" + repeat("[", 1'000'000) + repeat("]", 1'000'000) + "\n");
  std::ostringstream out;
  auto render = [](const std::string&) { return std::string("ab"); };
  EXPECT_ERROR_IN_CHILD(replica::text::tokenize_command(dir.path.string(), true, in, out, render),
                        "\\[replica tokenize --chat: stdin line 2: JSON nested more than 128 levels deep\\]");
}

}  // namespace
