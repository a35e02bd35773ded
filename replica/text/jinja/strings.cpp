// Jinja interpreter: Python's str methods as chat templates call them, str.format and
// printf-style % formatting. See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string_view>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// Python string methods
// ---------------------------------------------------------------------------------------

namespace {

bool in_set(char32_t c, const std::u32string* chars) {
  if (!chars) return py_isspace(c);
  return chars->find(c) != std::u32string::npos;
}

std::vector<std::string> py_split_ws(const std::string& s, int64_t maxsplit, bool from_right) {
  std::u32string d = decode_utf8(s);
  std::vector<std::string> parts;
  if (!from_right) {
    size_t i = 0, n = d.size();
    while (true) {
      while (i < n && py_isspace(d[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(encode_utf8(d.data() + i, d.data() + n));
        break;
      }
      size_t j = i;
      while (j < n && !py_isspace(d[j])) ++j;
      parts.push_back(encode_utf8(d.data() + i, d.data() + j));
      i = j;
    }
    return parts;
  }
  int64_t i = static_cast<int64_t>(d.size());
  while (true) {
    while (i > 0 && py_isspace(d[static_cast<size_t>(i - 1)])) --i;
    if (i <= 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
      parts.push_back(encode_utf8(d.data(), d.data() + i));
      break;
    }
    int64_t j = i;
    while (j > 0 && !py_isspace(d[static_cast<size_t>(j - 1)])) --j;
    parts.push_back(encode_utf8(d.data() + j, d.data() + i));
    i = j;
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

Value str_list(const std::vector<std::string>& parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (const auto& p : parts) items.push_back(make_str(p));
  return make_list(std::move(items));
}

std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : decode_utf8(s)) {
    if (is_upper_cp(c)) {
      append_utf8(out, prev_cased ? to_lower_cp(c) : c);
      prev_cased = true;
    } else if (is_lower_cp(c)) {
      append_utf8(out, prev_cased ? c : to_upper_cp(c));
      prev_cased = true;
    } else {
      append_utf8(out, c);
      prev_cased = false;
    }
  }
  return out;
}

// A start/end argument of str.find, startswith, ... as Python clamps it into [0, len] (None:
// `dflt`; negative: counted from the end).
int64_t slice_bound(const Value* v, int64_t dflt, int64_t len) {
  if (!v || v->k == VK::None) return dflt;
  int64_t x = need_int(*v, "slice index");
  if (x < 0) x = std::max<int64_t>(0, x + len);
  return std::min(x, len);
}

int64_t py_find(const std::string& s, const std::string& sub, const Value* start, const Value* end,
                bool reverse) {
  std::u32string d = decode_utf8(s);
  std::u32string needle = decode_utf8(sub);
  int64_t len = static_cast<int64_t>(d.size());
  int64_t a = slice_bound(start, 0, len), b = slice_bound(end, len, len);
  if (b - a < static_cast<int64_t>(needle.size())) return -1;
  std::u32string_view hay(d.data() + a, static_cast<size_t>(b - a));
  size_t f = reverse ? hay.rfind(needle) : hay.find(needle);
  return f == std::u32string_view::npos ? -1 : a + static_cast<int64_t>(f);
}

std::string pad_str(const std::string& s, int64_t width, char32_t fill, char align) {
  int64_t len = static_cast<int64_t>(py_len(s));
  if (width <= len) return s;
  int64_t total = width - len;
  charge_bytes(static_cast<uint64_t>(total), 4);  // Note [bounded templates]: before the padding
  int64_t left = 0;
  if (align == '>') left = total;
  if (align == '^') left = total / 2;
  std::string f;
  append_utf8(f, fill);
  std::string out;
  for (int64_t k = 0; k < left; ++k) out += f;
  out += s;
  for (int64_t k = 0; k < total - left; ++k) out += f;
  return out;
}

// format(value, spec) for the common specs: [[fill]align][sign][#][0][width][,_][.prec][type]
std::string format_spec(const Value& v, const std::string& spec_utf8) {
  std::u32string spec = decode_utf8(spec_utf8);
  size_t i = 0;
  char32_t fill = ' ';
  char align = 0;
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (spec.size() >= 2 && is_align(spec[1])) {
    fill = spec[0];
    align = static_cast<char>(spec[1]);
    i = 2;
  } else if (!spec.empty() && is_align(spec[0])) {
    align = static_cast<char>(spec[0]);
    i = 1;
  }
  char sign = '-';
  if (i < spec.size() && (spec[i] == '+' || spec[i] == '-' || spec[i] == ' ')) sign = static_cast<char>(spec[i++]);
  bool alt = false;
  if (i < spec.size() && spec[i] == '#') {
    alt = true;
    ++i;
  }
  if (i < spec.size() && spec[i] == '0') {
    if (!align) {
      fill = '0';
      align = '=';
    }
    ++i;
  }
  int64_t width = -1;
  // (saturating: the padding is charged against the render's budget, which refuses it)
  while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') width = std::min<int64_t>((width < 0 ? 0 : width * 10) + (spec[i++] - '0'), INT64_MAX / 16);
  char grouping = 0;
  if (i < spec.size() && (spec[i] == ',' || spec[i] == '_')) grouping = static_cast<char>(spec[i++]);
  int precision = -1;
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    precision = 0;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') precision = std::min(precision * 10 + static_cast<int>(spec[i++] - '0'), 100000000);
  }
  char type = 0;
  if (i < spec.size()) type = static_cast<char>(spec[i++]);
  if (i != spec.size()) raise_error(EKind::Type, "Invalid format specifier");

  if (v.k == VK::Undefined) fail_undefined(v);
  std::string body, sign_str;
  bool numeric = false;
  if (v.k == VK::Str || (!v.is_num() && type == 0) || type == 's') {
    if (type != 0 && type != 's') {
      raise_error(EKind::Type, std::string("Unknown format code '") + type + "' for object of type " + str_repr(type_name(v)));
    }
    body = v.k == VK::Str ? v.s : py_str(v);
    if (precision >= 0) {
      std::u32string d = decode_utf8(body);
      if (static_cast<int64_t>(d.size()) > precision) body = encode_utf8(d.data(), d.data() + precision);
    }
    if (!align) align = '<';
  } else {
    numeric = true;
    if (!v.is_num()) raise_error(EKind::Type, std::string("Unknown format code '") + type + "' for object of type " + str_repr(type_name(v)));
    bool as_int = v.is_int() && (type == 0 || std::strchr("bcdoxXn", type));
    if (v.k == VK::Bool && type == 0) {
      body = v.b ? "True" : "False";
      numeric = false;
      if (!align) align = '<';
    } else if (as_int) {
      int64_t x = v.as_int();
      bool neg = x < 0;
      uint64_t ux = neg ? static_cast<uint64_t>(-(x + 1)) + 1 : static_cast<uint64_t>(x);
      char buf[80];
      switch (type) {
        case 'b': {
          std::string b;
          do {
            b.push_back(static_cast<char>('0' + (ux & 1)));
            ux >>= 1;
          } while (ux);
          std::reverse(b.begin(), b.end());
          body = (alt ? "0b" : "") + b;
          break;
        }
        case 'o': std::snprintf(buf, sizeof buf, "%llo", static_cast<unsigned long long>(ux)); body = (alt ? "0o" : "") + std::string(buf); break;
        case 'x': std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(ux)); body = (alt ? "0x" : "") + std::string(buf); break;
        case 'X': std::snprintf(buf, sizeof buf, "%llX", static_cast<unsigned long long>(ux)); body = (alt ? "0X" : "") + std::string(buf); break;
        case 'c': {
          body.clear();
          append_utf8(body, static_cast<char32_t>(x));
          neg = false;
          break;
        }
        default: std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(ux)); body = buf;
      }
      if (grouping && (type == 0 || type == 'd')) {
        std::string g;
        int cnt = 0;
        for (size_t k = body.size(); k-- > 0;) {
          g.push_back(body[k]);
          if (++cnt % 3 == 0 && k > 0) g.push_back(grouping);
        }
        std::reverse(g.begin(), g.end());
        body = g;
      }
      sign_str = neg ? "-" : (sign == '+' ? "+" : sign == ' ' ? " " : "");
    } else {
      double x = v.as_double();
      bool neg = std::signbit(x) && !std::isnan(x);
      double ax = std::fabs(x);
      char buf[512];
      if (type == 0 && precision < 0) {
        body = float_repr(ax);
      } else {
        char t = type == 0 ? 'g' : type == 'n' ? 'g' : type;
        int prec = precision < 0 ? 6 : precision;
        double val = ax;
        if (t == '%') {
          val = ax * 100.0;
          t = 'f';
        }
        std::string f = std::string("%") + (alt ? "#" : "") + ".*" + t;
        std::snprintf(buf, sizeof buf, f.c_str(), prec, val);
        body = buf;
        if (type == '%') body += "%";
        if (type == 0 && body.find_first_of(".e") == std::string::npos && std::isfinite(ax)) body += ".0";
      }
      if (grouping) {
        size_t dot = body.find_first_of(".e%");
        std::string ip = body.substr(0, dot == std::string::npos ? body.size() : dot);
        std::string rest = dot == std::string::npos ? "" : body.substr(dot);
        std::string g;
        int cnt = 0;
        for (size_t k = ip.size(); k-- > 0;) {
          g.push_back(ip[k]);
          if (++cnt % 3 == 0 && k > 0) g.push_back(grouping);
        }
        std::reverse(g.begin(), g.end());
        body = g + rest;
      }
      sign_str = neg ? "-" : (sign == '+' ? "+" : sign == ' ' ? " " : "");
    }
    if (!align) align = '>';
  }
  if (numeric && align == '=') {
    int64_t len = static_cast<int64_t>(py_len(sign_str) + py_len(body));
    std::string f;
    append_utf8(f, fill);
    std::string pad;
    if (width > len) charge_bytes(static_cast<uint64_t>(width - len), 4);
    for (int64_t k = len; k < width; ++k) pad += f;
    return sign_str + pad + body;
  }
  return pad_str(sign_str + body, width, fill, align == '=' ? '>' : align);
}

