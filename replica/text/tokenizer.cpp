// replica::text::Tokenizer: loading, the added-token split, encode/decode, tokenizer.model,
// and `replica tokenize`.
#include "replica/text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <istream>
#include <ostream>
#include <sstream>
#include <unordered_set>

#include <spdlog/spdlog.h>

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace detail;

namespace {

struct AddedToken {
  std::string content;
  // What decoding sees: the normalizer's output for a `normalized` token, as the Rust engine
  // (its AddedVocabulary normalized cache); else the content.
  std::string decoded;
  int32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// Leftmost-longest matching of a set of strings (what the Rust engine's Aho-Corasick
// automaton with MatchKind::LeftmostLongest finds), over a byte trie.
class Matcher {
 public:
  bool empty() const { return terminal_.size() <= 1; }
  void add(const std::string& s, size_t value) {
    if (s.empty()) return;
    size_t node = 0;
    for (unsigned char c : s) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | c;
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, terminal_.size()).first;
        terminal_.push_back(kNone);
      }
      node = it->second;
    }
    first_[static_cast<unsigned char>(s[0])] = true;
    if (terminal_[node] == kNone) terminal_[node] = value;  // the first of equal strings wins
  }
  // The leftmost-longest match at or after `from`: (start, end, value).
  bool find(std::string_view s, size_t from, size_t& start, size_t& end, size_t& value) const {
    for (size_t pos = from; pos < s.size(); ++pos) {
      if (!first_[static_cast<unsigned char>(s[pos])]) continue;
      size_t node = 0, best_end = 0, best = kNone;
      for (size_t k = pos; k < s.size(); ++k) {
        const auto it = edges_.find((static_cast<uint64_t>(node) << 8) |
                                    static_cast<unsigned char>(s[k]));
        if (it == edges_.end()) break;
        node = it->second;
        if (terminal_[node] != kNone) {
          best = terminal_[node];
          best_end = k + 1;
        }
      }
      if (best != kNone) {
        start = pos;
        end = best_end;
        value = best;
        return true;
      }
    }
    return false;
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  std::unordered_map<uint64_t, size_t> edges_;
  std::vector<size_t> terminal_{kNone};  // node 0 = root
  std::array<bool, 256> first_{};
};

// A span of the input: text still to tokenize, or an added token's id.
struct Segment {
  std::string text;
  int32_t id = -1;
  bool at_origin = false;
};

char32_t last_cp(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_cp(s, start);
}

// tokenizer_config.json token fields are a string, null, or {"content": ...}.
std::optional<std::string> config_token(const json& config, const char* key,
                                        const std::string& path) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  fail("tokenizer_config.json '{}': \"{}\" must be a token string, not {}", path, key, json_excerpt(*it));
}

std::optional<bool> config_bool(const json& config, const char* key, const std::string& path) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) fail("tokenizer_config.json '{}': \"{}\" must be true or false", path, key);
  return it->get<bool>();
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;

  // tokenizer.json
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Bpe> model;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<PostProcessor> post;
  std::optional<size_t> truncate_to;
  bool truncate_left = false;

  // Added tokens (both modes).
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::unordered_set<std::string> special_contents;
  Matcher raw_matcher, normalized_matcher;

  // tokenizer.model
  std::unique_ptr<SentencePieceModel> spm;
  bool add_bos = true, add_eos = false;

  std::optional<int32_t> bos, eos, pad;
  int32_t vocab_size = 0;

  void load_json(const json& j);
  void load_sentencepiece(const std::string& path);
  void add_token(AddedToken t);
  void build_matchers();
  void apply_config(const json& config, const std::string& path);

  void find_matches(const std::string& s, const Matcher& m, bool at_origin,
                    std::vector<Segment>& out) const;
  std::vector<Segment> extract(const std::string& text) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;
  std::optional<int32_t> token_to_id(const std::string& token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
};

void Tokenizer::Impl::add_token(AddedToken t) {
  if (t.content.empty()) return;
  if (t.special) special_contents.insert(t.content);
  if (const auto it = added_by_content.find(t.content); it != added_by_content.end()) {
    // The same content again: same id, the new flags (as the Rust engine).
    t.id = it->second;
    added[added_by_id.at(t.id)] = std::move(t);
    return;
  }
  added_by_content.emplace(t.content, t.id);
  if (const auto it = added_by_id.find(t.id); it != added_by_id.end()) {
    added[it->second] = std::move(t);
    return;
  }
  added_by_id.emplace(t.id, added.size());
  added.push_back(std::move(t));
}

