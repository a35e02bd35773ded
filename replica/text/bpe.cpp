// The BPE model of tokenizer.json, merging as Hugging Face's Rust engine does:
// a word starts as its characters (or <0xXX> byte tokens, or unk); then, repeatedly, the
// adjacent pair with the lowest merge rank (leftmost on ties) is merged, through a priority
// queue over a linked list of symbols: O(n log n) per word, and words are cached.
#include <queue>

#include "replica/core/error.h"
#include "replica/core/json.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

using nlohmann::json;

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

Bpe::Bpe(const json& model, const Origin& origin) : origin_file_(origin.file) {
  const std::string kind = "model BPE";
  const auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object()) origin.fail_field(kind, "\"vocab\" must be an object");
  vocab_.reserve(vit->size() * 2);
  int32_t max_id = -1;
  for (const auto& [token, id] : vit->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxTokenId) {
      origin.fail_field(kind, fmt::format("vocab id of '{}' must be an integer in 0..{}, not {}",
                                          text_excerpt(token), kMaxTokenId - 1, json_excerpt(id)));
    }
    const auto v = id.get<int32_t>();
    vocab_[token] = v;
    max_id = std::max(max_id, v);
  }
  max_id_ = max_id;
  vocab_r_.reserve(vocab_.size());
  for (const auto& [token, id] : vocab_) vocab_r_[id] = token;

  const auto mit = model.find("merges");
  if (mit != model.end() && !mit->is_null()) {
    if (!mit->is_array()) origin.fail_field(kind, "\"merges\" must be a list");
    merges_.reserve(mit->size() * 2);
    int32_t rank = 0;
    for (const auto& m : *mit) {
      std::string a, b;
      if (m.is_string()) {  // "a b"
        const auto& s = m.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          origin.fail_field(kind, fmt::format("merge {} '{}' is not two tokens", rank, text_excerpt(s)));
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        origin.fail_field(kind, fmt::format("merge {} must be \"a b\" or [a, b]", rank));
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || im == vocab_.end()) {
        origin.fail_field(kind, fmt::format("merge {} ('{}' '{}') uses a token outside the vocab",
                                            rank, text_excerpt(a), text_excerpt(b)));
      }
      // A repeated pair keeps its last rank, as the Rust engine's map does.
      merges_[pair_key(ia->second, ib->second)] = {rank, im->second};
      ++rank;
    }
  }

  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const std::string unk = origin.str(model, "unk_token", kind);
    // One missing from the vocab is an error only once a word needs it, as in the Rust engine.
    const auto it = vocab_.find(unk);
    if (it != vocab_.end()) unk_id_ = it->second;
  }
  if (model.contains("continuing_subword_prefix") && !model["continuing_subword_prefix"].is_null()) {
    continuing_subword_prefix_ = origin.str(model, "continuing_subword_prefix", kind);
    has_prefix_ = !continuing_subword_prefix_.empty();
  }
  if (model.contains("end_of_word_suffix") && !model["end_of_word_suffix"].is_null()) {
    end_of_word_suffix_ = origin.str(model, "end_of_word_suffix", kind);
    has_suffix_ = !end_of_word_suffix_.empty();
  }
  fuse_unk_ = origin.boolean(model, "fuse_unk", kind, false);
  byte_fallback_ = origin.boolean(model, "byte_fallback", kind, false);
  ignore_merges_ = origin.boolean(model, "ignore_merges", kind, false);
  flat_char_ids_.assign(kFlatChars, -1);
  for (const auto& [token, id] : vocab_) {
    size_t i = 0;
    const char32_t cp = token.empty() ? 0 : next_cp(token, i);
    if (token.empty() || i != token.size() || !is_valid_utf8(token)) continue;
    if (cp < kFlatChars) {
      flat_char_ids_[cp] = id;
    } else {
      char_ids_[cp] = id;
    }
  }
  all_bytes_ = true;
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    if (it == vocab_.end()) all_bytes_ = false;
  }
}

