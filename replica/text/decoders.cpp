// tokenizer.json "decoder" and "post_processor" components.
#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

using nlohmann::json;

namespace {

std::vector<char32_t> to_cps(const std::string& s) {
  std::vector<char32_t> cps;
  cps.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) cps.push_back(next_cp(s, i));
  return cps;
}

std::string one_char(const json& j, const char* key, const Origin& origin,
                     const std::string& kind, const std::string& def) {
  const std::string s = origin.str(j, key, kind, def);
  size_t i = 0;
  if (s.empty() || (next_cp(s, i), i != s.size())) {
    origin.fail_field(kind, fmt::format("\"{}\" must be one character", key));
  }
  return s;
}

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// Byte-level: every token's characters back to bytes (a token with a character outside the
// table keeps its own UTF-8 bytes); the bytes of all tokens read as lossy UTF-8.
class ByteLevelDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& t : tokens) {
      const size_t mark = bytes.size();
      size_t i = 0;
      bool ok = true;
      while (i < t.size()) {
        const int b = char_to_byte(next_cp(t, i));
        if (b < 0) {
          ok = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!ok) {
        bytes.resize(mark);
        bytes += t;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(const json& j, const Origin& origin) {
    const std::string kind = "decoder Metaspace";
    replacement_ = one_char(j, "replacement", origin, kind, "\xE2\x96\x81");
    bool prepend = true;
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      prepend = origin.str(j, "prepend_scheme", kind) != "never";
    }
    if (j.contains("add_prefix_space") && !j["add_prefix_space"].is_null() &&
        !origin.boolean(j, "add_prefix_space", kind)) {
      prepend = false;
    }
    prepend_ = prepend;
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      size_t pos = 0;
      for (;;) {
        const size_t hit = t.find(replacement_, pos);
        out.append(t, pos, hit == std::string::npos ? std::string::npos : hit - pos);
        if (hit == std::string::npos) break;
        if (!(i == 0 && prepend_)) out += ' ';
        pos = hit + replacement_.size();
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool prepend_ = true;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(const json& j, const Origin& origin) : replacement_(j, origin, "decoder Replace") {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) replacement_.apply(t);
  }

 private:
  Replacement replacement_;
};

// "<0xXX>" tokens gathered into bytes; a run that is not valid UTF-8 becomes one U+FFFD per
// byte.
class ByteFallbackDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string bytes;
    auto flush = [&] {
      if (bytes.empty()) return;
      if (is_valid_utf8(bytes)) {
        out.push_back(bytes);
      } else {
        for (size_t k = 0; k < bytes.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      bytes.clear();
    };
    for (auto& t : tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
        auto hex = [](char c) {
          if (c >= '0' && c <= '9') return c - '0';
          if (c >= 'a' && c <= 'f') return c - 'a' + 10;
          if (c >= 'A' && c <= 'F') return c - 'A' + 10;
          return -1;
        };
        const int hi = hex(t[3]), lo = hex(t[4]);
        if (hi >= 0 && lo >= 0) byte = hi * 16 + lo;
      }
      if (byte >= 0) {
        bytes.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(const json& j, const Origin& origin) {
    const std::string kind = "decoder Strip";
    const std::string c = one_char(j, "content", origin, kind, " ");
    size_t i = 0;
    content_ = next_cp(c, i);
    start_ = static_cast<size_t>(origin.integer(j, "start", kind, 0));
    stop_ = static_cast<size_t>(origin.integer(j, "stop", kind, 0));
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      const auto cps = to_cps(t);
      size_t start_cut = 0;
      for (size_t i = 0; i < std::min(start_, cps.size()); ++i) {
        if (cps[i] != content_) break;
        start_cut = i + 1;
      }
      size_t stop_cut = cps.size();
      for (size_t i = 0; i < std::min(stop_, cps.size()); ++i) {
        const size_t index = cps.size() - i - 1;
        if (cps[index] != content_) break;
        stop_cut = index;
      }
      std::string out;
      for (size_t i = start_cut; i < std::max(start_cut, stop_cut); ++i) append_utf8(out, cps[i]);
      t = std::move(out);
    }
  }

 private:
  char32_t content_ = ' ';
  size_t start_ = 0, stop_ = 0;
};

// Classic BPE: the end-of-word suffix becomes a space (none after the last token).
class BpeDecoder : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      const std::string replacement = i + 1 == tokens.size() ? "" : " ";
      std::string out;
      size_t pos = 0;
      for (;;) {
        const size_t hit = suffix_.empty() ? std::string::npos : t.find(suffix_, pos);
        out.append(t, pos, hit == std::string::npos ? std::string::npos : hit - pos);
        if (hit == std::string::npos) break;
        out += replacement;
        pos = hit + suffix_.size();
      }
      t = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

// ---- post-processors ----

class TemplatePostProcessor : public PostProcessor {
 public:
  TemplatePostProcessor(const json& j, const Origin& origin) {
    const std::string kind = "post_processor TemplateProcessing";
    std::unordered_map<std::string, std::vector<int32_t>> specials;
    if (j.contains("special_tokens") && j["special_tokens"].is_object()) {
      for (const auto& [name, st] : j["special_tokens"].items()) {
        std::vector<int32_t> ids;
        for (const auto& id : origin.array(st, "ids", kind)) {
          if (!id.is_number_integer()) origin.fail_field(kind, "special token ids must be integers");
          ids.push_back(id.get<int32_t>());
        }
        specials[name] = std::move(ids);
      }
    }
    bool first = true;
    for (const auto& piece : origin.array(j, "single", kind)) {
      if (piece.contains("SpecialToken")) {
        const std::string id = origin.str(piece["SpecialToken"], "id", kind);
        const auto it = specials.find(id);
        if (it == specials.end()) {
          origin.fail_field(kind, fmt::format("special token '{}' is not in special_tokens", text_excerpt(id)));
        }
        if (first && !it->second.empty()) first_special_ = it->second.front();
        Part part;
        part.ids = it->second;
        parts_.push_back(std::move(part));
      } else if (piece.contains("Sequence")) {
        const std::string id = origin.str(piece["Sequence"], "id", kind);
        if (id != "A") origin.fail_field(kind, "the single template must use sequence A");
        Part part;
        part.sequence = true;
        parts_.push_back(std::move(part));
      } else {
        origin.fail_field(kind, "template pieces must be SpecialToken or Sequence");
      }
      first = false;
    }
  }
  void process(std::vector<int32_t>& ids) const override {
    std::vector<int32_t> out;
    out.reserve(ids.size() + 4);
    for (const auto& p : parts_) {
      if (p.sequence) {
        out.insert(out.end(), ids.begin(), ids.end());
      } else {
        out.insert(out.end(), p.ids.begin(), p.ids.end());
      }
    }
    ids = std::move(out);
  }
  size_t added_tokens() const override {
    size_t n = 0;
    for (const auto& p : parts_) n += p.ids.size();
    return n;
  }
  std::optional<int32_t> first_special() const override { return first_special_; }

 private:
  struct Part {
    bool sequence = false;
    std::vector<int32_t> ids;
  };
  std::vector<Part> parts_;
  std::optional<int32_t> first_special_;
};

// RobertaProcessing / BertProcessing: cls A sep.
class ClsSepPostProcessor : public PostProcessor {
 public:
  ClsSepPostProcessor(const json& j, const Origin& origin, const std::string& kind) {
    auto id_of = [&](const char* key) {
      const auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer()) {
        origin.fail_field(kind, fmt::format("\"{}\" must be [token, id]", key));
      }
      return (*it)[1].get<int32_t>();
    };
    cls_ = id_of("cls");
    sep_ = id_of("sep");
  }
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), cls_);
    ids.push_back(sep_);
  }
  size_t added_tokens() const override { return 2; }
  std::optional<int32_t> first_special() const override { return cls_; }

 private:
  int32_t cls_ = 0, sep_ = 0;
};

