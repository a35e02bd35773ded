// UTF-8 helpers and the Unicode properties and normalization forms the tokenizer needs (ICU).
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/uniset.h>
#include <unicode/unistr.h>

#include <cstring>

#include "replica/core/text.h"
#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

char32_t next_cp(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  const size_t n = cp_len(b0);
  char32_t cp = n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < n && i + k < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  }
  i += n;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 with `consumed` = the bytes of the
// maximal invalid subpart (at least 1), per the Unicode "substitution of maximal subparts"
// practice that Rust's from_utf8_lossy follows.
size_t valid_seq(std::string_view s, size_t i, size_t& consumed) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  consumed = 1;
  if (b0 < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return 0;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
    consumed = k + 1;
  }
  return need;
}

}  // namespace

std::string text_excerpt(std::string_view s, size_t max_bytes) { return replica::excerpt(s, max_bytes); }

bool is_valid_utf8(std::string_view s) {
  size_t i = 0, consumed;
  while (i < s.size()) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const size_t n = valid_seq(s, i, consumed);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  if (is_valid_utf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 16);
  size_t i = 0, consumed;
  while (i < s.size()) {
    const size_t n = valid_seq(s, i, consumed);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      i += consumed;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

bool is_white_space(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE);
}

namespace {

// Word characters (letters, marks, digits) assigned after the Unicode version of the ICU we
// build with (Debian 12: ICU 72, Unicode 15.0) that the Rust engine (Rust's regex \w,
// Unicode 16/17) knows.
constexpr std::pair<char32_t, char32_t> kNewerWordChars[] = {
    {0x897, 0x897},     {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},
    {0x105C0, 0x105F3}, {0x10D40, 0x10D65}, {0x10D69, 0x10D6D}, {0x10D6F, 0x10D85},
    {0x10EC2, 0x10EC4}, {0x10EFC, 0x10EFC}, {0x11380, 0x11389}, {0x1138B, 0x1138B},
    {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113C0}, {0x113C2, 0x113C2},
    {0x113C5, 0x113C5}, {0x113C7, 0x113CA}, {0x113CC, 0x113D3}, {0x113E1, 0x113E2},
    {0x116D0, 0x116E3}, {0x11BC0, 0x11BE0}, {0x11BF0, 0x11BF9}, {0x11F5A, 0x11F5A},
    {0x13460, 0x143FA}, {0x16100, 0x16139}, {0x16D40, 0x16D6C}, {0x16D70, 0x16D79},
    {0x18CFF, 0x18CFF}, {0x1CCF0, 0x1CCF9}, {0x1E5D0, 0x1E5FA}, {0x2EBF0, 0x2EE5D}};

// Lowercase mappings of the same later characters (Rust's char::to_lowercase knows them).
char32_t newer_lowercase(char32_t cp) {
  if (cp >= 0x10D50 && cp <= 0x10D65) return cp + 0x20;  // Garay
  if (cp >= 0x16EA0 && cp <= 0x16EB8) return cp + 0x1B;  // Beria Erfe
  switch (cp) {
    case 0x1C89: return 0x1C8A;
    case 0xA7CB: return 0x0264;
    case 0xA7CC: return 0xA7CD;
    case 0xA7CE: return 0xA7CF;
    case 0xA7D2: return 0xA7D3;
    case 0xA7D4: return 0xA7D5;
    case 0xA7DA: return 0xA7DB;
    case 0xA7DC: return 0x019B;
    default: return 0;
  }
}

}  // namespace

bool is_word_char(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') ||
           cp == '_';
  }
  const auto c = static_cast<UChar32>(cp);
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  const int32_t mask = U_GET_GC_MASK(c);
  if ((mask & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0) return true;
  for (const auto& [lo, hi] : kNewerWordChars) {
    if (cp >= lo && cp <= hi) return true;
  }
  return false;
}

bool is_numeric(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  if ((U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_N_MASK) != 0) return true;
  // Digits assigned after the Unicode version of the ICU we build with (Debian 12: ICU 72,
  // Unicode 15), which Rust's char::is_numeric knows: Garay, Myanmar Extended-C, Sunuwar,
  // Tolong Siki, Gurung Khema, Kirat Rai, Tangut components, outlined digits, Ol Onal.
  static constexpr std::pair<char32_t, char32_t> kNewer[] = {
      {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x11DE0, 0x11DE9},
      {0x16130, 0x16139}, {0x16D70, 0x16D79}, {0x16FF4, 0x16FF6}, {0x1CCF0, 0x1CCF9},
      {0x1E5F1, 0x1E5FA}};
  for (const auto& [lo, hi] : kNewer) {
    if (cp >= lo && cp <= hi) return true;
  }
  return false;
}

namespace {

// Characters assigned up to Unicode `version` (ICU's Age property).
const icu::UnicodeSet& assigned_by(const char* pattern) {
  UErrorCode status = U_ZERO_ERROR;
  auto* s = new icu::UnicodeSet(icu::UnicodeString(pattern, -1, US_INV), status);
  if (U_FAILURE(status)) fail("ICU: cannot build {} ({})", pattern, u_errorName(status));
  s->freeze();
  return *s;  // lives for the program
}

// The Rust engine normalizes with the `unicode-normalization-alignments` crate, whose tables
// are Unicode 11.0: characters assigned later have no decomposition, composition or
// combining class there. Normalizing only the characters of Unicode 11.0 reproduces it
// exactly (normalization of assigned characters never changes between versions).
const icu::UnicodeSet& unicode_11() {
  static const icu::UnicodeSet& set = assigned_by("[:age=11.0:]");
  return set;
}

// The same crate's is_combining_mark (StripAccents) is General_Category M of Unicode 9.0.
const icu::UnicodeSet& unicode_9() {
  static const icu::UnicodeSet& set = assigned_by("[:age=9.0:]");
  return set;
}

}  // namespace

bool is_mark(char32_t cp) {
  if (cp < 0x80) return false;
  // Marks in 9.0 that are letters now, and a punctuation mark that became a mark.
  if (cp == 0x1CF2 || cp == 0x1CF3) return true;
  if (cp == 0x111C9) return false;
  return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_M_MASK) != 0 &&
         unicode_9().contains(static_cast<UChar32>(cp));
}

