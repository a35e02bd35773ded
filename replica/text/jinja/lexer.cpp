// Jinja interpreter: the lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True).
// See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// Lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True)
// ---------------------------------------------------------------------------------------

[[noreturn]] void syntax_error(const std::string& message, int line) {
  throw ChatTemplateError(EKind::Syntax,
                          "chat template syntax error: " + message + " (line " + std::to_string(line) + ")",
                          line);
}

bool is_dig(char c) { return c >= '0' && c <= '9'; }
int hex_val(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

namespace {

// One code point of UTF-8 text at p (its byte length in *len).
char32_t cp_at(const std::string& s, size_t p, size_t* len) {
  unsigned char c = static_cast<unsigned char>(s[p]);
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  size_t n = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
  if (p + n > s.size()) n = 1;
  std::u32string d = decode_utf8(s.substr(p, n));
  if (d.size() != 1) {
    *len = 1;
    return 0xDC00 + c;
  }
  *len = n;
  return d[0];
}

size_t skip_ws(const std::string& s, size_t p) {
  while (p < s.size()) {
    size_t len;
    char32_t c = cp_at(s, p, &len);
    if (!py_isspace(c)) break;
    p += len;
  }
  return p;
}

bool all_ws(const std::string& s, size_t from) {
  return skip_ws(s, from) == s.size();
}

std::string py_rstrip_ws(const std::string& s) {
  if (is_ascii(s)) {
    size_t e = s.size();
    while (e > 0 && py_isspace(static_cast<unsigned char>(s[e - 1]))) --e;
    return s.substr(0, e);
  }
  std::u32string d = decode_utf8(s);
  size_t e = d.size();
  while (e > 0 && py_isspace(d[e - 1])) --e;
  return encode_utf8(d.data(), d.data() + e);
}

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }

// A string literal's value: Python's "unicode-escape" decoding of the text between the
// quotes, after Jinja2's encode("ascii", "backslashreplace").
std::string unescape_literal(const std::string& raw, int line) {
  std::string out;
  size_t i = 0;
  while (i < raw.size()) {
    char c = raw[i];
    if (c != '\\') {
      out.push_back(c);
      ++i;
      continue;
    }
    if (i + 1 >= raw.size()) syntax_error("\\ at end of string", line);
    char e = raw[i + 1];
    i += 2;
    switch (e) {
      case '\n': break;
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'v': out.push_back('\v'); break;
      case 'x':
      case 'u':
      case 'U': {
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t v = 0;
        for (int k = 0; k < digits; ++k) {
          int h = i + k < raw.size() ? hex_val(raw[i + k]) : -1;
          if (h < 0) {
            syntax_error(std::string("truncated \\") + e +
                             (e == 'x' ? "XX" : e == 'u' ? "XXXX" : "XXXXXXXX") + " escape",
                         line);
          }
          v = v * 16 + static_cast<uint32_t>(h);
        }
        if (v > 0x10FFFF) syntax_error("illegal Unicode character", line);
        i += static_cast<size_t>(digits);
        append_utf8(out, v);
        break;
      }
      case 'N': syntax_error("\\N{...} escapes are not supported", line);
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && i < raw.size() && raw[i] >= '0' && raw[i] <= '7'; ++k, ++i) {
            v = v * 8 + static_cast<uint32_t>(raw[i] - '0');
          }
          append_utf8(out, v);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          // backslashreplace turned the character into an escape that now reads literally
          size_t len;
          char32_t cp = cp_at(raw, i - 1, &len);
          i = i - 1 + len;
          out.push_back('\\');
          out += cp <= 0xFF ? hex_escape("\\x", cp, 2).substr(1)
                 : cp <= 0xFFFF ? hex_escape("\\u", cp, 4).substr(1)
                                : hex_escape("\\U", cp, 8).substr(1);
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) {
    // newlines normalized to \n; keep_trailing_newline=False drops one trailing newline
    s_.reserve(source.size());
    for (size_t k = 0; k < source.size(); ++k) {
      if (source[k] == '\r') {
        s_.push_back('\n');
        if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
      } else {
        s_.push_back(source[k]);
      }
    }
    if (!s_.empty() && s_.back() == '\n') s_.pop_back();
  }

  std::vector<Token> run() {
    const size_t n = s_.size();
    while (pos_ < n) {
      size_t tag = std::string::npos;
      for (size_t k = s_.find('{', pos_); k != std::string::npos; k = s_.find('{', k + 1)) {
        if (k + 1 < n && (s_[k + 1] == '{' || s_[k + 1] == '%' || s_[k + 1] == '#')) {
          tag = k;
          break;
        }
      }
      if (tag == std::string::npos) {
        emit_data(s_.substr(pos_), line_);
        advance_to(n);
        break;
      }
      char kind = s_[tag + 1];
      size_t j = tag + 2;
      char sign = 0;
      if (j < n && (s_[j] == '-' || s_[j] == '+')) sign = s_[j++];

      // {% raw %} ... {% endraw %}
      size_t raw_body = std::string::npos;
      bool raw_end_newline = false;
      if (kind == '%') {
        size_t q = skip_ws(s_, j);
        if (s_.compare(q, 3, "raw") == 0) {
          q = skip_ws(s_, q + 3);
          if (s_.compare(q, 3, "-%}") == 0) {
            raw_body = skip_ws(s_, q + 3);
            raw_end_newline = raw_body > 0 && s_[raw_body - 1] == '\n';
          } else if (s_.compare(q, 2, "%}") == 0) {
            raw_body = q + 2;
          }
        }
      }

      std::string text = s_.substr(pos_, tag - pos_);
      apply_lstrip(text, sign, kind != '{');
      emit_data(text, line_);
      advance_to(tag);
      line_starting_ = false;

      if (raw_body != std::string::npos) {
        line_starting_ = raw_end_newline;
        lex_raw(raw_body);
      } else if (kind == '#') {
        lex_comment(j);
      } else {
        lex_tag(kind, j);
      }
    }
    Token eof;
    eof.type = TT::Eof;
    eof.line = line_;
    toks_.push_back(eof);
    return std::move(toks_);
  }

 private:
  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> toks_;

  void advance_to(size_t p) {
    for (size_t k = pos_; k < p && k < s_.size(); ++k) {
      if (s_[k] == '\n') ++line_;
    }
    pos_ = p;
  }
  void emit_data(const std::string& text, int line) {
    if (text.empty()) return;
    Token t;
    t.type = TT::Data;
    t.value = text;
    t.line = line;
    toks_.push_back(std::move(t));
  }
  void emit(TT type, std::string value = "") {
    Token t;
    t.type = type;
    t.value = std::move(value);
    t.line = line_;
    toks_.push_back(std::move(t));
  }
  // "-": strip all whitespace before the tag; lstrip_blocks: strip the spaces and tabs
  // between the start of the line and a block or comment tag.
  void apply_lstrip(std::string& text, char sign, bool lstrip_applies) {
    if (sign == '-') {
      text = py_rstrip_ws(text);
    } else if (sign != '+' && lstrip_applies) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && l_pos < text.size() && all_ws(text, l_pos)) {
        text.resize(l_pos);
      }
    }
  }

  void lex_comment(size_t body) {
    size_t e = s_.find("#}", body);
    if (e == std::string::npos) syntax_error("Missing end of comment tag", line_);
    size_t end;
    if (e > body && s_[e - 1] == '-') {
      end = skip_ws(s_, e + 2);
    } else if (e > body && s_[e - 1] == '+') {
      end = e + 2;
    } else {
      end = e + 2;
      if (end < s_.size() && s_[end] == '\n') ++end;
    }
    line_starting_ = s_[end - 1] == '\n';
    advance_to(end);
  }

  void lex_raw(size_t body) {
    const size_t n = s_.size();
    for (size_t q = s_.find("{%", body); q != std::string::npos; q = s_.find("{%", q + 1)) {
      size_t p = q + 2;
      char sign = 0;
      if (p < n && (s_[p] == '-' || s_[p] == '+')) sign = s_[p++];
      p = skip_ws(s_, p);
      if (s_.compare(p, 6, "endraw") != 0) continue;
      p = skip_ws(s_, p + 6);
      size_t end;
      if (s_.compare(p, 3, "+%}") == 0) {
        end = p + 3;
      } else if (s_.compare(p, 3, "-%}") == 0) {
        end = skip_ws(s_, p + 3);
      } else if (s_.compare(p, 2, "%}") == 0) {
        end = p + 2;
        if (end < n && s_[end] == '\n') ++end;
      } else {
        continue;
      }
      std::string text = s_.substr(body, q - body);
      apply_lstrip(text, sign, true);
      advance_to(body);
      emit_data(text, line_);
      line_starting_ = s_[end - 1] == '\n';
      advance_to(end);
      return;
    }
    syntax_error("Missing end of raw directive", line_);
  }

  size_t digit_run(size_t p) const {  // \d+(_\d+)*
    const size_t n = s_.size();
    if (p >= n || !is_dig(s_[p])) return std::string::npos;
    while (p < n && is_dig(s_[p])) ++p;
    while (p + 1 < n && s_[p] == '_' && is_dig(s_[p + 1])) {
      ++p;
      while (p < n && is_dig(s_[p])) ++p;
    }
    return p;
  }

  void lex_tag(char kind, size_t start) {
    const size_t n = s_.size();
    emit(kind == '{' ? TT::VarBegin : TT::BlockBegin);
    advance_to(start);
    std::vector<char> balance;
    while (true) {
      if (balance.empty()) {
        const char* close = kind == '{' ? "}}" : "%}";
        if (pos_ < n && s_[pos_] == '-' && s_.compare(pos_ + 1, 2, close) == 0) {
          emit(kind == '{' ? TT::VarEnd : TT::BlockEnd);
          size_t end = skip_ws(s_, pos_ + 3);
          line_starting_ = s_[end - 1] == '\n';
          advance_to(end);
          return;
        }
        if (kind == '%' && s_.compare(pos_, 3, "+%}") == 0) {
          emit(TT::BlockEnd);
          line_starting_ = false;
          advance_to(pos_ + 3);
          return;
        }
        if (s_.compare(pos_, 2, close) == 0) {
          emit(kind == '{' ? TT::VarEnd : TT::BlockEnd);
          size_t end = pos_ + 2;
          if (kind == '%' && end < n && s_[end] == '\n') ++end;  // trim_blocks
          line_starting_ = s_[end - 1] == '\n';
          advance_to(end);
          return;
        }
      }
      if (pos_ >= n) return;  // the parser reports the missing end
      size_t len;
      char32_t c = cp_at(s_, pos_, &len);
      if (py_isspace(c)) {
        size_t end = skip_ws(s_, pos_);
        line_starting_ = s_[end - 1] == '\n';
        advance_to(end);
        continue;
      }
      line_starting_ = false;
      char ch = s_[pos_];
      if (is_dig(ch)) {
        lex_number();
        continue;
      }
      if (is_name_start(ch)) {
        size_t e = pos_;
        while (e < n && is_name_char(s_[e])) ++e;
        emit(TT::Name, s_.substr(pos_, e - pos_));
        advance_to(e);
        continue;
      }
      if (ch == '\'' || ch == '"') {
        size_t e = pos_ + 1;
        bool closed = false;
        while (e < n) {
          if (s_[e] == '\\') {
            e += 2;
            continue;
          }
          if (s_[e] == ch) {
            closed = true;
            break;
          }
          ++e;
        }
        if (!closed) {
          syntax_error(std::string("unexpected char ") + str_repr(std::string(1, ch)) + " at " +
                           std::to_string(pos_),
                       line_);
        }
        Token t;
        t.type = TT::String;
        t.line = line_;
        t.value = unescape_literal(s_.substr(pos_ + 1, e - pos_ - 1), line_);
        toks_.push_back(std::move(t));
        advance_to(e + 1);
        continue;
      }
      static const char* two[] = {"**", "//", "==", "!=", ">=", "<="};
      bool matched = false;
      for (const char* op : two) {
        if (s_.compare(pos_, 2, op) == 0) {
          emit(TT::Op, op);
          advance_to(pos_ + 2);
          matched = true;
          break;
        }
      }
      if (matched) continue;
      if (std::strchr("+-/*%~[](){}><=.:|,;", ch) != nullptr && ch != 0) {
        if (ch == '(' || ch == '[' || ch == '{') {
          balance.push_back(ch == '(' ? ')' : ch == '[' ? ']' : '}');
        } else if (ch == ')' || ch == ']' || ch == '}') {
          if (balance.empty()) syntax_error(std::string("unexpected '") + ch + "'", line_);
          if (balance.back() != ch) {
            syntax_error(std::string("unexpected '") + ch + "', expected '" + balance.back() + "'",
                         line_);
          }
          balance.pop_back();
        }
        emit(TT::Op, std::string(1, ch));
        advance_to(pos_ + 1);
        continue;
      }
      syntax_error("unexpected char " + str_repr(s_.substr(pos_, len)) + " at " +
                       std::to_string(pos_),
                   line_);
    }
  }

  void lex_number() {
    const size_t n = s_.size();
    auto strip_us = [](std::string t) {
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      return t;
    };
    // float: (?<!\.)D((\.D)?[eE][+-]?D|\.D)
    if (!(pos_ > 0 && s_[pos_ - 1] == '.')) {
      size_t d1 = digit_run(pos_);
      size_t fe = std::string::npos;
      size_t p = d1;
      if (p < n && s_[p] == '.') {
        size_t d2 = digit_run(p + 1);
        if (d2 != std::string::npos) p = d2;
      }
      if (p < n && (s_[p] == 'e' || s_[p] == 'E')) {
        size_t p2 = p + 1;
        if (p2 < n && (s_[p2] == '+' || s_[p2] == '-')) ++p2;
        size_t d3 = digit_run(p2);
        if (d3 != std::string::npos) fe = d3;
      }
      if (fe == std::string::npos && d1 < n && s_[d1] == '.') {
        size_t d2 = digit_run(d1 + 1);
        if (d2 != std::string::npos) fe = d2;
      }
      if (fe != std::string::npos) {
        Token t;
        t.type = TT::Float;
        t.line = line_;
        t.value = strip_us(s_.substr(pos_, fe - pos_));
        t.fval = std::strtod(t.value.c_str(), nullptr);
        toks_.push_back(std::move(t));
        advance_to(fe);
        return;
      }
    }
    // integer: 0b.. | 0o.. | 0x.. | [1-9](_?\d)* | 0(_?0)*
    size_t p = pos_;
    int base = 10;
    auto digit_ok = [&](char c) {
      if (base == 2) return c == '0' || c == '1';
      if (base == 8) return c >= '0' && c <= '7';
      if (base == 16) return hex_val(c) >= 0;
      return is_dig(c);
    };
    auto run = [&](size_t q, bool zeros_only) {
      while (q < n) {
        size_t r = q;
        if (s_[r] == '_') ++r;
        if (r < n && digit_ok(s_[r]) && (!zeros_only || s_[r] == '0')) {
          q = r + 1;
        } else {
          break;
        }
      }
      return q;
    };
    size_t end;
    if (s_[p] == '0' && p + 1 < n && std::strchr("bBoOxX", s_[p + 1]) != nullptr &&
        s_[p + 1] != 0) {
      char b = static_cast<char>(std::tolower(static_cast<unsigned char>(s_[p + 1])));
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      end = run(p + 2, false);
      if (end == p + 2) {
        base = 10;
        end = run(p + 1, true);
      }
    } else if (s_[p] == '0') {
      end = run(p + 1, true);
    } else {
      end = run(p + 1, false);
    }
    std::string text = strip_us(s_.substr(p, end - p));
    if (base != 10) text = text.substr(2);
    Token t;
    t.type = TT::Int;
    t.line = line_;
    t.value = s_.substr(p, end - p);
    errno = 0;
    unsigned long long v = std::strtoull(text.c_str(), nullptr, base);
    if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX)) {
      syntax_error("integer literal too large: " + t.value, line_);
    }
    t.ival = static_cast<int64_t>(v);
    toks_.push_back(std::move(t));
    advance_to(end);
  }
};

}  // namespace

std::vector<Token> lex_template(const std::string& source) {
  Lexer lexer(source);
  return lexer.run();
}

}  // namespace replica::text::detail::jinja
