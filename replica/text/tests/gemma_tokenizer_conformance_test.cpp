// A Gemma-style tokenizer and Gemma 3's chat template against transformers
// (replica/text/tests/gemma_tokenizer/: the fixture and make_gemma_tokenizer.py, which builds
// it with the PyPI `tokenizers` as transformers' GemmaConverter lays Gemma's out: Replace
// normalizer, Split pre-tokenizer, BPE with byte fallback, <start_of_turn>/<end_of_turn>,
// add_bos_token, and google/gemma-3-*-it's chat template in tokenizer_config.json).
//
// replica's Tokenizer::from_dir and chat template (chat_template: tokenizer) on the fixture
// give exactly what AutoTokenizer (GemmaTokenizerFast) gives: ids with and without special
// tokens, both decodes, apply_chat_template's rendering and its ids; and the committed
// fixture is what the script builds.
#include "replica/testing/program_runner.h"
#include "replica/testing/paths.h"
#include "replica/testing/referee.h"
#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

namespace {

fs::path fixture_dir() { return fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "gemma_tokenizer"; }

::testing::AssertionResult run_script(const std::vector<std::string>& args) {
  const auto run = replica::testing::run_python(fixture_dir() / "make_gemma_tokenizer.py", args);
  if (run.exit_code != 0) {
    return ::testing::AssertionFailure() << "make_gemma_tokenizer.py exited with " << run.exit_code << ":\n"
                                         << run.output;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(GemmaTokenizer, IdsDecodesAndChatTemplateAreTransformers) {
  REPLICA_REQUIRE_PYTHON("transformers", "tokenizers");
  replica::testing::ScratchDir dir("replica-gemma-tokenizer");
  const std::string expected_file = dir / "transformers.json";
  ASSERT_TRUE(run_script({"check", "--dir", fixture_dir().string(), "--out", expected_file}));
  const auto expected = ordered_json::parse(replica::testing::read_file(expected_file));
  EXPECT_EQ(expected.at("class"), "GemmaTokenizerFast");

  const auto tok = replica::text::Tokenizer::from_dir(fixture_dir().string());
  EXPECT_EQ(tok.vocab_size(), expected.at("vocab_size").get<int32_t>());
  EXPECT_EQ(tok.bos_id().value_or(-1), 2);
  EXPECT_EQ(tok.eos_id().value_or(-1), 1);
  EXPECT_EQ(tok.pad_id().value_or(-1), 0);
  int texts = 0;
  for (const auto& t : expected.at("texts")) {
    const std::string text = t.at("text");
    SCOPED_TRACE(text);
    const auto ids = tok.encode(text, true);
    EXPECT_EQ(ids, t.at("ids").get<std::vector<int32_t>>());
    EXPECT_EQ(tok.encode(text, false), t.at("plain").get<std::vector<int32_t>>());
    EXPECT_EQ(tok.decode(ids), t.at("decoded").get<std::string>());
    EXPECT_EQ(tok.decode(ids, true), t.at("decoded_skip").get<std::string>());
    ++texts;
  }
  EXPECT_GE(texts, 10);

  // Gemma 3's template from tokenizer_config.json, with the tokenizer's special tokens, as
  // apply_chat_template renders it; its ids without added special tokens (the template
  // writes <bos>).
  const std::string source = replica::text::chat_template_for("tokenizer", fixture_dir().string());
  EXPECT_NE(source.find("<start_of_turn>"), std::string::npos);
  const replica::text::ChatTemplate tmpl(source);
  const auto specials = replica::text::chat_special_tokens(fixture_dir().string());
  int chats = 0;
  for (const auto& c : expected.at("chats")) {
    SCOPED_TRACE(c.at("messages").dump());
    for (const bool generation : {false, true}) {
      const std::string key = generation ? "generation" : "plain";
      const std::string rendered = tmpl.render(c.at("messages"), generation, specials);
      EXPECT_EQ(rendered, c.at(key).get<std::string>());
      EXPECT_EQ(tok.encode(rendered, false), c.at(key + "_ids").get<std::vector<int32_t>>());
    }
    ++chats;
  }
  EXPECT_EQ(chats, 3);
  std::printf("[gemma tokenizer] %d texts and %d chats (with and without the generation prompt): ids, decodes and "
              "renderings equal transformers' GemmaTokenizerFast\n",
              texts, chats);
}

TEST(GemmaTokenizer, TheFixtureIsWhatTheScriptBuilds) {
  REPLICA_REQUIRE_PYTHON("transformers", "tokenizers");
  replica::testing::ScratchDir dir("replica-gemma-tokenizer-make");
  ASSERT_TRUE(run_script({"make", "--out", dir / "tok"}));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_EQ(replica::testing::read_file(dir.path / "tok" / f), replica::testing::read_file(fixture_dir() / f)) << f;
  }
}