namespace {

bool is_ascii(const std::string& s) {
  for (unsigned char c : s) {
    if (c >= 0x80) return false;
  }
  return true;
}

}  // namespace

std::string unicode_normalize(const std::string& s, NormalForm form) {
  if (is_ascii(s)) return s;  // ASCII is stable under every form
  struct Forms {
    std::unique_ptr<icu::FilteredNormalizer2> by_form[4];
    Forms() {
      UErrorCode status = U_ZERO_ERROR;
      const icu::Normalizer2* base[4] = {
          icu::Normalizer2::getNFCInstance(status), icu::Normalizer2::getNFDInstance(status),
          icu::Normalizer2::getNFKCInstance(status), icu::Normalizer2::getNFKDInstance(status)};
      if (U_FAILURE(status)) fail("Unicode normalization unavailable (ICU: {})", u_errorName(status));
      for (int k = 0; k < 4; ++k) {
        by_form[k] = std::make_unique<icu::FilteredNormalizer2>(*base[k], unicode_11());
      }
    }
  };
  static const Forms forms;
  const icu::Normalizer2& n = *forms.by_form[static_cast<int>(form)];
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString in = icu::UnicodeString::fromUTF8(s);
  if (n.quickCheck(in, status) == UNORM_YES && U_SUCCESS(status)) return s;
  status = U_ZERO_ERROR;
  icu::UnicodeString normalized;
  n.normalize(in, normalized, status);
  if (U_FAILURE(status)) fail("Unicode normalization failed (ICU: {})", u_errorName(status));
  std::string out;
  normalized.toUTF8String(out);
  return out;
}

std::string lowercase(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b >= 'A' && b <= 'Z' ? b + 32 : b));
      ++i;
      continue;
    }
    const char32_t cp = next_cp(s, i);
    if (const char32_t newer = newer_lowercase(cp)) {
      append_utf8(out, newer);
      continue;
    }
    // Full (possibly multi-character) lowercase of this code point alone, as Rust's
    // char::to_lowercase: a one-character string has no final-sigma context.
    icu::UnicodeString one(static_cast<UChar32>(cp));
    one.toLower(icu::Locale::getRoot());
    std::string part;
    one.toUTF8String(part);
    out += part;
  }
  return out;
}

}  // namespace replica::text::detail