void Tokenizer::Impl::build_matchers() {
  for (auto& t : added) {
    t.decoded = t.content;
    if (t.normalized && normalizer) normalizer->normalize(t.decoded);
  }
  // Special tokens first, then the others, as the Rust engine orders its automaton.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t k = 0; k < added.size(); ++k) {
      const AddedToken& t = added[k];
      if (t.special != (pass == 0)) continue;
      if (!t.normalized) {
        raw_matcher.add(t.content, k);
      } else {
        normalized_matcher.add(t.decoded, k);
      }
    }
  }
}

void Tokenizer::Impl::load_json(const json& j) {
  const Origin origin{source};
  if (!j.is_object()) fail("tokenizer.json '{}': must be a JSON object", source);

  const auto mit = j.find("model");
  if (mit == j.end() || !mit->is_object()) fail("tokenizer.json '{}': missing \"model\"", source);
  const std::string model_type =
      mit->contains("type") ? origin.str(*mit, "type", "model")
                            : (mit->contains("merges") ? "BPE" : "(untyped)");
  if (model_type != "BPE") origin.fail_component("model", model_type);
  model = std::make_unique<Bpe>(*mit, origin);

  auto component = [&](const char* key) -> const json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const json* n = component("normalizer")) normalizer = make_normalizer(*n, origin);
  if (const json* p = component("pre_tokenizer")) pre_tokenizer = make_pre_tokenizer(*p, origin);
  if (const json* d = component("decoder")) decoder = make_decoder(*d, origin);
  if (const json* p = component("post_processor")) post = make_post_processor(*p, origin);
  if (const json* t = component("truncation")) {
    truncate_to = static_cast<size_t>(origin.integer(*t, "max_length", "truncation"));
    truncate_left = origin.str(*t, "direction", "truncation", "Right") == "Left";
  }

  if (const json* a = component("added_tokens")) {
    if (!a->is_array()) fail("tokenizer.json '{}': \"added_tokens\" must be a list", source);
    for (const auto& t : *a) {
      const std::string kind = "added_tokens";
      AddedToken tok;
      tok.content = origin.str(t, "content", kind);
      const int64_t id = origin.integer(t, "id", kind);
      if (id < 0 || id >= kMaxTokenId) {
        origin.fail_field(kind, fmt::format("bad id {} for '{}' (ids are 0..{})", id, text_excerpt(tok.content),
                                            kMaxTokenId - 1));
      }
      // Ids as the Rust engine gives them (it reads the file's "id" only to warn when they
      // differ): a token already known keeps its id, a new one gets the next free id.
      if (const auto known = added_by_content.find(tok.content); known != added_by_content.end()) {
        tok.id = known->second;
      } else if (const auto in_model = model->token_to_id(tok.content)) {
        tok.id = *in_model;
      } else {
        const auto model_size = static_cast<int64_t>(model->vocab_count());
        int64_t next = model_size;
        if (!added.empty()) {
          int64_t max_added = 0;
          for (const auto& a : added) max_added = std::max<int64_t>(max_added, a.id);
          if (max_added >= model_size || model_size == 0) next = max_added + 1;
        }
        tok.id = static_cast<int32_t>(next);
      }
      tok.special = origin.boolean(t, "special", kind, false);
      tok.single_word = origin.boolean(t, "single_word", kind, false);
      tok.lstrip = origin.boolean(t, "lstrip", kind, false);
      tok.rstrip = origin.boolean(t, "rstrip", kind, false);
      tok.normalized = origin.boolean(t, "normalized", kind, !tok.special);
      if (tok.id != id) {
        // The Rust engine warns the same way ("Token '…' was expected to have ID '…' but was
        // given ID '…'"): a file whose ids disagree with its vocabulary is a broken file, and
        // the model's embedding rows no longer match what the file says.
        spdlog::warn("{}: added token '{}' has id {} in the file but gets id {} (a token in the "
                     "vocabulary keeps its id there, a new one takes the next free id, as in the "
                     "tokenizers library)",
                     source, text_excerpt(tok.content), id, tok.id);
      }
      add_token(std::move(tok));
    }
  }
  build_matchers();

  vocab_size = model->max_id() + 1;
  for (const auto& t : added) vocab_size = std::max(vocab_size, t.id + 1);
  if (post) bos = post->first_special();
}

