// Unit tests of replica::text::Tokenizer on small hand-made tokenizers (the real vocabularies
// are in tokenizer_conformance_test.cpp): BPE merging, byte fallback, unk, truncation,
// errors that name the file and component, tokenizer.model through sentencepiece, and
// `replica tokenize`.
#include <gtest/gtest.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "replica/core/error.h"
#include "replica/text/tokenizer.h"
#include "replica/text/tokenizer_impl.h"

namespace fs = std::filesystem;
using nlohmann::json;
using replica::text::Tokenizer;
using Ids = std::vector<int32_t>;

namespace {

// GPT-2's byte -> character table, as the tokenizer.json vocabularies spell bytes.
std::string byte_char(int b) {
  std::string s;
  replica::text::detail::append_utf8(s, replica::text::detail::byte_to_char()[b]);
  return s;
}

// A byte-level BPE tokenizer: bytes are ids 0..255, then ll=256, he=257, hell=258, Ġw=259.
json byte_level_json(bool pairs = false) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["ll"] = 256;
  vocab["he"] = 257;
  vocab["hell"] = 258;
  vocab["Ġw"] = 259;
  vocab["hello"] = 260;
  json merges = pairs ? json::parse(R"([["l","l"],["h","e"],["he","ll"],["Ġ","w"]])")
                      : json::parse(R"(["l l","h e","he ll","Ġ w"])");
  return {
      {"version", "1.0"},
      {"added_tokens", json::parse(R"([{"id":261,"content":"<|eot|>","special":true,"single_word":false,
                                         "lstrip":false,"rstrip":false,"normalized":false}])")},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", false}}},
  };
}

// A SentencePiece-style BPE (Llama 2 layout): <unk> <s> </s>, <0x00>..<0xFF> = 3..258,
// ▁=259 a=260 b=261 ▁a=262.
json spm_json(bool byte_fallback, bool fuse_unk) {
  json j = json::parse(R"({
    "version": "1.0",
    "added_tokens": [
      {"id":0,"content":"<unk>","special":true,"single_word":false,"lstrip":false,"rstrip":false,"normalized":false},
      {"id":1,"content":"<s>","special":true,"single_word":false,"lstrip":false,"rstrip":false,"normalized":false},
      {"id":2,"content":"</s>","special":true,"single_word":false,"lstrip":false,"rstrip":false,"normalized":false}],
    "normalizer": {"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},
                  {"type":"Replace","pattern":{"String":" "},"content":"▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type":"TemplateProcessing",
      "single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],
      "pair":[],
      "special_tokens":{"<s>":{"id":"<s>","ids":[1],"tokens":["<s>"]}}},
    "decoder": {"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},
      {"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]},
    "model": {"type":"BPE","unk_token":"<unk>","merges":["▁ a"]}
  })");
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
  vocab["▁"] = 259;
  vocab["a"] = 260;
  vocab["b"] = 261;
  vocab["▁a"] = 262;
  j["model"]["vocab"] = vocab;
  j["model"]["byte_fallback"] = byte_fallback;
  j["model"]["fuse_unk"] = fuse_unk;
  return j;
}

Tokenizer load(const json& j, const std::string& name = "test.json") {
  return Tokenizer::from_json_string(j.dump(), name);
}

// The replica::Error message of `f`, or "" if it did not throw one.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const replica::Error& e) {
    return e.what();
  }
  return "";
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           fmt::format("replica-text-test-{}-{}", ::getpid(), counter()++);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
  }
};

}  // namespace

TEST(Bpe, MergesByRank) {
  for (bool pairs : {false, true}) {
    const Tokenizer tok = load(byte_level_json(pairs));
    // "hello" -> h e l l o -> h e ll o -> he ll o -> hell o
    EXPECT_EQ(tok.encode("hello world"), (Ids{258, 'o', 259, 'o', 'r', 'l', 'd'}));
    EXPECT_EQ(tok.decode({258, 'o', 259, 'o', 'r', 'l', 'd'}), "hello world");
    EXPECT_EQ(tok.vocab_size(), 262);
  }
}

