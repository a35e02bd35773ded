// replica::text::Tokenizer: Hugging Face tokenizer.json and SentencePiece tokenizer.model.
//
// Why our own engine: the trainer needs token ids identical to the ones the model was trained
// with, from C++, without Python. A tokenizer.json is run the way Hugging Face's Rust engine
// (`tokenizers`) runs it:
//   added tokens split out of the raw text (leftmost-longest; single_word/lstrip/rstrip;
//   `normalized` ones matched again after normalization) -> normalizer -> pre-tokenizer ->
//   BPE model -> post-processor (TemplateProcessing adds BOS/EOS when add_special_tokens).
// The conformance test (tests/tokenizer_conformance_test.cpp, tests/conformance/) compares
// ids and decoded text with Hugging Face's engine on real Llama 3, Qwen 3 and Mistral
// vocabularies: they must be 100% equal.
//
// Supported tokenizer.json components (anything else is a replica::Error naming the
// component type and the file):
//   normalizer:     Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip,
//                   StripAccents
//   pre_tokenizer:  Sequence, Split (Regex or String pattern, every behavior, invert),
//                   ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit
//   model:          BPE (merges as "a b" or [a, b], byte_fallback, fuse_unk, unk_token,
//                   ignore_merges, continuing_subword_prefix, end_of_word_suffix)
//   decoder:        Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip,
//                   BPEDecoder
//   post_processor: TemplateProcessing, ByteLevel, Sequence, RobertaProcessing,
//                   BertProcessing
//   truncation:     max_length and direction of a single sequence; `padding` is ignored.
// Regexes are Oniguruma patterns (what the Rust engine uses); they run on PCRE2 (UTF + UCP)
// after translating the classes whose meaning differs (\s, \w, \h) and adding to \p{X}
// the characters assigned after PCRE2's Unicode 14 (the Rust engine's regexes know Unicode
// 16). Unicode normalization uses ICU restricted to Unicode 11.0 characters, as the Rust
// engine's tables. BPE-dropout is not applied (encoding is deterministic).
// tokenizer.model goes through libsentencepiece, opened with dlopen in isolation (its bundled
// protobuf clashes with LibTorch's; see sentencepiece.cpp).
//
// Input text that is not valid UTF-8 is read with each invalid sequence replaced by U+FFFD.
//
// A tokenizer is immutable after loading, cheap to copy (shared state) and safe to use from
// several threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace replica::text {

// The most bytes read from tokenizer_config.json or special_tokens_map.json (real ones are at
// most a few MB, with a large added_tokens_decoder); tokenizer.json may have core/files.h's
// default (the largest real ones are ~35 MB).
inline constexpr uint64_t kMaxTokenizerConfigBytes = uint64_t{64} << 20;

class Tokenizer {
 public:
  // `dir` holds tokenizer.json (preferred) or tokenizer.model; tokenizer_config.json, when
  // present, names the bos/eos/pad tokens and, for tokenizer.model only, add_bos_token /
  // add_eos_token (defaults true / false, as Hugging Face's LlamaTokenizer).
  // With tokenizer.json, BOS/EOS come from its post_processor only: a file whose
  // post_processor adds no BOS gets none, whatever tokenizer_config.json says.
  static Tokenizer from_dir(const std::string& dir);
  // One tokenizer.json, no tokenizer_config.json.
  static Tokenizer from_json_file(const std::string& path);
  // tokenizer.json content held in memory; `origin` names it in error messages.
  static Tokenizer from_json_string(const std::string& json, const std::string& origin);
  // One SentencePiece tokenizer.model (through libsentencepiece), as from_dir would load it
  // without tokenizer_config.json: BOS added, no EOS.
  static Tokenizer from_sentencepiece_file(const std::string& path);

  // Token ids of `text`. add_special_tokens applies the post-processor (BOS etc.) as Hugging
  // Face's encode(text, add_special_tokens=True) does. Special tokens written in the text
  // (e.g. "<|im_start|>") always become their ids.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Text of `ids` through the tokenizer's decoder, as Hugging Face's decode(ids,
  // skip_special_tokens). Ids outside the vocabulary are skipped, as there.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(const std::string& token) const;
  // The token's string ("" for an id outside the vocabulary).
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  // One past the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const;
  // The file it was loaded from.
  const std::string& source() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Trains a SentencePiece model through libsentencepiece_train (opened in isolation like
// libsentencepiece) with spm_train's "--flag=value" arguments, e.g. "--input=corpus.txt
// --model_prefix=DIR/tokenizer --vocab_size=1000 --model_type=bpe"; writes PREFIX.model and
// PREFIX.vocab. replica::Error with the trainer's message when it fails.
void train_sentencepiece(const std::string& spm_train_args);

// Renders one chat (a JSON list of {"role", "content"} messages, as text) to the prompt text.
using ChatRenderer = std::function<std::string(const std::string& messages_json)>;

// `replica tokenize --tokenizer DIR [--chat]`: reads one text per line from `in` (a trailing
// "\r" is dropped) and writes its ids as a JSON list per line, e.g. "[128000,9906]".
// Texts are encoded with add_special_tokens = true. With `chat`, each line is a JSON messages
// list rendered by `render_chat` and encoded with add_special_tokens = false (the template
// writes BOS itself, as transformers' apply_chat_template(tokenize=True) does).
// With `json_lines` (and no `chat`), each line is one text as a JSON string, so that a text may
// hold line breaks ("a\nb"); encoded like a plain line.
// Returns the exit status (0); errors are replica::Error naming the line.
int tokenize_command(const std::string& tokenizer_dir, bool chat, std::istream& in,
                     std::ostream& out, const ChatRenderer& render_chat = {}, bool json_lines = false);

}  // namespace replica::text