void Tokenizer::Impl::load_sentencepiece(const std::string& path) {
  spm = std::make_unique<SentencePieceModel>(path);
  vocab_size = spm->size();
  // Control and unknown pieces written in the text are those tokens, as in Hugging Face's
  // (slow) LlamaTokenizer.
  for (int id = 0; id < spm->size(); ++id) {
    if (spm->is_control(id) || spm->is_unknown(id)) {
      AddedToken t;
      t.content = spm->piece(id);
      t.id = id;
      t.special = true;
      add_token(std::move(t));
    }
  }
  auto id_or_none = [](int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; };
  bos = id_or_none(spm->bos_id());
  eos = id_or_none(spm->eos_id());
  pad = id_or_none(spm->pad_id());
}

void Tokenizer::Impl::apply_config(const json& config, const std::string& path) {
  if (!config.is_object()) fail("tokenizer_config.json '{}': must be a JSON object", path);
  if (spm) {
    // Added tokens beyond the model (e.g. chat markers), with their flags.
    if (const auto it = config.find("added_tokens_decoder"); it != config.end() && it->is_object()) {
      for (const auto& [key, t] : it->items()) {
        int64_t id = -1;
        try {
          size_t used = 0;
          id = std::stoll(key, &used);
          if (used != key.size()) id = -1;
        } catch (const std::exception&) {
        }
        // Ids beyond the model stretch the vocabulary (vocab_size is the largest id + 1); the
        // bound keeps that an int32 and below any embedding a model could have.
        if (id < 0 || id >= kMaxTokenId) {
          fail("tokenizer_config.json '{}': added_tokens_decoder key '{}' is not an id (0..{})", path,
               text_excerpt(key), kMaxTokenId - 1);
        }
        if (!t.is_object() || !t.contains("content") || !t["content"].is_string()) {
          fail("tokenizer_config.json '{}': added_tokens_decoder '{}' needs \"content\"", path, text_excerpt(key));
        }
        if (added_by_id.count(id)) continue;
        AddedToken tok;
        tok.content = t["content"].get<std::string>();
        tok.id = static_cast<int32_t>(id);
        // (nlohmann's value() would throw its own type_error for a non-boolean flag)
        // (a structured binding cannot be captured in C++17: clang refuses it)
        auto flag = [&, &entry = t](const char* name) {
          const auto v = config_bool(entry, name, path);
          return v && *v;
        };
        tok.special = flag("special");
        tok.single_word = flag("single_word");
        tok.lstrip = flag("lstrip");
        tok.rstrip = flag("rstrip");
        tok.normalized = false;
        add_token(std::move(tok));
        vocab_size = std::max(vocab_size, static_cast<int32_t>(id) + 1);
      }
    }
    raw_matcher = Matcher();
    normalized_matcher = Matcher();
    build_matchers();
    if (auto v = config_bool(config, "add_bos_token", path)) add_bos = *v;
    if (auto v = config_bool(config, "add_eos_token", path)) add_eos = *v;
  }
  auto lookup = [&](const char* key, std::optional<int32_t>& slot) {
    if (!config.contains(key)) return;
    const auto token = config_token(config, key, path);
    if (!token) {
      slot.reset();
      return;
    }
    const auto id = token_to_id(*token);
    if (!id) fail("tokenizer_config.json '{}': {} '{}' is not in the vocabulary", path, key, text_excerpt(*token));
    slot = id;
  };
  lookup("bos_token", bos);
  lookup("eos_token", eos);
  lookup("pad_token", pad);
}

std::optional<int32_t> Tokenizer::Impl::token_to_id(const std::string& token) const {
  if (const auto it = added_by_content.find(token); it != added_by_content.end()) return it->second;
  if (model) return model->token_to_id(token);
  if (spm) {
    const int id = spm->piece_to_id(token);
    if (id != spm->unk_id() || spm->piece(id) == token) return id;
  }
  return std::nullopt;
}

std::optional<std::string> Tokenizer::Impl::id_to_token(int32_t id) const {
  if (const auto it = added_by_id.find(id); it != added_by_id.end()) return added[it->second].decoded;
  if (model) {
    if (const std::string* t = model->id_to_token(id)) return *t;
  } else if (spm && id >= 0 && id < spm->size()) {
    return spm->piece(id);
  }
  return std::nullopt;
}

