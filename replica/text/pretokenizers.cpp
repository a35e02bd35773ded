// tokenizer.json "pre_tokenizer" components.
#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

using nlohmann::json;

namespace {

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Pattern::find_matches of the Rust engine: matches and the gaps between them.
Matches regex_matches(const Regex& re, std::string_view s, bool invert) {
  Matches m;
  if (s.empty()) {
    m.emplace_back(0, 0, false);
    return m;
  }
  size_t prev = 0;
  for (const auto& [b, e] : re.find_all(s)) {
    if (prev != b) m.emplace_back(prev, b, invert);
    m.emplace_back(b, e, !invert);
    prev = e;
  }
  if (prev != s.size()) m.emplace_back(prev, s.size(), invert);
  return m;
}

// One match per code point for which `pred` holds (the Rust engine's Fn(char) pattern).
template <typename Pred>
Matches char_matches(std::string_view s, Pred pred) {
  Matches m;
  if (s.empty()) {
    m.emplace_back(0, 0, false);
    return m;
  }
  size_t last = 0, i = 0;
  while (i < s.size()) {
    const size_t start = i;
    if (pred(next_cp(s, i))) {
      if (last < start) m.emplace_back(last, start, false);
      m.emplace_back(start, i, true);
      last = i;
    }
  }
  if (last != s.size()) m.emplace_back(last, s.size(), false);
  return m;
}

template <typename F>
void split_each(std::vector<Piece>& pieces, F&& f) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (const auto& p : pieces) f(p, out);
  pieces = std::move(out);
}

SplitBehavior parse_behavior(const std::string& name, const Origin& origin,
                             const std::string& kind) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  origin.fail_field(kind, fmt::format("unknown behavior '{}'", text_excerpt(name)));
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts_) p->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(const json& j, const Origin& origin) {
    const std::string kind = "pre_tokenizer Split";
    const auto it = j.find("pattern");
    if (it == j.end() || !it->is_object()) origin.fail_field(kind, "missing \"pattern\"");
    std::string pattern;
    if (it->contains("String")) {
      pattern = escape_regex(origin.str(*it, "String", kind));
    } else if (it->contains("Regex")) {
      pattern = origin.str(*it, "Regex", kind);
    } else {
      origin.fail_field(kind, "\"pattern\" must hold \"String\" or \"Regex\"");
    }
    regex_ = std::make_unique<Regex>(pattern,
                                     fmt::format("tokenizer.json '{}': {}", origin.file, kind));
    behavior_ = parse_behavior(origin.str(j, "behavior", kind), origin, kind);
    invert_ = origin.boolean(j, "invert", kind, false);
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
      split_by_matches(p, regex_matches(*regex_, p.text, invert_), behavior_, out);
    });
  }

 private:
  std::unique_ptr<Regex> regex_;
  SplitBehavior behavior_ = SplitBehavior::Isolated;
  bool invert_ = false;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(const json& j, const Origin& origin) {
    add_prefix_space_ = origin.boolean(j, "add_prefix_space", "pre_tokenizer ByteLevel", true);
    if (origin.boolean(j, "use_regex", "pre_tokenizer ByteLevel", true)) {
      regex_ = std::make_unique<Regex>(
          kGpt2Pattern, fmt::format("tokenizer.json '{}': pre_tokenizer ByteLevel", origin.file));
    }
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    const auto& table = byte_to_char();
    split_each(pieces, [&](const Piece& in, std::vector<Piece>& out) {
      Piece p = in;
      if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
      const size_t first = out.size();
      if (regex_) {
        split_by_matches(p, regex_matches(*regex_, p.text, false), SplitBehavior::Isolated, out);
      } else if (!p.text.empty()) {
        out.push_back(std::move(p));
      }
      for (size_t k = first; k < out.size(); ++k) {
        std::string mapped;
        mapped.reserve(out[k].text.size() * 2);
        for (unsigned char b : out[k].text) append_utf8(mapped, table[b]);
        out[k].text = std::move(mapped);
      }
    });
  }

 private:
  bool add_prefix_space_ = true;
  std::unique_ptr<Regex> regex_;
};

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  enum class Prepend { Always, First, Never };
  MetaspacePreTokenizer(const json& j, const Origin& origin) {
    const std::string kind = "pre_tokenizer Metaspace";
    replacement_ = origin.str(j, "replacement", kind, "\xE2\x96\x81");
    size_t i = 0;
    if (replacement_.empty() || (next_cp(replacement_, i), i != replacement_.size())) {
      origin.fail_field(kind, "\"replacement\" must be one character");
    }
    std::optional<Prepend> scheme;
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      const std::string s = origin.str(j, "prepend_scheme", kind);
      if (s == "always") {
        scheme = Prepend::Always;
      } else if (s == "first") {
        scheme = Prepend::First;
      } else if (s == "never") {
        scheme = Prepend::Never;
      } else {
        origin.fail_field(kind, fmt::format("unknown prepend_scheme '{}'", text_excerpt(s)));
      }
    }
    // Files written before prepend_scheme existed say add_prefix_space.
    if (j.contains("add_prefix_space") && !j["add_prefix_space"].is_null()) {
      const bool add = origin.boolean(j, "add_prefix_space", kind);
      if (!add) {
        scheme = Prepend::Never;
      } else if (!scheme) {
        scheme = Prepend::Always;
      }
    }
    prepend_ = scheme.value_or(Prepend::Always);
    split_ = origin.boolean(j, "split", kind, true);
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& in, std::vector<Piece>& out) {
      Piece p;
      p.at_origin = in.at_origin;
      p.text.reserve(in.text.size() + 8);
      for (char c : in.text) {
        if (c == ' ') {
          p.text += replacement_;
        } else {
          p.text += c;
        }
      }
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
      if ((prepend_ == Prepend::Always && !starts) ||
          (prepend_ == Prepend::First && !starts && in.at_origin)) {
        p.text.insert(0, replacement_);
      }
      if (!split_) {
        if (!p.text.empty()) out.push_back(std::move(p));
        return;
      }
      Matches m;
      size_t last = 0, pos = 0;
      while ((pos = p.text.find(replacement_, pos)) != std::string::npos) {
        if (last < pos) m.emplace_back(last, pos, false);
        m.emplace_back(pos, pos + replacement_.size(), true);
        pos += replacement_.size();
        last = pos;
      }
      if (p.text.empty()) m.emplace_back(0, 0, false);
      if (last != p.text.size()) m.emplace_back(last, p.text.size(), false);
      split_by_matches(p, m, SplitBehavior::MergedWithNext, out);
    });
  }

 private:
  std::string replacement_;
  Prepend prepend_ = Prepend::Always;
  bool split_ = true;
};

