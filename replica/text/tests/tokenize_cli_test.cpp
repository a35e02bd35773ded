// `replica tokenize` end to end (the built program, REPLICA_BIN): --json-lines, where each
// stdin line is one text as a JSON string so that texts may hold line breaks, its errors, and
// --chat. The tokenizer is a byte-level BPE without merges, so a text's ids are its bytes.
#include <gtest/gtest.h>
#include "replica/testing/paths.h"
#include <stdlib.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "replica/text/tokenizer_impl.h"
#include "replica/testing/program_runner.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

using replica::testing::read_file;

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

class TokenizeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built (ninja replica_cli)";
    std::string pattern = (fs::temp_directory_path() / "replica_tokenize_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    // Byte-level BPE: the 256 bytes (as GPT-2's characters) are ids 0..255, no merges.
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) {
      std::string c;
      replica::text::detail::append_utf8(c, replica::text::detail::byte_to_char()[b]);
      vocab[c] = b;
    }
    const json tokenizer = {
        {"version", "1.0"},
        {"added_tokens", json::array()},
        {"normalizer", nullptr},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
        {"post_processor", {{"type", "ByteLevel"}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
    };
    std::ofstream(dir_ / "tokenizer.json", std::ios::binary) << tokenizer.dump();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `replica tokenize --tokenizer DIR args...` with `input` on stdin.
  CliRun tokenize(const std::vector<std::string>& args, const std::string& input) const {
    std::ofstream(dir_ / "stdin.txt", std::ios::binary) << input;
    std::string cmd = quote(REPLICA_BIN) + " tokenize --tokenizer " + quote(dir_.string());
    for (const auto& a : args) cmd += " " + quote(a);
    cmd += " < " + quote((dir_ / "stdin.txt").string()) + " > " + quote((dir_ / "stdout.txt").string()) + " 2> " +
           quote((dir_ / "stderr.txt").string());
    const int status = std::system(cmd.c_str());
    CliRun r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(dir_ / "stdout.txt");
    r.err = read_file(dir_ / "stderr.txt");
    return r;
  }

  // The ids of `text`: its bytes, as a JSON list line.
  static std::string bytes_line(const std::string& text) {
    std::string s = "[";
    for (size_t k = 0; k < text.size(); ++k) {
      s += (k ? "," : "") + std::to_string(static_cast<unsigned char>(text[k]));
    }
    return s + "]\n";
  }

  fs::path dir_;
};

TEST_F(TokenizeCli, JsonLinesHoldLineBreaks) {
  const std::string input = R"("first line\nsecond line")" "\n"
                            R"("")" "\n"
                            R"("caf\u00e9\r\n\ttab")" "\r\n"  // a CRLF line end is fine
                            R"(  "x"  )" "\n";                // white space around the string too
  const CliRun r = tokenize({"--json-lines"}, input);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, bytes_line("first line\nsecond line") + bytes_line("") + bytes_line("caf\xC3\xA9\r\n\ttab") +
                       bytes_line("x"));
  // The underscore spelling is the same flag.
  const CliRun alias = tokenize({"--json_lines"}, input);
  ASSERT_EQ(alias.exit_code, 0) << alias.err;
  EXPECT_EQ(alias.out, r.out);
  // Without the flag each line is the text itself, quotes and backslashes included.
  const CliRun plain = tokenize({}, "\"a\\nb\"\n");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.out, bytes_line("\"a\\nb\""));
}

TEST_F(TokenizeCli, JsonLinesErrorsNameTheLine) {
  CliRun r = tokenize({"--json-lines"}, "\"ok\"\n\"fine\"\nnot json\n\"never\"\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("replica tokenize --json-lines: stdin line 3 is not valid JSON"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("110,101,118"), std::string::npos) << "went on after the bad line: " << r.out;

  r = tokenize({"--json-lines"}, "\"unterminated\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("stdin line 1 is not valid JSON"), std::string::npos) << r.err;

  r = tokenize({"--json-lines"}, "\"a\"\n[\"a\", \"b\"]\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("stdin line 2 is a JSON array, not a string"), std::string::npos) << r.err;

  r = tokenize({"--json-lines"}, "\"a\"\n\n");  // an empty line is no JSON string (the empty text is "")
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("stdin line 2 is not valid JSON"), std::string::npos) << r.err;
}

TEST_F(TokenizeCli, ChatLinesAreJsonWithOrWithoutTheFlag) {
  const std::string input = R"([{"role": "user", "content": "two\nlines"}])" "\n";
  const std::string want = bytes_line("<|im_start|>user\ntwo\nlines<|im_end|>\n");
  for (const auto& args : {std::vector<std::string>{"--chat", "--chat-template", "chatml"},
                           std::vector<std::string>{"--chat", "--chat-template", "chatml", "--json-lines"}}) {
    const CliRun r = tokenize(args, input);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, want);
  }
  const CliRun bad = tokenize({"--chat", "--chat-template", "chatml", "--json-lines"}, input + "{oops\n");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("stdin line 2"), std::string::npos) << bad.err;
}

}  // namespace