TEST(Bpe, IgnoreMergesTakesWholeWords) {
  json j = byte_level_json();
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(j).encode("hello"), (Ids{260}));
  EXPECT_EQ(load(byte_level_json()).encode("hello"), (Ids{258, 'o'}));
}

TEST(Bpe, AddedTokensSplitFirst) {
  const Tokenizer tok = load(byte_level_json());
  EXPECT_EQ(tok.encode("he<|eot|>ll"), (Ids{257, 261, 256}));
  EXPECT_EQ(tok.decode({257, 261, 256}), "he<|eot|>ll");
  EXPECT_EQ(tok.decode({257, 261, 256}, true), "hell");
  EXPECT_TRUE(tok.is_special(261));
  EXPECT_EQ(tok.token_to_id("<|eot|>"), 261);
  EXPECT_EQ(tok.id_to_token(258), "hell");
  EXPECT_EQ(tok.id_to_token(9999), "");
  // Ids outside the vocabulary are skipped when decoding, as Hugging Face does.
  EXPECT_EQ(tok.decode({257, 9999, 256}), "hell");
}

TEST(Bpe, ByteFallbackAndUnk) {
  // "a b€" -> "▁a▁b€" -> ▁a ▁ b <0xE2> <0x82> <0xAC>
  const Tokenizer fallback = load(spm_json(true, true));
  const Ids ids = fallback.encode("a b€");
  EXPECT_EQ(ids, (Ids{1, 262, 259, 261, 3 + 0xE2, 3 + 0x82, 3 + 0xAC}));
  EXPECT_EQ(fallback.decode(ids), "<s> a b€");
  EXPECT_EQ(fallback.decode(ids, true), "a b€");
  EXPECT_EQ(fallback.encode("a b€", false), (Ids{262, 259, 261, 3 + 0xE2, 3 + 0x82, 3 + 0xAC}));
  // An invalid byte run decodes to one U+FFFD per byte.
  EXPECT_EQ(fallback.decode({262, 3 + 0xE2, 3 + 0x82}, true), "a\xEF\xBF\xBD\xEF\xBF\xBD");
  // Without byte fallback: unknown characters become <unk>, fused or not.
  EXPECT_EQ(load(spm_json(false, true)).encode("a€€b", false), (Ids{262, 0, 261}));
  EXPECT_EQ(load(spm_json(false, false)).encode("a€€b", false), (Ids{262, 0, 0, 261}));
  EXPECT_EQ(fallback.bos_id(), 1);
}

TEST(Bpe, Truncation) {
  json j = spm_json(true, true);
  j["truncation"] = {{"max_length", 3}, {"strategy", "LongestFirst"}, {"stride", 0}, {"direction", "Right"}};
  EXPECT_EQ(load(j).encode("a a a a"), (Ids{1, 262, 262}));
  EXPECT_EQ(load(j).encode("a a a a", false), (Ids{262, 262, 262}));
  j["truncation"]["direction"] = "Left";
  EXPECT_EQ(load(j).encode("a a b", false), (Ids{262, 259, 261}));
}

TEST(Tokenizer, InvalidUtf8IsReadLossily) {
  const Tokenizer tok = load(byte_level_json());
  EXPECT_EQ(tok.encode("a\xC3(b"), tok.encode("a\xEF\xBF\xBD(b"));
  EXPECT_EQ(tok.decode(tok.encode("a\xC3(b")), "a\xEF\xBF\xBD(b");
}

