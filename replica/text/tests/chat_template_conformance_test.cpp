// Conformance: replica's chat template renderer against the real Jinja2 (PyPI, pinned in
// scripts/requirements-test.txt) run now, and a rendered chat tokenized with the real Llama 3
// vocabulary. chat_template_test.cpp compares with the committed renderings
// (chat_templates/expected.json) without Python; here chat_templates/render_reference.py runs
// live with the project's Python (replica/testing/referee.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "replica/testing/referee.h"
#include "replica/text/chat_template.h"
#include "replica/text/tests/chat_fixture.h"
#include "replica/text/tests/vocab.h"
#include "replica/text/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using replica::text::chat_special_tokens;
using replica::text::chat_template_for;
using replica::text::render_chat;

namespace {

using namespace replica::testing::chat_fixture;

// render_reference.py with today's Jinja2 gives the committed expectations, and replica
// renders every case of its fresh output the same.
TEST(ChatTemplateConformance, MatchesLiveJinja2) {
  REPLICA_REQUIRE_PYTHON("jinja2");
  const fs::path script = kFixtures / "render_reference.py";
  const fs::path dir = make_temp_dir();
  const fs::path out = dir / "expected.json";
  const auto run = replica::testing::run_python(script, {"--out", out.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const ordered_json live = load_json(out);
  std::printf("[ live     ] %s\n", live["generator"].get<std::string>().c_str());
  const Counts n = check_fixture(live);
  EXPECT_EQ(n.mismatches, 0);
  EXPECT_GE(n.chat, 600);
  EXPECT_GE(n.snippets, 300);
  // The committed fixture is what the script writes today (regenerate it when this fails:
  // .venv/bin/python replica/text/tests/chat_templates/render_reference.py).
  const ordered_json committed = load_json(kFixtures / "expected.json");
  const std::string stale = "expected.json (" + committed["generator"].get<std::string>() +
                            ") differs from the live run (" + live["generator"].get<std::string>() +
                            "): a Jinja2 other than the pinned one, or rerun " + script.string();
  for (const char* key : {"templates", "conversations", "extras", "chat_cases", "snippets"}) {
    const ordered_json& a = live[key];
    const ordered_json& b = committed[key];
    if (a == b) continue;
    std::string first = "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
    if (a.is_array() && b.is_array()) {
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (a[i] != b[i]) {
          first = "first at #" + std::to_string(i) + ":\n  live      " + a[i].dump() + "\n  committed " + b[i].dump();
          break;
        }
      }
    }
    ADD_FAILURE() << "\"" << key << "\" differs; " << first << "\n" << stale;
  }
  fs::remove_all(dir);
}

// ---- tokenizing a rendered chat ------------------------------------------------------------

TEST(ChatTemplateTokenizing, RenderedChatEncodesWithASingleBos) {
  // The Llama 3 vocabulary of the tokenizer conformance test (conformance/vocab/llama3).
  const fs::path dir = replica::testing::vocab::dir("llama3");
  const std::string tpl = chat_template_for("tokenizer", dir.string());
  EXPECT_EQ(tpl, fixture_template("llama3.jinja"));  // the fixture is that vocabulary's template
  const ordered_json special = chat_special_tokens(dir.string());
  ASSERT_EQ(special.value("bos_token", ""), "<|begin_of_text|>");
  // Meta's tokenizer.json adds <|begin_of_text|> in its post-processor; the package's copy
  // does not, so put Meta's post-processor back.
  nlohmann::json tj = nlohmann::json::parse(replica::testing::vocab::tokenizer_json("llama3"));
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

}  // namespace