class DigitsPreTokenizer : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual) : individual_(individual) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
      split_by_matches(p, char_matches(p.text, is_numeric),
                       individual_ ? SplitBehavior::Isolated : SplitBehavior::Contiguous, out);
    });
  }

 private:
  bool individual_;
};

// Whitespace: the matches of \w+|[^\w\s]+ are kept, the rest removed.
class WhitespacePreTokenizer : public PreTokenizer {
 public:
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
      const std::string& s = p.text;
      Matches m;
      size_t i = 0, run_start = 0;
      int run_kind = -1;  // 0 word, 1 other, 2 space
      auto flush = [&](size_t end) {
        if (run_kind >= 0 && end > run_start) m.emplace_back(run_start, end, run_kind == 2);
      };
      while (i < s.size()) {
        const size_t start = i;
        const char32_t cp = next_cp(s, i);
        const int kind = is_word_char(cp) ? 0 : is_white_space(cp) ? 2 : 1;
        if (kind != run_kind) {
          flush(start);
          run_start = start;
          run_kind = kind;
        }
      }
      flush(s.size());
      split_by_matches(p, m, SplitBehavior::Removed, out);
    });
  }
};

class WhitespaceSplitPreTokenizer : public PreTokenizer {
 public:
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
      split_by_matches(p, char_matches(p.text, is_white_space), SplitBehavior::Removed, out);
    });
  }
};

}  // namespace

void split_by_matches(const Piece& p, const Matches& matches, SplitBehavior behavior,
                      std::vector<Piece>& out) {
  // (start, end, remove)
  std::vector<std::tuple<size_t, size_t, bool>> splits;
  splits.reserve(matches.size());
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const auto& [b, e, is_match] : matches) splits.emplace_back(b, e, false);
      break;
    case SplitBehavior::Removed:
      for (const auto& [b, e, is_match] : matches) splits.emplace_back(b, e, is_match);
      break;
    case SplitBehavior::Contiguous: {
      bool previous = false;
      for (const auto& [b, e, is_match] : matches) {
        if (is_match == previous && !splits.empty()) {
          std::get<1>(splits.back()) = e;
        } else {
          splits.emplace_back(b, e, false);
        }
        previous = is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool previous = false;
      for (const auto& [b, e, is_match] : matches) {
        if (is_match && !previous && !splits.empty()) {
          std::get<1>(splits.back()) = e;
        } else {
          splits.emplace_back(b, e, false);
        }
        previous = is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool previous = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        const auto& [b, e, is_match] = *it;
        if (is_match && !previous && !splits.empty()) {
          std::get<0>(splits.back()) = b;
        } else {
          splits.emplace_back(b, e, false);
        }
        previous = is_match;
      }
      std::reverse(splits.begin(), splits.end());
      break;
    }
  }
  for (const auto& [b, e, remove] : splits) {
    if (remove || b == e) continue;
    Piece piece;
    piece.text = p.text.substr(b, e - b);
    piece.at_origin = p.at_origin && b == 0;
    out.push_back(std::move(piece));
  }
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const Origin& origin) {
  const std::string type = origin.type(j, "pre_tokenizer");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (const auto& p : origin.array(j, "pretokenizers", "pre_tokenizer Sequence")) {
      parts.push_back(make_pre_tokenizer(p, origin));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (type == "Split") return std::make_unique<SplitPreTokenizer>(j, origin);
  if (type == "ByteLevel") return std::make_unique<ByteLevelPreTokenizer>(j, origin);
  if (type == "Metaspace") return std::make_unique<MetaspacePreTokenizer>(j, origin);
  if (type == "Digits") {
    return std::make_unique<DigitsPreTokenizer>(
        origin.boolean(j, "individual_digits", "pre_tokenizer Digits", false));
  }
  if (type == "Whitespace") return std::make_unique<WhitespacePreTokenizer>();
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPreTokenizer>();
  origin.fail_component("pre_tokenizer", type);
}

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? static_cast<char32_t>(b) : 256 + n++;
    }
    return t;
  }();
  return table;
}

int char_to_byte(char32_t cp) {
  static const std::vector<int> inverse = [] {
    std::vector<int> v(324, -1);
    const auto& t = byte_to_char();
    for (int b = 0; b < 256; ++b) v[t[b]] = b;
    return v;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

}  // namespace replica::text::detail
