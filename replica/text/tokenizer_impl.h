// Internals of replica::text::Tokenizer: the tokenizer.json pipeline stages.
//
// Each stage mirrors the Hugging Face `tokenizers` component of the same name; only what
// changes token ids or decoded text is modelled (no offsets, no pairs).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace replica::text::detail {

// ---- UTF-8 and Unicode helpers (unicode.cpp) ----

// Decodes the code point starting at s[i] (s valid UTF-8) and advances i.
char32_t next_cp(std::string_view s, size_t& i);
// Length in bytes of the UTF-8 sequence starting with byte b (valid UTF-8).
inline size_t cp_len(unsigned char b) {
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}
void append_utf8(std::string& out, char32_t cp);
// Copy of s with every invalid UTF-8 sequence replaced by U+FFFD, as Rust's
// String::from_utf8_lossy (one U+FFFD per maximal invalid subpart).
std::string utf8_lossy(std::string_view s);
bool is_valid_utf8(std::string_view s);
// At most `max_bytes` of `s` (cut at a character boundary), "..." after a cut: a token or a
// pattern in a message, never the whole of one.
std::string text_excerpt(std::string_view s, size_t max_bytes = 40);

// Token ids are int32 and the vocabulary's size is the largest id + 1.
inline constexpr int64_t kMaxTokenId = INT32_MAX;

bool is_white_space(char32_t cp);  // Unicode White_Space (Rust char::is_whitespace, \s)
bool is_word_char(char32_t cp);    // Rust regex \w
bool is_numeric(char32_t cp);      // Rust char::is_numeric: Nd, Nl, No
bool is_mark(char32_t cp);          // General_Category M as of Unicode 9.0 (StripAccents)

// As the Rust engine: Unicode 11.0 normalization (later characters pass through unchanged).
enum class NormalForm { NFC = 0, NFD = 1, NFKC = 2, NFKD = 3 };
std::string unicode_normalize(const std::string& s, NormalForm form);
// Rust char::to_lowercase applied to every code point (no context-sensitive rules).
std::string lowercase(const std::string& s);

// ---- Regex (regex.cpp): an Oniguruma pattern run on PCRE2 ----

class Regex {
 public:
  // `where` names the pattern's origin for errors (e.g. "tokenizer.json 'x': pre_tokenizer
  // Split"); every error (compiling, and matching: PCRE2's match limit on a pattern that
  // backtracks catastrophically) names it and an excerpt of the pattern.
  Regex(const std::string& onig_pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Non-overlapping matches, as Oniguruma's find_iter (byte offsets). `s` is valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string where_;     // "<where>: regex /<pattern excerpt>/"
};
// The PCRE2 pattern an Oniguruma pattern becomes (exposed for tests).
std::string translate_onig_pattern(const std::string& pattern);
// An Oniguruma pattern matching `literal` exactly.
std::string escape_regex(const std::string& literal);

// ---- Pipeline stages ----

// Where a component was found, for errors: "tokenizer.json '/path'".
struct Origin {
  std::string file;
  [[noreturn]] void fail_component(const std::string& kind, const std::string& type) const;
  [[noreturn]] void fail_field(const std::string& kind, const std::string& what) const;
  // j[key] of the expected type; `def` when absent or null (no default: an error).
  std::string str(const nlohmann::json& j, const char* key, const std::string& kind,
                  std::optional<std::string> def = std::nullopt) const;
  bool boolean(const nlohmann::json& j, const char* key, const std::string& kind,
               std::optional<bool> def = std::nullopt) const;
  int64_t integer(const nlohmann::json& j, const char* key, const std::string& kind,
                  std::optional<int64_t> def = std::nullopt) const;
  const nlohmann::json& array(const nlohmann::json& j, const char* key,
                              const std::string& kind) const;
  // "type" of a component object.
  std::string type(const nlohmann::json& j, const std::string& kind) const;
};

// The Replace step of normalizers and decoders: every match of a "pattern" (a "String" or a
// "Regex") becomes "content". `kind` names the step in errors ("normalizer Replace").
class Replacement {
 public:
  Replacement(const nlohmann::json& j, const Origin& origin, const std::string& kind);
  void apply(std::string& s) const;