// str.format (what the sandbox's SandboxedFormatter accepts for plain fields).
std::string py_str_format(const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_idx = 0;
  size_t i = 0;
  const size_t n = fmt.size();
  while (i < n) {
    char c = fmt[i];
    if (c == '{') {
      if (i + 1 < n && fmt[i + 1] == '{') {
        out.push_back('{');
        i += 2;
        continue;
      }
      size_t depth = 1, j = i + 1;
      while (j < n && depth) {
        if (fmt[j] == '{') ++depth;
        if (fmt[j] == '}') --depth;
        if (depth) ++j;
      }
      if (j >= n) raise_error(EKind::Type, "expected '}' before end of string");
      std::string field = fmt.substr(i + 1, j - i - 1);
      i = j + 1;
      std::string spec, conv;
      size_t colon = field.find(':');
      if (colon != std::string::npos) {
        spec = field.substr(colon + 1);
        field = field.substr(0, colon);
      }
      size_t bang = field.find('!');
      if (bang != std::string::npos) {
        conv = field.substr(bang + 1);
        field = field.substr(0, bang);
      }
      size_t e = 0;
      while (e < field.size() && field[e] != '.' && field[e] != '[') ++e;
      std::string head = field.substr(0, e);
      Value v;
      if (head.empty()) {
        if (auto_idx >= a.pos.size()) raise_error(EKind::Type, "Replacement index " + std::to_string(auto_idx) + " out of range for positional args tuple");
        v = a.pos[auto_idx++];
      } else if (std::all_of(head.begin(), head.end(), is_dig)) {
        size_t idx = std::stoul(head);
        if (idx >= a.pos.size()) raise_error(EKind::Type, "Replacement index " + head + " out of range for positional args tuple");
        v = a.pos[idx];
      } else {
        bool found = false;
        for (const auto& kw : a.kw) {
          if (kw.first == head) {
            v = kw.second;
            found = true;
          }
        }
        if (!found) raise_error(EKind::Type, str_repr(head));
      }
      while (e < field.size()) {
        if (field[e] == '.') {
          size_t f = e + 1;
          while (f < field.size() && field[f] != '.' && field[f] != '[') ++f;
          v = getattr_value(v, field.substr(e + 1, f - e - 1));
          e = f;
        } else {
          size_t f = field.find(']', e);
          if (f == std::string::npos) raise_error(EKind::Type, "Missing ']' in format string");
          std::string key = field.substr(e + 1, f - e - 1);
          Value kv = !key.empty() && std::all_of(key.begin(), key.end(), is_dig) ? make_int(std::stoll(key)) : make_str(key);
          v = getitem_value(v, kv);
          e = f + 1;
        }
      }
      if (conv == "r" || conv == "a") v = make_str(py_repr(v));
      if (conv == "s") v = make_str(py_str(v));
      out += format_spec(v, spec);
      continue;
    }
    if (c == '}') {
      if (i + 1 < n && fmt[i + 1] == '}') {
        out.push_back('}');
        i += 2;
        continue;
      }
      raise_error(EKind::Type, "Single '}' encountered in format string");
    }
    out.push_back(c);
    ++i;
  }
  return out;
}