// The Rust engine's AddedVocabulary::find_matches.
void Tokenizer::Impl::find_matches(const std::string& s, const Matcher& m, bool at_origin,
                                   std::vector<Segment>& out) const {
  if (s.empty()) return;
  if (m.empty()) {
    out.push_back(Segment{s, -1, at_origin});
    return;
  }
  size_t start_offset = 0, pos = 0, start = 0, stop = 0, index = 0;
  while (m.find(s, pos, start, stop, index)) {
    pos = stop;
    const AddedToken& t = added[index];
    if (t.single_word) {
      const bool start_space = start == 0 || !is_word_char(last_cp(std::string_view(s).substr(0, start)));
      size_t i = stop;
      const bool stop_space = stop == s.size() || !is_word_char(next_cp(s, i));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      size_t b = start;
      while (b > start_offset) {
        size_t prev = b - 1;
        while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
        size_t i = prev;
        if (!is_white_space(next_cp(s, i))) break;
        b = prev;
      }
      start = b;
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        size_t i = stop;
        if (!is_white_space(next_cp(s, i))) break;
        stop = i;
      }
      pos = stop;
    }
    if (start_offset < start) {
      out.push_back(Segment{s.substr(start_offset, start - start_offset), -1,
                            at_origin && start_offset == 0});
    }
    out.push_back(Segment{std::string(), t.id, false});
    start_offset = stop;
  }
  if (start_offset < s.size()) {
    out.push_back(Segment{s.substr(start_offset), -1, at_origin && start_offset == 0});
  }
}

// Added tokens out of the raw text, then normalization, then `normalized` added tokens.
std::vector<Segment> Tokenizer::Impl::extract(const std::string& text) const {
  std::vector<Segment> raw;
  find_matches(text, raw_matcher, true, raw);
  if (!normalizer && normalized_matcher.empty()) return raw;
  std::vector<Segment> out;
  out.reserve(raw.size());
  for (auto& seg : raw) {
    if (seg.id >= 0) {
      out.push_back(std::move(seg));
      continue;
    }
    if (normalizer) normalizer->normalize(seg.text);
    find_matches(seg.text, normalized_matcher, seg.at_origin, out);
  }
  return out;
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view input, bool add_special_tokens) const {
  const std::string text = utf8_lossy(input);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  const std::vector<Segment> segments = extract(text);

  if (spm) {
    for (const auto& seg : segments) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      const std::vector<int> piece_ids = spm->encode(seg.text);
      ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    }
    if (add_special_tokens) {
      if (add_bos && bos) ids.insert(ids.begin(), *bos);
      if (add_eos && eos) ids.push_back(*eos);
    }
    return ids;
  }

  std::vector<Piece> pieces;
  for (const auto& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    if (seg.text.empty()) continue;
    pieces.clear();
    pieces.push_back(Piece{seg.text, seg.at_origin});
    if (pre_tokenizer) pre_tokenizer->pre_tokenize(pieces);
    for (const auto& p : pieces) model->tokenize(p.text, ids);
  }
  if (truncate_to) {
    const size_t added_n = add_special_tokens && post ? post->added_tokens() : 0;
    const size_t keep = *truncate_to > added_n ? *truncate_to - added_n : 0;
    if (ids.size() > keep) {
      if (truncate_left) {
        ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(keep));
      } else {
        ids.resize(keep);
      }
    }
  }
  if (add_special_tokens && post) post->process(ids);
  return ids;
}

std::string Tokenizer::Impl::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  if (spm) {
    std::string out;
    std::vector<int> run;
    auto flush = [&] {
      if (run.empty()) return;
      out += spm->decode(run);
      run.clear();
    };
    for (const int32_t id : ids) {
      if (const auto it = added_by_id.find(id); it != added_by_id.end()) {
        if (skip_special_tokens && added[it->second].special) continue;
        flush();
        out += added[it->second].content;
      } else if (id >= 0 && id < spm->size()) {
        run.push_back(id);
      }
    }
    flush();
    return out;
  }

  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    auto token = id_to_token(id);
    if (!token) continue;
    if (skip_special_tokens && special_contents.count(*token)) continue;
    tokens.push_back(std::move(*token));
  }
  if (!decoder) {
    std::string out;
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (k) out += ' ';
      out += tokens[k];
    }
    return out;
  }
  decoder->decode_chain(tokens);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

// ---- Tokenizer ----

