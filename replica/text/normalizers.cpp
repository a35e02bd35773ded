// tokenizer.json "normalizer" components, and the JSON field helpers of Origin.
#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

using nlohmann::json;

void Origin::fail_component(const std::string& kind, const std::string& type) const {
  fail("tokenizer.json '{}': unsupported {} type '{}'", file, kind, text_excerpt(type));
}

void Origin::fail_field(const std::string& kind, const std::string& what) const {
  fail("tokenizer.json '{}': {}: {}", file, kind, what);
}

std::string Origin::str(const json& j, const char* key, const std::string& kind,
                        std::optional<std::string> def) const {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    fail_field(kind, fmt::format("missing \"{}\"", key));
  }
  if (!it->is_string()) fail_field(kind, fmt::format("\"{}\" must be a string", key));
  return it->get<std::string>();
}

bool Origin::boolean(const json& j, const char* key, const std::string& kind,
                     std::optional<bool> def) const {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    fail_field(kind, fmt::format("missing \"{}\"", key));
  }
  if (!it->is_boolean()) fail_field(kind, fmt::format("\"{}\" must be true or false", key));
  return it->get<bool>();
}

int64_t Origin::integer(const json& j, const char* key, const std::string& kind,
                        std::optional<int64_t> def) const {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    fail_field(kind, fmt::format("missing \"{}\"", key));
  }
  if (!it->is_number_integer()) fail_field(kind, fmt::format("\"{}\" must be an integer", key));
  return it->get<int64_t>();
}

const json& Origin::array(const json& j, const char* key, const std::string& kind) const {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array()) {
    fail_field(kind, fmt::format("\"{}\" must be a list", key));
  }
  return *it;
}

std::string Origin::type(const json& j, const std::string& kind) const {
  if (!j.is_object()) fail_field(kind, "must be an object");
  return str(j, "type", kind);
}

namespace {

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void normalize(std::string& s) const override {
    for (const auto& p : parts_) p->normalize(s);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  for (;;) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

}  // namespace

Replacement::Replacement(const json& j, const Origin& origin, const std::string& kind) {
  const auto it = j.find("pattern");
  if (it == j.end() || !it->is_object()) origin.fail_field(kind, "missing \"pattern\"");
  content_ = origin.str(j, "content", kind);
  if (it->contains("String")) {
    literal_ = origin.str(*it, "String", kind);
  } else if (it->contains("Regex")) {
    regex_ = std::make_unique<Regex>(origin.str(*it, "Regex", kind),
                                     fmt::format("tokenizer.json '{}': {}", origin.file, kind));
  } else {
    origin.fail_field(kind, "\"pattern\" must hold \"String\" or \"Regex\"");
  }
}

void Replacement::apply(std::string& s) const {
  if (!regex_) {
    replace_all(s, literal_, content_);
    return;
  }
  const auto matches = regex_->find_all(s);
  if (matches.empty()) return;
  std::string out;
  size_t pos = 0;
  for (const auto& [b, e] : matches) {
    out.append(s, pos, b - pos);
    out += content_;
    pos = e;
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

namespace {

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(const json& j, const Origin& origin) : replacement_(j, origin, "normalizer Replace") {}
  void normalize(std::string& s) const override { replacement_.apply(s); }

 private:
  Replacement replacement_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void normalize(std::string& s) const override { s = unicode_normalize(s, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void normalize(std::string& s) const override { s = lowercase(s); }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& s) const override {
    size_t b = 0, e = s.size();
    if (left_) {
      while (b < e) {
        size_t i = b;
        if (!is_white_space(next_cp(s, i))) break;
        b = i;
      }
    }
    if (right_) {
      while (e > b) {
        size_t start = e - 1;
        while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        size_t i = start;
        if (!is_white_space(next_cp(s, i))) break;
        e = start;
      }
    }
    s = s.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer : public Normalizer {
 public:
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    size_t i = 0;
    while (i < s.size()) {
      const size_t start = i;
      const char32_t cp = next_cp(s, i);
      if (!is_mark(cp)) out.append(s, start, i - start);
    }
    s = std::move(out);
  }
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& j, const Origin& origin) {
  const std::string type = origin.type(j, "normalizer");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& p : origin.array(j, "normalizers", "normalizer Sequence")) {
      parts.push_back(make_normalizer(p, origin));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  if (type == "Prepend") {
    return std::make_unique<PrependNormalizer>(origin.str(j, "prepend", "normalizer Prepend"));
  }
  if (type == "Replace") return std::make_unique<ReplaceNormalizer>(j, origin);
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::NFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::NFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(
        origin.boolean(j, "strip_left", "normalizer Strip", true),
        origin.boolean(j, "strip_right", "normalizer Strip", true));
  }
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  origin.fail_component("normalizer", type);
}

}  // namespace replica::text::detail