TEST(Unicode, LossyUtf8LikeRust) {
  using replica::text::detail::utf8_lossy;
  EXPECT_EQ(utf8_lossy("plain"), "plain");
  EXPECT_EQ(utf8_lossy("\xC3\x28"), "\xEF\xBF\xBD(");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");                       // truncated emoji
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8_lossy("\xFF\xFE"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC\xE2\x82"), "\xE2\x82\xAC\xEF\xBF\xBD");
}

TEST(Unicode, NormalForms) {
  using replica::text::detail::NormalForm;
  using replica::text::detail::unicode_normalize;
  EXPECT_EQ(unicode_normalize("e\xCC\x81", NormalForm::NFC), "\xC3\xA9");
  EXPECT_EQ(unicode_normalize("\xC3\xA9", NormalForm::NFD), "e\xCC\x81");
  EXPECT_EQ(unicode_normalize("\xEF\xAC\x81", NormalForm::NFKC), "fi");  // ligature
  EXPECT_EQ(replica::text::detail::lowercase("ÀΣ İ"), "àσ i\xCC\x87");
}

TEST(Regex, OnigurumaClassesTranslate) {
  using replica::text::detail::translate_onig_pattern;
  const std::string space =
      R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  EXPECT_EQ(translate_onig_pattern(R"(\s+(?!\S))"), "[" + space + "]+(?![^" + space + "])");
  const std::string cls = translate_onig_pattern(R"([^\s\p{L}\p{N}]+)");
  EXPECT_EQ(cls.rfind("[^" + space + R"(\p{L})", 0), 0u) << cls;
  EXPECT_NE(cls.find(R"(\p{N}\x{)"), std::string::npos) << cls;  // + digits newer than PCRE2
  EXPECT_EQ(translate_onig_pattern(R"(\p{Zs}\p{Han})"), R"(\p{Zs}\p{Han})");  // nothing newer
  EXPECT_EQ(translate_onig_pattern(R"(\w+\h)"), R"([\p{L}\p{M}\p{N}\p{Pc}]+[0-9a-fA-F])");
  EXPECT_EQ(translate_onig_pattern(R"([]\s]\.)"), R"([\])" + space + R"(]\.)");
  // U+0085 (NEXT LINE) is white space to Oniguruma; U+180E (MONGOLIAN VOWEL SEPARATOR) is not.
  replica::text::detail::Regex re(R"(\s+)", "test");
  EXPECT_EQ(re.find_all("a\xC2\x85" "b"), (std::vector<std::pair<size_t, size_t>>{{1, 3}}));
  EXPECT_TRUE(re.find_all("a\xE1\xA0\x8E" "b").empty());
  // \p{N} knows Kawi digits (Unicode 15.0) and Garay digits (16.0), as the Rust engine does.
  replica::text::detail::Regex digits(R"(\p{N}+)", "test");
  EXPECT_EQ(digits.find_all("x\xF0\x91\xBD\x90\xF0\x90\xB5\x80"),
            (std::vector<std::pair<size_t, size_t>>{{1, 9}}));
}

TEST(Errors, NameTheFileAndComponent) {
  auto with = [](const char* key, const json& value) {
    json j = byte_level_json();
    j[key] = value;
    return j.dump();
  };
  EXPECT_EQ(error_of([&] { Tokenizer::from_json_string(with("normalizer", {{"type", "BertNormalizer"}}), "m/tokenizer.json"); }),
            "tokenizer.json 'm/tokenizer.json': unsupported normalizer type 'BertNormalizer'");
  EXPECT_EQ(error_of([&] { Tokenizer::from_json_string(with("pre_tokenizer", {{"type", "Punctuation"}}), "x.json"); }),
            "tokenizer.json 'x.json': unsupported pre_tokenizer type 'Punctuation'");
  EXPECT_EQ(error_of([&] { Tokenizer::from_json_string(with("decoder", {{"type", "CTC"}}), "x.json"); }),
            "tokenizer.json 'x.json': unsupported decoder type 'CTC'");
  EXPECT_EQ(error_of([&] { Tokenizer::from_json_string(with("post_processor", {{"type", "BertLike"}}), "x.json"); }),
            "tokenizer.json 'x.json': unsupported post_processor type 'BertLike'");
  EXPECT_EQ(error_of([&] { Tokenizer::from_json_string(with("model", {{"type", "Unigram"}, {"vocab", json::array()}}), "x.json"); }),
            "tokenizer.json 'x.json': unsupported model type 'Unigram'");
  const std::string regex_error = error_of([&] {
    Tokenizer::from_json_string(
        with("pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}),
        "x.json");
  });
  EXPECT_NE(regex_error.find("x.json"), std::string::npos) << regex_error;
  EXPECT_NE(regex_error.find("(unclosed"), std::string::npos) << regex_error;
  json bad_merge = byte_level_json();
  bad_merge["model"]["merges"].push_back("zz q");
  EXPECT_NE(error_of([&] { load(bad_merge, "x.json"); }).find("merge 4 ('zz' 'q')"), std::string::npos);
  EXPECT_NE(error_of([&] { Tokenizer::from_json_string("{not json", "x.json"); })
                .find("tokenizer.json 'x.json': not valid JSON"),
            std::string::npos);
  EXPECT_EQ(error_of([] { Tokenizer::from_json_file("/nonexistent/tokenizer.json"); }),
            "cannot open '/nonexistent/tokenizer.json': No such file or directory");
  EXPECT_EQ(error_of([] { Tokenizer::from_dir("/nonexistent/model"); }),
            "tokenizer directory '/nonexistent/model' does not exist");
  TempDir empty;
  EXPECT_EQ(error_of([&] { Tokenizer::from_dir(empty.path.string()); }),
            fmt::format("tokenizer directory '{}' has neither tokenizer.json nor tokenizer.model",
                        empty.path.string()));
}

TEST(FromDir, ConfigNamesSpecialTokens) {
  TempDir dir;
  dir.write("tokenizer.json", spm_json(true, true).dump());
  dir.write("tokenizer_config.json",
            R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
                "pad_token": null, "add_bos_token": false})");
  const Tokenizer tok = Tokenizer::from_dir(dir.path.string());
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.pad_id(), std::nullopt);
  // tokenizer.json decides BOS, whatever add_bos_token says.
  EXPECT_EQ(tok.encode("a"), (Ids{1, 262}));
  EXPECT_EQ(tok.source(), (dir.path / "tokenizer.json").string());

  dir.write("tokenizer_config.json", R"({"eos_token": "<nope>"})");
  const std::string err = error_of([&] { Tokenizer::from_dir(dir.path.string()); });
  EXPECT_NE(err.find("tokenizer_config.json"), std::string::npos) << err;
  EXPECT_NE(err.find("eos_token '<nope>'"), std::string::npos) << err;
}