 private:
  std::string literal_, content_;
  std::unique_ptr<Regex> regex_;
};

struct Piece {
  std::string text;
  bool at_origin = false;  // starts at offset 0 of the original input (Metaspace "first")
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const Origin& origin);

// Pattern matches of a split: (start, end, is_match), covering the whole string.
using Matches = std::vector<std::tuple<size_t, size_t, bool>>;
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
// NormalizedString::split: pieces of `s` per `behavior`, empty pieces dropped.
void split_by_matches(const Piece& p, const Matches& m, SplitBehavior behavior,
                      std::vector<Piece>& out);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const Origin& origin);

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const Origin& origin);

// A special-token template (TemplateProcessing and friends).
class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int32_t>& ids) const = 0;  // add_special_tokens=true
  virtual size_t added_tokens() const = 0;                    // for truncation
  virtual std::optional<int32_t> first_special() const { return std::nullopt; }
};
std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& j,
                                                   const Origin& origin);

// Byte-level BPE's byte <-> printable code point table (GPT-2's bytes_to_unicode).
const std::array<char32_t, 256>& byte_to_char();
// Inverse: code point -> byte, or -1.
int char_to_byte(char32_t cp);

// ---- tokenizer.model (sentencepiece.cpp) ----

// A SentencePiece model through libsentencepiece, which is opened with dlopen in isolation
// (see sentencepiece.cpp for why it is not linked). Errors are replica::Error.
class SentencePieceModel {
 public:
  explicit SentencePieceModel(const std::string& path);
  ~SentencePieceModel();
  SentencePieceModel(const SentencePieceModel&) = delete;
  SentencePieceModel& operator=(const SentencePieceModel&) = delete;
  std::vector<int> encode(std::string_view text) const;
  std::string decode(const std::vector<int>& ids) const;
  int size() const;
  std::string piece(int id) const;
  int piece_to_id(const std::string& piece) const;
  bool is_control(int id) const;
  bool is_unknown(int id) const;
  int unk_id() const;
  int bos_id() const;
  int eos_id() const;
  int pad_id() const;

 private:
  void* sp_ = nullptr;  // sentencepiece::SentencePieceProcessor*
};
// SentencePieceTrainer::Train with spm_train-style "--flag=value" arguments (tests).
void train_sentencepiece(const std::string& args);

// ---- BPE model (bpe.cpp) ----

class Bpe {
 public:
  Bpe(const nlohmann::json& model, const Origin& origin);
  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;
  std::optional<int32_t> token_to_id(const std::string& token) const;
  const std::string* id_to_token(int32_t id) const;
  int32_t max_id() const { return max_id_; }
  size_t vocab_count() const { return vocab_.size(); }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    uint32_t len;  // bytes; 0 = merged away
  };
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  // id -> token: a map, not a vector by id, so that a file with one id of 2,000,000,000
  // costs one entry (the Rust engine's is a HashMap too).
  std::unordered_map<int32_t, std::string> vocab_r_;
  int32_t max_id_ = -1;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_, end_of_word_suffix_;
  bool has_prefix_ = false, has_suffix_ = false;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // <0xXX> tokens (-1 when missing)
  // Ids of the one-character tokens, by code point (a flat table below kFlatChars).
  static constexpr char32_t kFlatChars = 0x3000;
  std::vector<int32_t> flat_char_ids_;
  std::unordered_map<char32_t, int32_t> char_ids_;
  std::optional<int32_t> char_id(char32_t cp) const;
  bool all_bytes_ = false;
  std::string origin_file_;

  static constexpr size_t kCacheMaxWordBytes = 256;  // as the Rust engine
  static constexpr size_t kCacheCapacity = 100000;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace replica::text::detail