class NoopPostProcessor : public PostProcessor {
 public:
  void process(std::vector<int32_t>&) const override {}
  size_t added_tokens() const override { return 0; }
};

class SequencePostProcessor : public PostProcessor {
 public:
  explicit SequencePostProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : parts_) p->process(ids);
  }
  size_t added_tokens() const override {
    size_t n = 0;
    for (const auto& p : parts_) n += p->added_tokens();
    return n;
  }
  std::optional<int32_t> first_special() const override {
    // The last processor to add tokens decides what comes first.
    std::optional<int32_t> first;
    for (const auto& p : parts_) {
      if (auto f = p->first_special()) first = f;
    }
    return first;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& j, const Origin& origin) {
  const std::string type = origin.type(j, "decoder");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> parts;
    for (const auto& p : origin.array(j, "decoders", "decoder Sequence")) {
      parts.push_back(make_decoder(p, origin));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") return std::make_unique<MetaspaceDecoder>(j, origin);
  if (type == "Replace") return std::make_unique<ReplaceDecoder>(j, origin);
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") return std::make_unique<StripDecoder>(j, origin);
  if (type == "BPEDecoder") {
    return std::make_unique<BpeDecoder>(origin.str(j, "suffix", "decoder BPEDecoder", "</w>"));
  }
  origin.fail_component("decoder", type);
}

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const Origin& origin) {
  const std::string type = origin.type(j, "post_processor");
  if (type == "TemplateProcessing") return std::make_unique<TemplatePostProcessor>(j, origin);
  if (type == "ByteLevel") return std::make_unique<NoopPostProcessor>();  // offsets only
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    return std::make_unique<ClsSepPostProcessor>(j, origin, "post_processor " + type);
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> parts;
    for (const auto& p : origin.array(j, "processors", "post_processor Sequence")) {
      parts.push_back(make_post_processor(p, origin));
    }
    return std::make_unique<SequencePostProcessor>(std::move(parts));
  }
  origin.fail_component("post_processor", type);
}

}  // namespace replica::text::detail