// tokenizer.model: a tiny BPE model trained here with libsentencepiece's trainer.
class SentencePiece : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    std::ofstream corpus(dir_->path / "corpus.txt");
    const char* lines[] = {
        "the quick brown fox jumps over the lazy dog",
        "hello world, this is a tiny corpus for a tiny sentencepiece model",
        "tokenizers split text into pieces and pieces into ids",
        "numbers like 12345 and 67890 appear here too",
        "Grüße aus München, ça va très bien",
    };
    for (int k = 0; k < 40; ++k) {
      for (const char* l : lines) corpus << l << "\n";
    }
    corpus.close();
    replica::text::detail::train_sentencepiece(
        fmt::format("--input={} --model_prefix={} --vocab_size=320 --model_type=bpe "
                    "--byte_fallback=true --character_coverage=1.0 --minloglevel=3",
                    (dir_->path / "corpus.txt").string(), (dir_->path / "tokenizer").string()));
    fs::create_directories(dir_->path / "model");
    fs::rename(dir_->path / "tokenizer.model", dir_->path / "model" / "tokenizer.model");
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model_dir() { return (dir_->path / "model").string(); }
  static TempDir* dir_;
};
TempDir* SentencePiece::dir_ = nullptr;

TEST_F(SentencePiece, EncodesAsLibsentencepiece) {
  // libsentencepiece itself is the reference.
  const replica::text::detail::SentencePieceModel sp((fs::path(model_dir()) / "tokenizer.model").string());
  const Tokenizer tok = Tokenizer::from_dir(model_dir());
  for (const std::string text : {"hello world", "the lazy fox 42", "Grüße — 東京 😀", "", "  two  spaces "}) {
    const auto expected = sp.encode(text);
    Ids with_bos{1};
    with_bos.insert(with_bos.end(), expected.begin(), expected.end());
    EXPECT_EQ(tok.encode(text), with_bos) << text;
    EXPECT_EQ(tok.encode(text, false), Ids(expected.begin(), expected.end())) << text;
    EXPECT_EQ(tok.decode(tok.encode(text), true), sp.decode(expected)) << text;
  }
  EXPECT_GT(sp.encode("Grüße — 東京 😀").size(), 5u);  // byte fallback pieces
  EXPECT_EQ(tok.decode(tok.encode("Grüße — 東京 😀"), true), "Grüße — 東京 😀");
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.vocab_size(), 320);
  EXPECT_TRUE(tok.is_special(1));
  // Control tokens written in the text are those tokens.
  const Ids ids = tok.encode("hello</s>world", false);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 2), ids.end());
  EXPECT_EQ(tok.decode(ids), "hello</s>world");
  EXPECT_EQ(tok.decode(ids, true), "hello world");
}