Tokenizer Tokenizer::from_json_string(const std::string& text, const std::string& origin) {
  const json j = parse_json(text, "tokenizer.json '" + origin + "'");
  auto impl = std::make_shared<Impl>();
  impl->source = origin;
  impl->load_json(j);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_json_file(const std::string& path) {
  const json j = replica::read_json_file(path);
  auto impl = std::make_shared<Impl>();
  impl->source = path;
  impl->load_json(j);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_sentencepiece_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail("tokenizer.model '{}' does not exist", path);
  require_regular_file(path);  // libsentencepiece opens it itself: a FIFO would block it
  auto impl = std::make_shared<Impl>();
  impl->source = path;
  impl->load_sentencepiece(path);
  impl->build_matchers();
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  if (!fs::is_directory(dir)) fail("tokenizer directory '{}' does not exist", dir);
  const std::string json_path = (fs::path(dir) / "tokenizer.json").string();
  const std::string model_path = (fs::path(dir) / "tokenizer.model").string();
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  auto impl = std::make_shared<Impl>();
  // Whatever exists under these names is read, and refused unless it is a regular file (a
  // FIFO named tokenizer.json would block the reader; passing over it would hide it).
  std::error_code ec;
  if (fs::exists(json_path, ec)) {
    impl->source = json_path;
    impl->load_json(replica::read_json_file(json_path));
  } else if (fs::exists(model_path, ec)) {
    require_regular_file(model_path);
    impl->source = model_path;
    impl->load_sentencepiece(model_path);
    impl->build_matchers();
  } else {
    fail("tokenizer directory '{}' has neither tokenizer.json nor tokenizer.model", dir);
  }
  if (fs::exists(config_path, ec)) {
    impl->apply_config(parse_json(read_file(config_path, kMaxTokenizerConfigBytes), config_path), config_path);
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::optional<int32_t> Tokenizer::token_to_id(const std::string& token) const {
  return impl_->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  return impl_->id_to_token(id).value_or(std::string());
}

bool Tokenizer::is_special(int32_t id) const {
  const auto token = impl_->id_to_token(id);
  if (!token) return false;
  if (impl_->spm) {
    const auto it = impl_->added_by_id.find(id);
    return it != impl_->added_by_id.end() && impl_->added[it->second].special;
  }
  return impl_->special_contents.count(*token) > 0;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }
int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::source() const { return impl_->source; }

// ---- replica tokenize ----

void train_sentencepiece(const std::string& spm_train_args) { detail::train_sentencepiece(spm_train_args); }

namespace {

// nlohmann's parse error without its "[json.exception...] parse error at line 1, column N: "
// prefix (the line is stdin's, which the caller names).
std::string json_error_reason(const json::parse_error& e) {
  std::string what = e.what();
  if (auto k = what.find("column "); k != std::string::npos) {
    if (k = what.find(": ", k); k != std::string::npos) return what.substr(k + 2);
  }
  return what;
}

// One stdin line of `replica tokenize --json-lines`: a JSON string.
std::string json_line_text(const std::string& line, size_t line_no) {
  json value;
  try {
    value = json::parse(line);
  } catch (const json::parse_error& e) {
    fail("replica tokenize --json-lines: stdin line {} is not valid JSON (byte {}): {}; each line must be "
         "one text as a JSON string, e.g. \"first line\\nsecond line\"",
         line_no, e.byte, json_error_reason(e));
  }
  if (!value.is_string()) {
    fail("replica tokenize --json-lines: stdin line {} is a JSON {}, not a string; each line must be one "
         "text as a JSON string, e.g. \"first line\\nsecond line\"",
         line_no, value.type_name());
  }
  return value.get<std::string>();
}

}  // namespace

int tokenize_command(const std::string& tokenizer_dir, bool chat, std::istream& in,
                     std::ostream& out, const ChatRenderer& render_chat, bool json_lines) {
  const Tokenizer tokenizer = Tokenizer::from_dir(tokenizer_dir);
  if (chat && !render_chat) {
    // The renderer comes from the caller (the CLI wires replica/text/chat_template).
    fail("replica tokenize --chat: no chat template renderer is available for '{}'",
         tokenizer_dir);
  }
  std::string line;
  size_t line_no = 0;
  std::string buffer;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<int32_t> ids;
    if (chat) {
      const json messages = parse_json(line, fmt::format("replica tokenize --chat: stdin line {}", line_no));
      if (!messages.is_array()) {
        fail("replica tokenize --chat: stdin line {} must be a JSON list of messages", line_no);
      }
      ids = tokenizer.encode(render_chat(line), /*add_special_tokens=*/false);
    } else if (json_lines) {
      ids = tokenizer.encode(json_line_text(line, line_no), /*add_special_tokens=*/true);
    } else {
      ids = tokenizer.encode(line, /*add_special_tokens=*/true);
    }
    buffer.clear();
    buffer += '[';
    for (size_t k = 0; k < ids.size(); ++k) {
      if (k) buffer += ',';
      buffer += std::to_string(ids[k]);
    }
    buffer += "]\n";
    out << buffer;
  }
  out.flush();
  return 0;
}

}  // namespace replica::text