bool starts_or_ends(const std::string& s, const Value& arg, bool ends, const Value* start,
                    const Value* end) {
  std::string view = s;
  if ((start && start->k != VK::None) || (end && end->k != VK::None)) {
    std::u32string d = decode_utf8(s);
    int64_t len = static_cast<int64_t>(d.size());
    int64_t a = slice_bound(start, 0, len), b = slice_bound(end, len, len);
    if (a > b) return false;
    view = encode_utf8(d.data() + a, d.data() + b);
  }
  auto test = [&](const std::string& p) {
    if (p.size() > view.size()) return false;
    return ends ? view.compare(view.size() - p.size(), p.size(), p) == 0 : view.compare(0, p.size(), p) == 0;
  };
  if (arg.k == VK::Str) return test(arg.s);
  if (arg.is_tuple()) {
    for (const auto& x : arg.list->items) {
      if (x.k != VK::Str) type_error("tuple for " + std::string(ends ? "endswith" : "startswith") + " must only contain str, not " + type_name(x));
      if (test(x.s)) return true;
    }
    return false;
  }
  if (arg.k == VK::Undefined) fail_undefined(arg);
  type_error(std::string(ends ? "endswith" : "startswith") + " first arg must be str or a tuple of str, not " + type_name(arg));
}

bool all_cps(const std::string& s, bool (*pred)(char32_t)) {
  if (s.empty()) return false;
  for (char32_t c : decode_utf8(s)) {
    if (!pred(c)) return false;
  }
  return true;
}

}  // namespace