TEST_F(SentencePiece, ConfigSetsBosAndEos) {
  fs::copy_file(fs::path(model_dir()) / "tokenizer.model", dir_->path / "tokenizer.model",
                fs::copy_options::overwrite_existing);
  dir_->write("tokenizer_config.json", R"({"add_bos_token": false, "add_eos_token": true,
      "added_tokens_decoder": {"320": {"content": "<|im_start|>", "special": true}}})");
  const Tokenizer tok = Tokenizer::from_dir(dir_->path.string());
  const Ids ids = tok.encode("hello<|im_start|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_NE(ids.front(), 1);
  EXPECT_EQ(ids[ids.size() - 2], 320);
  EXPECT_EQ(ids.back(), 2);
  EXPECT_EQ(tok.vocab_size(), 321);
  EXPECT_EQ(tok.decode(ids, true), "hello");
  fs::remove(dir_->path / "tokenizer.model");
  fs::remove(dir_->path / "tokenizer_config.json");
  // tokenizer.json wins over tokenizer.model.
  TempDir both;
  fs::copy_file(fs::path(model_dir()) / "tokenizer.model", both.path / "tokenizer.model");
  both.write("tokenizer.json", spm_json(true, true).dump());
  EXPECT_EQ(Tokenizer::from_dir(both.path.string()).source(), (both.path / "tokenizer.json").string());
  EXPECT_NE(error_of([&] { Tokenizer::from_sentencepiece_file((both.path / "tokenizer.json").string()); })
                .find("does not load"),
            std::string::npos);
}

TEST(TokenizeCommand, OneJsonListPerLine) {
  TempDir dir;
  dir.write("tokenizer.json", spm_json(true, true).dump());
  std::istringstream in("a b\r\na\n\nb a");
  std::ostringstream out;
  EXPECT_EQ(replica::text::tokenize_command(dir.path.string(), false, in, out), 0);
  EXPECT_EQ(out.str(), "[1,262,259,261]\n[1,262]\n[1]\n[1,259,261,262]\n");
}

TEST(TokenizeCommand, ChatRendersThenEncodesWithoutSpecialTokens) {
  TempDir dir;
  dir.write("tokenizer.json", spm_json(true, true).dump());
  std::istringstream in(R"([{"role":"user","content":"a"}])" "\n");
  std::ostringstream out;
  auto render = [](const std::string& messages) {
    const json m = json::parse(messages);
    return "<s>" + m[0]["content"].get<std::string>() + "</s>";
  };
  EXPECT_EQ(replica::text::tokenize_command(dir.path.string(), true, in, out, render), 0);
  EXPECT_EQ(out.str(), "[1,262,2]\n");

  std::istringstream bad("not json\n");
  std::ostringstream ignored;
  EXPECT_NE(error_of([&] { replica::text::tokenize_command(dir.path.string(), true, bad, ignored, render); })
                .find("replica tokenize --chat: stdin line 1: not valid JSON"),
            std::string::npos);
  std::istringstream any("[]\n");
  EXPECT_NE(error_of([&] { replica::text::tokenize_command(dir.path.string(), true, any, ignored); })
                .find("--chat"),
            std::string::npos);
}
