// Jinja interpreter: UTF-8 with Python's surrogateescape, Python's character classes and
// case mapping, repr() of floats and strings. See jinja.h.
#include "replica/text/jinja/jinja.h"
#include "replica/text/tokenizer_impl.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <locale.h>
#include <wctype.h>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// UTF-8 and Python's character classes
// ---------------------------------------------------------------------------------------

// Invalid bytes decode to U+DC80..U+DCFF (Python's surrogateescape) and encode back to the
// same byte, so any byte string survives a decode/encode round trip.
void append_utf8(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {
    out.push_back(static_cast<char>(c - 0xDC00));
  } else {
    detail::append_utf8(out, c);  // the tokenizer's encoder (unicode.cpp)
  }
}

std::u32string decode_utf8(const std::string& s) {
  std::u32string r;
  r.reserve(s.size());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      r.push_back(c);
      ++i;
      continue;
    }
    int len = 0;
    char32_t cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) {
        ok = false;
      } else {
        cp = (cp << 6) | (cc & 0x3F);
      }
    }
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
               (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))) {
      ok = false;
    }
    if (!ok) {
      r.push_back(0xDC00 + c);
      ++i;
      continue;
    }
    r.push_back(cp);
    i += static_cast<size_t>(len);
  }
  return r;
}

std::string encode_utf8(const char32_t* b, const char32_t* e) {
  std::string out;
  out.reserve(static_cast<size_t>(e - b));
  for (; b != e; ++b) append_utf8(out, *b);
  return out;
}
std::string encode_utf8(const std::u32string& s) { return encode_utf8(s.data(), s.data() + s.size()); }

bool is_ascii(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

// Python's str.isspace() (also what `\s` matches in a str regex).
bool py_isspace(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {

locale_t utf8_locale() {
  static locale_t loc = [] {
    locale_t l = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
    if (l == static_cast<locale_t>(nullptr)) {
      l = newlocale(LC_CTYPE_MASK, "C.utf8", static_cast<locale_t>(nullptr));
    }
    return l;
  }();
  return loc;
}

// Python's str.isprintable() for one code point (used by repr()).
bool py_isprintable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (c < 0x7F) return true;
  if (c == 0x061C || c == 0x1680 || c == 0x180E || (c >= 0x2000 && c <= 0x200F) ||
      (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F) || c == 0x3000 ||
      (c >= 0xD800 && c <= 0xF8FF) || c == 0xFEFF || (c >= 0xFFF0 && c <= 0xFFFB) ||
      c == 0xFFFE || c == 0xFFFF || c >= 0xE0000) {
    return false;
  }
  locale_t l = utf8_locale();
  return !l || iswprint_l(static_cast<wint_t>(c), l);
}

}  // namespace

char32_t to_lower_cp(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  locale_t l = utf8_locale();
  return l ? static_cast<char32_t>(towlower_l(static_cast<wint_t>(c), l)) : c;
}
char32_t to_upper_cp(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  locale_t l = utf8_locale();
  return l ? static_cast<char32_t>(towupper_l(static_cast<wint_t>(c), l)) : c;
}
bool is_alpha_cp(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  locale_t l = utf8_locale();
  return l && iswalpha_l(static_cast<wint_t>(c), l);
}
bool is_digit_cp(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  locale_t l = utf8_locale();
  return l && iswdigit_l(static_cast<wint_t>(c), l);
}
bool is_alnum_cp(char32_t c) { return is_alpha_cp(c) || is_digit_cp(c); }
bool is_lower_cp(char32_t c) { return to_upper_cp(c) != c; }
bool is_upper_cp(char32_t c) { return to_lower_cp(c) != c; }

std::string lower_str(const std::string& s) {
  if (is_ascii(s)) {
    std::string r = s;
    for (char& c : r) c = static_cast<char>(to_lower_cp(static_cast<unsigned char>(c)));
    return r;
  }
  std::string r;
  for (char32_t c : decode_utf8(s)) {
    if (c == 0x130) {  // 'İ'.lower() == 'i̇'
      r += "i\xcc\x87";
      continue;
    }
    append_utf8(r, to_lower_cp(c));
  }
  return r;
}
std::string upper_str(const std::string& s) {
  if (is_ascii(s)) {
    std::string r = s;
    for (char& c : r) c = static_cast<char>(to_upper_cp(static_cast<unsigned char>(c)));
    return r;
  }
  std::string r;
  for (char32_t c : decode_utf8(s)) {
    if (c == 0xDF) {  // 'ß'.upper() == 'SS'
      r += "SS";
      continue;
    }
    append_utf8(r, to_upper_cp(c));
  }
  return r;
}

size_t py_len(const std::string& s) {
  if (is_ascii(s)) return s.size();
  return decode_utf8(s).size();
}

std::string hex_escape(const char* prefix, uint32_t v, int width) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s%0*x", prefix, width, v);
  return buf;
}

// ---------------------------------------------------------------------------------------
// Python number formatting
// ---------------------------------------------------------------------------------------

// repr(float): the shortest digits that round-trip, fixed notation for exponents -4..15.
std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0.0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool neg = false;
  size_t p = 0;
  if (sci[0] == '-') {
    neg = true;
    p = 1;
  }
  size_t epos = sci.find('e');
  std::string digits;
  for (size_t k = p; k < epos; ++k) {
    if (sci[k] != '.') digits.push_back(sci[k]);
  }
  int exp = std::stoi(sci.substr(epos + 1));
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += 'e';
    out += exp < 0 ? '-' : '+';
    int ae = exp < 0 ? -exp : exp;
    if (ae < 10) out += '0';
    out += std::to_string(ae);
  } else if (exp >= 0) {
    std::string ip, fp;
    if (digits.size() > static_cast<size_t>(exp) + 1) {
      ip = digits.substr(0, static_cast<size_t>(exp) + 1);
      fp = digits.substr(static_cast<size_t>(exp) + 1);
    } else {
      ip = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0');
      fp = "0";
    }
    out += ip + "." + fp;
  } else {
    out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  }
  return out;
}

// repr(str): Python's quoting and escaping.
std::string str_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : decode_utf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      out += hex_escape("\\x", c, 2);
    } else if (c < 0x7F) {
      out.push_back(static_cast<char>(c));
    } else if (py_isprintable(c)) {
      append_utf8(out, c);
    } else if (c <= 0xFF) {
      out += hex_escape("\\x", c, 2);
    } else if (c <= 0xFFFF) {
      out += hex_escape("\\u", c, 4);
    } else {
      out += hex_escape("\\U", c, 8);
    }
  }
  out.push_back(quote);
  return out;
}

}  // namespace replica::text::detail::jinja