std::string py_strip(const std::string& s, const Value* chars_arg, bool left, bool right) {
  std::optional<std::u32string> chars;
  if (chars_arg && chars_arg->k != VK::None) {
    if (chars_arg->k == VK::Undefined) fail_undefined(*chars_arg);
    if (chars_arg->k != VK::Str) type_error("strip arg must be None or str");
    chars = decode_utf8(chars_arg->s);
  }
  const std::u32string* cs = chars ? &*chars : nullptr;
  std::u32string d = decode_utf8(s);
  size_t b = 0, e = d.size();
  if (left) {
    while (b < e && in_set(d[b], cs)) ++b;
  }
  if (right) {
    while (e > b && in_set(d[e - 1], cs)) --e;
  }
  return encode_utf8(d.data() + b, d.data() + e);
}

std::vector<std::string> py_split_sep(const std::string& s, const std::string& sep,
                                      int64_t maxsplit, bool from_right) {
  if (sep.empty()) raise_error(EKind::Type, "empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    while (true) {
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
      size_t f = s.find(sep, start);
      if (f == std::string::npos) break;
      parts.push_back(s.substr(start, f - start));
      start = f + sep.size();
    }
    parts.push_back(s.substr(start));
    return parts;
  }
  size_t end = s.size();
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
    if (end < sep.size()) break;
    size_t f = s.rfind(sep, end - sep.size());
    if (f == std::string::npos) break;
    parts.push_back(s.substr(f + sep.size(), end - f - sep.size()));
    end = f;
  }
  parts.push_back(s.substr(0, end));
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old.empty()) {
    std::u32string d = decode_utf8(s);
    int64_t done = 0;
    for (size_t k = 0; k <= d.size(); ++k) {
      if (done < count) {
        charge_bytes(repl.size());
        out += repl;
        ++done;
      }
      if (k < d.size()) append_utf8(out, d[k]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (done < count) {
    size_t f = s.find(old, start);
    if (f == std::string::npos) break;
    out.append(s, start, f - start);
    charge_bytes(repl.size());  // Note [bounded templates]: a long replacement, many times
    out += repl;
    start = f + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::u32string d = decode_utf8(s);
  std::string out;
  for (size_t k = 0; k < d.size(); ++k) append_utf8(out, k == 0 ? to_upper_cp(d[k]) : to_lower_cp(d[k]));
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::u32string d = decode_utf8(s);
  std::vector<std::string> lines;
  size_t i = 0, n = d.size();
  while (i < n) {
    size_t j = i;
    while (j < n) {
      char32_t c = d[j];
      if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1C || c == 0x1D ||
          c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029) {
        break;
      }
      ++j;
    }
    size_t eol = j;
    if (j < n) {
      if (d[j] == '\r' && j + 1 < n && d[j + 1] == '\n') {
        j += 2;
      } else {
        ++j;
      }
    }
    lines.push_back(encode_utf8(d.data() + i, d.data() + (keepends ? j : eol)));
    i = j;
  }
  return lines;
}

std::string py_center(const std::string& s, int64_t width, char32_t fill) {
  int64_t len = static_cast<int64_t>(py_len(s));
  if (width <= len) return s;
  int64_t marg = width - len;
  charge_bytes(static_cast<uint64_t>(marg), 4);  // Note [bounded templates]: before the padding
  int64_t left = marg / 2 + (marg & width & 1);
  std::string f;
  append_utf8(f, fill);
  std::string out;
  for (int64_t k = 0; k < left; ++k) out += f;
  out += s;
  for (int64_t k = 0; k < marg - left; ++k) out += f;
  return out;
}

// printf-style `fmt % args`.
std::string py_percent_format(const std::string& fmt, const Value& args) {
  std::vector<Value> list;
  const DictObj* mapping = nullptr;
  if (args.is_tuple()) {
    list = args.list->items;
  } else {
    if (args.k == VK::Dict) mapping = args.dict.get();
    list.push_back(args);
  }
  size_t ai = 0;
  bool used_mapping = false;
  std::string out;
  size_t i = 0;
  const size_t n = fmt.size();
  auto next_arg = [&]() -> Value {
    if (ai >= list.size()) raise_error(EKind::Type, "not enough arguments for format string");
    return list[ai++];
  };
  while (i < n) {
    char c = fmt[i];
    if (c != '%') {
      out.push_back(c);
      ++i;
      continue;
    }
    ++i;
    if (i >= n) raise_error(EKind::Type, "incomplete format");
    Value v;
    bool have_v = false;
    if (fmt[i] == '(') {
      size_t e = fmt.find(')', i);
      if (e == std::string::npos) raise_error(EKind::Type, "incomplete format key");
      if (!mapping) raise_error(EKind::Type, "format requires a mapping");
      const Value* found = mapping->find(fmt.substr(i + 1, e - i - 1));
      if (!found) raise_error(EKind::Type, str_repr(fmt.substr(i + 1, e - i - 1)));
      v = *found;
      have_v = true;
      used_mapping = true;
      i = e + 1;
    }
    std::string flags;
    while (i < n && std::strchr("-+ #0", fmt[i]) && fmt[i]) flags.push_back(fmt[i++]);
    int width = -1;
    if (i < n && fmt[i] == '*') {
      width = static_cast<int>(need_int(next_arg(), "* width"));
      ++i;
    } else {
      while (i < n && is_dig(fmt[i])) width = std::min((width < 0 ? 0 : width * 10) + (fmt[i++] - '0'), 100000000);
    }
    int prec = -1;
    if (i < n && fmt[i] == '.') {
      ++i;
      prec = 0;
      if (i < n && fmt[i] == '*') {
        prec = static_cast<int>(need_int(next_arg(), "* precision"));
        ++i;
      } else {
        while (i < n && is_dig(fmt[i])) prec = std::min(prec * 10 + (fmt[i++] - '0'), 100000000);
      }
    }
    while (i < n && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= n) raise_error(EKind::Type, "incomplete format");
    char t = fmt[i++];
    if (t == '%') {
      out.push_back('%');
      continue;
    }
    if (!have_v) v = next_arg();
    if (v.k == VK::Undefined && t != 's' && t != 'r' && t != 'a') fail_undefined(v);
    bool left = flags.find('-') != std::string::npos;
    std::string body;
    if (t == 's' || t == 'r' || t == 'a') {
      body = t == 's' ? py_str(v) : py_repr(v);
      if (prec >= 0) {
        std::u32string d = decode_utf8(body);
        if (static_cast<int>(d.size()) > prec) body = encode_utf8(d.data(), d.data() + prec);
      }
      out += pad_str(body, width, ' ', left ? '<' : '>');
      continue;
    }
    if (t == 'c') {
      if (v.k == VK::Str) {
        body = v.s;
      } else {
        append_utf8(body, static_cast<char32_t>(need_int(v, "%c")));
      }
      out += pad_str(body, width, ' ', left ? '<' : '>');
      continue;
    }
    std::string cf = "%" + flags;
    if (width > 0) charge_bytes(static_cast<uint64_t>(width));  // snprintf pads to it
    if (width >= 0) cf += std::to_string(width);
    if (prec >= 0) cf += "." + std::to_string(prec);
    char buf[512];
    if (std::strchr("diuoxX", t)) {
      if (!v.is_num()) {
        type_error(std::string("%") + t + " format: " + (std::strchr("oxX", t) ? "an integer" : "a real number") + " is required, not " + type_name(v));
      }
      if (v.k == VK::Float && std::strchr("oxX", t)) {
        type_error(std::string("%") + t + " format: an integer is required, not float");
      }
      if (v.k == VK::Float && !(std::fabs(v.f) < 9.2e18)) type_error("cannot convert float " + float_repr(v.f) + " to a 64-bit integer");
      long long x = v.k == VK::Float ? static_cast<long long>(std::trunc(v.f)) : static_cast<long long>(v.as_int());
      cf += "ll";
      cf += (t == 'i' || t == 'u') ? 'd' : t;
      std::snprintf(buf, sizeof buf, cf.c_str(), x);
      std::string b = buf;
      if (t == 'o' && flags.find('#') != std::string::npos) {
        // Python writes 0o17 where C writes 017
        size_t z = b.find('0');
        if (z != std::string::npos) b.insert(z + 1, "o");
      }
      out += b;
    } else if (std::strchr("eEfFgG", t)) {
      if (!v.is_num()) type_error("must be real number, not " + type_name(v));
      cf += t;
      std::snprintf(buf, sizeof buf, cf.c_str(), v.as_double());
      out += buf;
    } else {
      raise_error(EKind::Type, std::string("unsupported format character '") + t + "'");
    }
  }
  bool mapping_like = args.k == VK::Dict || is_plain_list(args) || args.k == VK::Undefined ||
                      (args.k == VK::List && args.list->view == "range");
  if (ai < list.size() && !used_mapping && !mapping_like) {
    raise_error(EKind::Type, "not all arguments converted during string formatting");
  }
  return out;
}

const std::unordered_set<std::string>& python_str_methods() {
  static const std::unordered_set<std::string> names = {
      "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find",
      "format", "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
      "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper",
      "join", "ljust", "lower", "lstrip", "maketrans", "partition", "removeprefix",
      "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip",
      "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper",
      "zfill"};
  return names;
}

Value call_str_method(const std::string& self, const std::string& name, const CallArgs& a) {
  const std::string fname = "str." + name;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p = bind(fname, a, {"chars"});
    return make_str(py_strip(self, p.has(0) ? &p[0] : nullptr, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    Params p = bind(fname, a, {"sep", "maxsplit"});
    int64_t maxsplit = p.has(1) ? need_int(p[1], "maxsplit") : -1;
    if (!p.has(0) || p[0].k == VK::None) return str_list(py_split_ws(self, maxsplit, name == "rsplit"));
    if (p[0].k != VK::Str) type_error("must be str or None, not " + type_name(p[0]));
    return str_list(py_split_sep(self, p[0].s, maxsplit, name == "rsplit"));
  }
  if (name == "startswith" || name == "endswith") {
    Params p = bind(fname, a, {"prefix", "start", "end"}, 1);
    return make_bool(starts_or_ends(self, p[0], name == "endswith", p.has(1) ? &p[1] : nullptr, p.has(2) ? &p[2] : nullptr));
  }
  if (name == "lower" || name == "casefold") {
    bind(fname, a, {});
    return make_str(lower_str(self));
  }
  if (name == "upper") {
    bind(fname, a, {});
    return make_str(upper_str(self));
  }
  if (name == "title") {
    bind(fname, a, {});
    return make_str(py_title(self));
  }
  if (name == "capitalize") {
    bind(fname, a, {});
    return make_str(py_capitalize(self));
  }
  if (name == "swapcase") {
    bind(fname, a, {});
    std::string out;
    for (char32_t c : decode_utf8(self)) append_utf8(out, is_upper_cp(c) ? to_lower_cp(c) : is_lower_cp(c) ? to_upper_cp(c) : c);
    return make_str(out);
  }
  if (name == "replace") {
    Params p = bind(fname, a, {"old", "new", "count"}, 2);
    return make_str(py_replace(self, need_str(p[0], "replace() argument 1"), need_str(p[1], "replace() argument 2"), p.has(2) ? need_int(p[2], "count") : -1));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    Params p = bind(fname, a, {"sub", "start", "end"}, 1);
    int64_t r = py_find(self, need_str(p[0], ""), p.has(1) ? &p[1] : nullptr, p.has(2) ? &p[2] : nullptr, name[0] == 'r');
    if (r < 0 && (name == "index" || name == "rindex")) raise_error(EKind::Type, "substring not found");
    return make_int(r);
  }
  if (name == "count") {
    Params p = bind(fname, a, {"sub", "start", "end"}, 1);
    std::u32string d = decode_utf8(self);
    std::u32string sub = decode_utf8(need_str(p[0], ""));
    auto adj = adjust_slice(static_cast<int64_t>(d.size()),
                            p.has(1) && p[1].k != VK::None ? std::optional<int64_t>(need_int(p[1], "start")) : std::nullopt,
                            p.has(2) && p[2].k != VK::None ? std::optional<int64_t>(need_int(p[2], "end")) : std::nullopt, 1);
    int64_t a0 = std::max<int64_t>(0, adj.start), b0 = std::max<int64_t>(a0, adj.stop);
    std::u32string_view hay(d.data() + a0, static_cast<size_t>(b0 - a0));
    if (sub.empty()) return make_int(static_cast<int64_t>(hay.size()) + 1);
    int64_t cnt = 0;
    for (size_t f = hay.find(sub); f != std::u32string_view::npos; f = hay.find(sub, f + sub.size())) ++cnt;
    return make_int(cnt);
  }
  if (name == "join") {
    Params p = bind(fname, a, {"iterable"}, 1);
    if (!is_iterable(p[0])) type_error("can only join an iterable");
    std::string out;
    size_t idx = 0;
    for (const Value& x : iterate(p[0])) {
      if (x.k != VK::Str) type_error("sequence item " + std::to_string(idx) + ": expected str instance, " + type_name(x) + " found");
      if (idx++) {
        charge_bytes(self.size());  // a long separator between many items
        out += self;
      }
      out += x.s;
    }
    return make_str(out);
  }
  if (name == "isalnum") return make_bool(all_cps(self, is_alnum_cp));
  if (name == "isalpha") return make_bool(all_cps(self, is_alpha_cp));
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") return make_bool(all_cps(self, is_digit_cp));
  if (name == "isspace") return make_bool(all_cps(self, py_isspace));
  if (name == "isascii") return make_bool(is_ascii(self));
  if (name == "islower" || name == "isupper") {
    bool any_cased = false, ok = true;
    for (char32_t c : decode_utf8(self)) {
      if (is_upper_cp(c)) {
        any_cased = true;
        if (name == "islower") ok = false;
      } else if (is_lower_cp(c)) {
        any_cased = true;
        if (name == "isupper") ok = false;
      }
    }
    return make_bool(any_cased && ok);
  }
  if (name == "splitlines") {
    Params p = bind(fname, a, {"keepends"});
    return str_list(py_splitlines(self, p.has(0) && truthy(p[0])));
  }
  if (name == "ljust" || name == "rjust" || name == "center") {
    Params p = bind(fname, a, {"width", "fillchar"}, 1);
    char32_t fill = ' ';
    if (p.has(1)) {
      std::u32string f = decode_utf8(need_str(p[1], "fillchar"));
      if (f.size() != 1) type_error("The fill character must be exactly one character long");
      fill = f[0];
    }
    int64_t width = need_int(p[0], "width");
    if (name == "center") return make_str(py_center(self, width, fill));
    return make_str(pad_str(self, width, fill, name == "ljust" ? '<' : '>'));
  }
  if (name == "zfill") {
    Params p = bind(fname, a, {"width"}, 1);
    int64_t width = need_int(p[0], "width");
    int64_t len = static_cast<int64_t>(py_len(self));
    if (width <= len) return make_str(self);
    charge_bytes(static_cast<uint64_t>(width - len));  // Note [bounded templates]
    std::string sign, rest = self;
    if (!rest.empty() && (rest[0] == '+' || rest[0] == '-')) {
      sign = rest.substr(0, 1);
      rest = rest.substr(1);
    }
    return make_str(sign + std::string(static_cast<size_t>(width - len), '0') + rest);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    Params p = bind(fname, a, {"fix"}, 1);
    const std::string& fix = need_str(p[0], name + "() argument");
    if (name == "removeprefix") {
      return make_str(self.compare(0, fix.size(), fix) == 0 && fix.size() <= self.size() ? self.substr(fix.size()) : self);
    }
    if (fix.size() <= self.size() && self.compare(self.size() - fix.size(), fix.size(), fix) == 0 && !fix.empty()) {
      return make_str(self.substr(0, self.size() - fix.size()));
    }
    return make_str(self);
  }
  if (name == "partition" || name == "rpartition") {
    Params p = bind(fname, a, {"sep"}, 1);
    const std::string& sep = need_str(p[0], "sep");
    if (sep.empty()) raise_error(EKind::Type, "empty separator");
    size_t f = name == "partition" ? self.find(sep) : self.rfind(sep);
    if (f == std::string::npos) {
      if (name == "partition") return make_list({make_str(self), make_str(""), make_str("")}, true);
      return make_list({make_str(""), make_str(""), make_str(self)}, true);
    }
    return make_list({make_str(self.substr(0, f)), make_str(sep), make_str(self.substr(f + sep.size()))}, true);
  }
  if (name == "format") return make_str(py_str_format(self, a));
  raise_error(EKind::Runtime, "str." + name + "() is not supported in chat templates");
}

}  // namespace replica::text::detail::jinja