std::optional<int32_t> Bpe::char_id(char32_t cp) const {
  if (cp < kFlatChars) {
    const int32_t id = flat_char_ids_[cp];
    return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
  }
  const auto it = char_ids_.find(cp);
  return it == char_ids_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

std::optional<int32_t> Bpe::token_to_id(const std::string& token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::id_to_token(int32_t id) const {
  const auto it = vocab_r_.find(id);
  return it == vocab_r_.end() ? nullptr : &it->second;
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  // The cache holds what the steps below give (a whole-word vocab hit included), so it can
  // be asked first.
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mu_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  const auto whole = ignore_merges_ ? vocab_.find(cacheable ? key : std::string(word)) : vocab_.end();
  if (whole != vocab_.end()) {
    out.push_back(whole->second);
  } else {
    merge_word(word, out);
  }
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::move(key), std::move(ids));
  }
}

void Bpe::merge_word(std::string_view w, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(w.size());
  auto add = [&](int32_t id, size_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, n - 1, n + 1, static_cast<uint32_t>(len)});
  };
  bool unk = false;  // an unk pending (fused while fuse_unk), of unk_len bytes
  size_t unk_len = 0;
  std::string buf;
  size_t i = 0;
  while (i < w.size()) {
    const size_t start = i;
    const size_t n = cp_len(static_cast<unsigned char>(w[i]));
    i = std::min(w.size(), i + n);
    const bool is_first = start == 0, is_last = i >= w.size();
    const std::string_view ch = w.substr(start, i - start);
    const std::string* lookup = &buf;
    std::optional<int32_t> id;
    if ((has_prefix_ && !is_first) || (has_suffix_ && is_last)) {
      buf.clear();
      if (has_prefix_ && !is_first) buf += continuing_subword_prefix_;
      buf.append(ch);
      if (has_suffix_ && is_last) buf += end_of_word_suffix_;
      if (const auto it = vocab_.find(buf); it != vocab_.end()) id = it->second;
    } else {
      size_t k = 0;
      id = char_id(next_cp(ch, k));
      if (!id) buf.assign(ch);
    }
    if (id) {
      if (unk) {
        add(*unk_id_, unk_len);
        unk = false;
      }
      add(*id, ch.size());
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char b : *lookup) {
        if (byte_ids_[b] < 0) {
          all = false;
          break;
        }
      }
      if (all) {
        for (unsigned char b : *lookup) add(byte_ids_[b], 1);
        continue;
      }
    }
    if (!unk_id_) {
      fail("tokenizer.json '{}': '{}' is not in the BPE vocab and the model has no usable "
           "unk_token",
           origin_file_, std::string(ch));
    }
    if (unk && fuse_unk_) {
      unk_len += ch.size();
    } else {
      if (unk) add(*unk_id_, unk_len);
      unk = true;
      unk_len = ch.size();
    }
  }
  if (unk) add(*unk_id_, unk_len);
  if (!symbols.empty()) symbols.back().next = -1;

  struct Merge {
    int32_t pos, rank, new_id;
    bool operator<(const Merge& o) const {  // max-heap: lowest rank, then lowest pos on top
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Merge> initial;
  initial.reserve(symbols.size());
  for (size_t k = 0; k + 1 < symbols.size(); ++k) {
    const auto it = merges_.find(pair_key(symbols[k].id, symbols[k + 1].id));
    if (it != merges_.end()) {
      initial.push_back(Merge{static_cast<int32_t>(k), it->second.first, it->second.second});
    }
  }
  std::priority_queue<Merge> queue(std::less<Merge>(), std::move(initial));
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = symbols[static_cast<size_t>(top.pos)];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[static_cast<size_t>(next_pos)];
    // Skip a stale entry: the pair at this position changed since it was queued.
    const auto check = merges_.find(pair_key(cur.id, right.id));
    if (check == merges_.end() || check->second.second != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[static_cast<size_t>(next_pos)].len = 0;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (cur.prev >= 0) {
      const auto it = merges_.find(pair_key(symbols[static_cast<size_t>(cur.prev)].id, cur.id));
      if (it != merges_.end()) queue.push(Merge{cur.prev, it->second.first, it->second.second});
    }
    if (cur.next >= 0) {
      const auto it = merges_.find(pair_key(cur.id, symbols[static_cast<size_t>(cur.next)].id));
      if (it != merges_.end()) queue.push(Merge{top.pos, it->second.first, it->second.second});
    }
  }
  for (const auto& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace replica::text::detail
