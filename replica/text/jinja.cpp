// A Jinja2-subset interpreter with Python semantics, for chat templates.
//
// Mirrors Jinja2 3.1 as transformers configures it: ImmutableSandboxedEnvironment,
// trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False, the loopcontrols
// extension ({% break %}, {% continue %}), transformers' {% generation %} tag (rendered as
// its body), the globals raise_exception and strftime_now, and transformers' tojson filter
// (json.dumps with ensure_ascii=False by default). Structure follows jinja2/lexer.py and
// jinja2/parser.py closely (same precedence, same whitespace rules, same error texts where
// it matters); the evaluator follows the generated Python code's semantics: Python
// truthiness, str()/repr(), float formatting, integer/float arithmetic, Undefined.
#include "replica/text/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <locale.h>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>
#include <wctype.h>

namespace replica::text::detail {

namespace {

using EKind = ChatTemplateError::Kind;

[[noreturn]] void raise_error(EKind kind, const std::string& message) {
  throw ChatTemplateError(kind, message);
}
[[noreturn]] void type_error(const std::string& message) { raise_error(EKind::Type, message); }

// ---------------------------------------------------------------------------------------
// UTF-8 and Python's character classes
// ---------------------------------------------------------------------------------------

// Invalid bytes decode to U+DC80..U+DCFF (Python's surrogateescape) and encode back to the
// same byte, so any byte string survives a decode/encode round trip.
void append_utf8(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {
    out.push_back(static_cast<char>(c - 0xDC00));
  } else if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
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

// ---------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------

struct Value;
struct ListObj;
struct DictObj;
struct Function;
struct LoopState;
struct IterObj;
class Interp;

struct UndefInfo {
  std::string message;  // the error raised when the value is used beyond printing/testing
  EKind kind = EKind::Undefined;
};

enum class VK : uint8_t { Undefined, None, Bool, Int, Float, Str, List, Dict, Namespace, Loop, Func, Iter };

struct Value {
  VK k = VK::Undefined;
  bool b = false;
  bool markup = false;  // Str: a markupsafe.Markup (from |escape, |safe)
  int64_t i = 0;
  double f = 0.0;
  std::string s;
  std::shared_ptr<ListObj> list;            // List (tuple flag inside)
  std::shared_ptr<DictObj> dict;            // Dict, Namespace
  std::shared_ptr<Function> fn;             // Func
  std::shared_ptr<LoopState> loop;          // Loop
  std::shared_ptr<IterObj> iter;            // Iter (generators, reverse iterators)
  std::shared_ptr<const UndefInfo> undef;   // Undefined

  bool is_undefined() const { return k == VK::Undefined; }
  bool is_none() const { return k == VK::None; }
  bool is_str() const { return k == VK::Str; }
  bool is_int() const { return k == VK::Int || k == VK::Bool; }  // Python: bool is an int
  bool is_num() const { return k == VK::Int || k == VK::Bool || k == VK::Float; }
  bool is_list() const { return k == VK::List; }
  bool is_dict() const { return k == VK::Dict; }
  bool is_tuple() const;
  int64_t as_int() const { return k == VK::Bool ? (b ? 1 : 0) : i; }
  double as_double() const { return k == VK::Float ? f : static_cast<double>(as_int()); }
};

// A list, a tuple, or a read-only sequence-like Python object: a range ("range") or a dict
// view ("dict_items", "dict_keys", "dict_values").
struct ListObj {
  std::vector<Value> items;
  bool tuple = false;
  std::string view;  // "" for list/tuple
  int64_t r_start = 0, r_stop = 0, r_step = 1;
};

// A single-use Python iterator: a generator (map, select, batch, ...) or a reverse iterator.
// Like Python's, it computes its items when consumed and is empty once consumed.
struct IterObj {
  std::string type_name;  // "generator", "list_reverseiterator", ...
  std::string func;       // the generator's function, for str()
  std::function<std::optional<Value>()> next;
  bool done = false;
  std::optional<Value> pull() {
    if (done) return std::nullopt;
    std::optional<Value> v = next();
    if (!v) done = true;
    return v;
  }
};

bool py_eq(const Value& a, const Value& b);

struct DictObj {
  std::vector<std::pair<Value, Value>> items;
  std::unordered_map<std::string, size_t> str_index;

  const Value* find(const Value& key) const {
    if (key.k == VK::Str) {
      auto it = str_index.find(key.s);
      return it == str_index.end() ? nullptr : &items[it->second].second;
    }
    for (const auto& kv : items) {
      if (kv.first.k != VK::Str && py_eq(kv.first, key)) return &kv.second;
    }
    return nullptr;
  }
  const Value* find(const std::string& key) const {
    auto it = str_index.find(key);
    return it == str_index.end() ? nullptr : &items[it->second].second;
  }
  void set(const Value& key, Value v) {
    if (key.k == VK::Str) {
      auto it = str_index.find(key.s);
      if (it != str_index.end()) {
        items[it->second].second = std::move(v);
        return;
      }
      str_index.emplace(key.s, items.size());
      items.emplace_back(key, std::move(v));
      return;
    }
    for (auto& kv : items) {
      if (kv.first.k != VK::Str && py_eq(kv.first, key)) {
        kv.second = std::move(v);
        return;
      }
    }
    items.emplace_back(key, std::move(v));
  }
};

bool Value::is_tuple() const { return k == VK::List && list->tuple && list->view.empty(); }

// A list or a tuple (not a range or a dict view).
bool is_seq(const Value& v) { return v.k == VK::List && v.list->view.empty(); }
bool is_plain_list(const Value& v) { return is_seq(v) && !v.list->tuple; }

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct Function {
  std::string name;
  std::string type_name = "builtin_function_or_method";
  std::function<Value(Interp&, CallArgs&)> call;
};

struct LoopState {
  std::vector<Value> items;
  size_t index = 0;
  bool has_last_changed = false;
  std::vector<Value> last_changed;
};

Value make_none() {
  Value v;
  v.k = VK::None;
  return v;
}
Value make_bool(bool b) {
  Value v;
  v.k = VK::Bool;
  v.b = b;
  return v;
}
Value make_int(int64_t i) {
  Value v;
  v.k = VK::Int;
  v.i = i;
  return v;
}
Value make_float(double f) {
  Value v;
  v.k = VK::Float;
  v.f = f;
  return v;
}
Value make_str(std::string s) {
  Value v;
  v.k = VK::Str;
  v.s = std::move(s);
  return v;
}
Value make_list(std::vector<Value> items, bool tuple = false) {
  Value v;
  v.k = VK::List;
  v.list = std::make_shared<ListObj>();
  v.list->items = std::move(items);
  v.list->tuple = tuple;
  return v;
}
Value make_view(const char* view, std::vector<Value> items) {
  Value v = make_list(std::move(items));
  v.list->view = view;
  return v;
}
Value make_range(int64_t start, int64_t stop, int64_t step, std::vector<Value> items) {
  Value v = make_view("range", std::move(items));
  v.list->r_start = start;
  v.list->r_stop = stop;
  v.list->r_step = step;
  return v;
}
Value make_iter(std::string type_name, std::string func, std::function<std::optional<Value>()> next) {
  Value v;
  v.k = VK::Iter;
  v.iter = std::make_shared<IterObj>();
  v.iter->type_name = std::move(type_name);
  v.iter->func = std::move(func);
  v.iter->next = std::move(next);
  return v;
}
Value make_dict() {
  Value v;
  v.k = VK::Dict;
  v.dict = std::make_shared<DictObj>();
  return v;
}
Value make_namespace() {
  Value v;
  v.k = VK::Namespace;
  v.dict = std::make_shared<DictObj>();
  return v;
}
Value make_func(std::string name, std::function<Value(Interp&, CallArgs&)> call,
                std::string type_name = "builtin_function_or_method") {
  Value v;
  v.k = VK::Func;
  v.fn = std::make_shared<Function>();
  v.fn->name = std::move(name);
  v.fn->type_name = std::move(type_name);
  v.fn->call = std::move(call);
  return v;
}
Value make_undefined(std::string message, EKind kind = EKind::Undefined) {
  Value v;
  v.k = VK::Undefined;
  auto info = std::make_shared<UndefInfo>();
  info->message = std::move(message);
  info->kind = kind;
  v.undef = std::move(info);
  return v;
}

// type(v).__name__
std::string type_name(const Value& v) {
  switch (v.k) {
    case VK::Undefined: return "Undefined";
    case VK::None: return "NoneType";
    case VK::Bool: return "bool";
    case VK::Int: return "int";
    case VK::Float: return "float";
    case VK::Str: return v.markup ? "Markup" : "str";
    case VK::List: return !v.list->view.empty() ? v.list->view : v.list->tuple ? "tuple" : "list";
    case VK::Dict: return "dict";
    case VK::Namespace: return "Namespace";
    case VK::Loop: return "LoopContext";
    case VK::Func: return v.fn->type_name;
    case VK::Iter: return v.iter->type_name;
  }
  return "object";
}

// jinja2.utils.object_type_repr
std::string object_type_repr(const Value& v) {
  switch (v.k) {
    case VK::None: return "None";
    case VK::Namespace: return "jinja2.utils.Namespace object";
    case VK::Loop: return "jinja2.runtime.LoopContext object";
    case VK::Undefined: return "jinja2.runtime.Undefined object";
    case VK::Func:
      if (v.fn->type_name == "Macro") return "jinja2.runtime.Macro object";
      return type_name(v) + " object";
    default: return type_name(v) + " object";
  }
}

[[noreturn]] void fail_undefined(const Value& v) {
  if (v.undef) raise_error(v.undef->kind, v.undef->message);
  raise_error(EKind::Undefined, "undefined value");
}

Value undefined_name(const std::string& name) {
  return make_undefined(str_repr(name) + " is undefined");
}
Value undefined_attr(const Value& obj, const std::string& name) {
  return make_undefined(str_repr(object_type_repr(obj)) + " has no attribute " + str_repr(name));
}
std::string py_repr(const Value& v);
Value undefined_elem(const Value& obj, const Value& key) {
  if (key.k == VK::Str) return undefined_attr(obj, key.s);
  return make_undefined(object_type_repr(obj) + " has no element " + py_repr(key));
}
Value unsafe_undefined(const Value& obj, const std::string& name) {
  return make_undefined("access to attribute " + str_repr(name) + " of " +
                            str_repr(type_name(obj)) + " object is unsafe.",
                        EKind::Security);
}

// ---------------------------------------------------------------------------------------
// str(), repr(), truthiness, equality, ordering
// ---------------------------------------------------------------------------------------

std::string py_str(const Value& v);

std::string seq_repr(const Value& v) {
  const auto& items = v.list->items;
  const std::string& view = v.list->view;
  if (view == "range") {
    std::string r = "range(" + std::to_string(v.list->r_start) + ", " + std::to_string(v.list->r_stop);
    if (v.list->r_step != 1) r += ", " + std::to_string(v.list->r_step);
    return r + ")";
  }
  if (!view.empty()) {
    std::string out = view + "([";
    for (size_t k = 0; k < items.size(); ++k) {
      if (k) out += ", ";
      out += py_repr(items[k]);
    }
    return out + "])";
  }
  std::string out = v.list->tuple ? "(" : "[";
  for (size_t k = 0; k < items.size(); ++k) {
    if (k) out += ", ";
    out += py_repr(items[k]);
  }
  if (v.list->tuple && items.size() == 1) out += ",";
  out += v.list->tuple ? ")" : "]";
  return out;
}

std::string dict_repr(const DictObj& d) {
  std::string out = "{";
  bool first = true;
  for (const auto& kv : d.items) {
    if (!first) out += ", ";
    first = false;
    out += py_repr(kv.first) + ": " + py_repr(kv.second);
  }
  return out + "}";
}

std::string py_repr(const Value& v) {
  switch (v.k) {
    case VK::Str: return str_repr(v.s);
    case VK::Undefined: return "Undefined";
    default: return py_str(v);
  }
}

std::string py_str(const Value& v) {
  switch (v.k) {
    case VK::Undefined: return "";
    case VK::None: return "None";
    case VK::Bool: return v.b ? "True" : "False";
    case VK::Int: return std::to_string(v.i);
    case VK::Float: return float_repr(v.f);
    case VK::Str: return v.s;
    case VK::List: return seq_repr(v);
    case VK::Dict: return dict_repr(*v.dict);
    case VK::Namespace: return "<Namespace " + dict_repr(*v.dict) + ">";
    case VK::Loop:
      return "<LoopContext " + std::to_string(v.loop->index + 1) + "/" +
             std::to_string(v.loop->items.size()) + ">";
    case VK::Func:
      if (v.fn->type_name == "Macro") return "<Macro " + str_repr(v.fn->name) + ">";
      return "<built-in function " + v.fn->name + ">";
    case VK::Iter:
      if (v.iter->type_name == "generator") return "<generator object " + v.iter->func + ">";
      return "<" + v.iter->type_name + " object>";
  }
  return "";
}

bool truthy(const Value& v) {
  switch (v.k) {
    case VK::Undefined:
    case VK::None: return false;
    case VK::Bool: return v.b;
    case VK::Int: return v.i != 0;
    case VK::Float: return v.f != 0.0;
    case VK::Str: return !v.s.empty();
    case VK::List: return !v.list->items.empty();
    case VK::Dict: return !v.dict->items.empty();
    default: return true;
  }
}

bool py_eq(const Value& a, const Value& b) {
  if (a.k == VK::Undefined || b.k == VK::Undefined) {
    return a.k == VK::Undefined && b.k == VK::Undefined;
  }
  if (a.is_num() && b.is_num()) {
    if (a.k == VK::Float || b.k == VK::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case VK::None: return true;
    case VK::Str: return a.s == b.s;
    case VK::List: {
      if (a.list == b.list) return true;
      if (a.list->tuple != b.list->tuple || a.list->view != b.list->view) return false;
      if (a.list->view == "dict_values") return false;
      if (a.list->view == "dict_keys" || a.list->view == "dict_items") {  // set semantics
        if (a.list->items.size() != b.list->items.size()) return false;
        for (const auto& x : a.list->items) {
          bool found = false;
          for (const auto& y : b.list->items) found = found || py_eq(x, y);
          if (!found) return false;
        }
        return true;
      }
      const auto& x = a.list->items;
      const auto& y = b.list->items;
      if (x.size() != y.size()) return false;
      for (size_t k = 0; k < x.size(); ++k) {
        if (!py_eq(x[k], y[k])) return false;
      }
      return true;
    }
    case VK::Dict: {
      if (a.dict == b.dict) return true;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& kv : a.dict->items) {
        const Value* o = b.dict->find(kv.first);
        if (!o || !py_eq(kv.second, *o)) return false;
      }
      return true;
    }
    case VK::Namespace: return a.dict == b.dict;
    case VK::Loop: return a.loop == b.loop;
    case VK::Func: return a.fn == b.fn;
    case VK::Iter: return a.iter == b.iter;
    default: return false;
  }
}

// Three-way comparison for <, <=, >, >=; nullopt when unordered (NaN). TypeError like Python
// when the types do not compare.
std::optional<int> py_compare(const Value& a, const Value& b, const char* op) {
  if (a.k == VK::Undefined) fail_undefined(a);
  if (b.k == VK::Undefined) fail_undefined(b);
  if (a.is_num() && b.is_num()) {
    if (a.k == VK::Float || b.k == VK::Float) {
      double x = a.as_double(), y = b.as_double();
      if (std::isnan(x) || std::isnan(y)) return std::nullopt;
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.k == VK::Str && b.k == VK::Str) {
    int c = a.s.compare(b.s);
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (is_seq(a) && is_seq(b) && a.list->tuple == b.list->tuple) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (!py_eq(x[k], y[k])) return py_compare(x[k], y[k], op);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  type_error(std::string("'") + op + "' not supported between instances of " +
             str_repr(type_name(a)) + " and " + str_repr(type_name(b)));
}

bool py_less(const Value& a, const Value& b) {
  auto c = py_compare(a, b, "<");
  return c && *c < 0;
}

// ---------------------------------------------------------------------------------------
// JSON in (nlohmann) and out (Python's json.dumps)
// ---------------------------------------------------------------------------------------

template <typename Json>
Value from_json(const Json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return make_none();
    case nlohmann::json::value_t::boolean: return make_bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return make_int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return make_int(static_cast<int64_t>(j.template get<uint64_t>()));
    case nlohmann::json::value_t::number_float: return make_float(j.template get<double>());
    case nlohmann::json::value_t::string: return make_str(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return make_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value d = make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict->set(make_str(it.key()), from_json(it.value()));
      return d;
    }
    default: return make_none();  // binary / discarded: not produced by parsing JSON text
  }
}

void json_escape_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out.push_back('"');
  auto esc = [&](char32_t c) -> bool {
    switch (c) {
      case '"': out += "\\\""; return true;
      case '\\': out += "\\\\"; return true;
      case '\n': out += "\\n"; return true;
      case '\r': out += "\\r"; return true;
      case '\t': out += "\\t"; return true;
      case '\b': out += "\\b"; return true;
      case '\f': out += "\\f"; return true;
      default: return false;
    }
  };
  if (!ensure_ascii && is_ascii(s)) {
    for (char ch : s) {
      char32_t c = static_cast<unsigned char>(ch);
      if (esc(c)) continue;
      if (c < 0x20) {
        out += hex_escape("\\u", c, 4);
      } else {
        out.push_back(ch);
      }
    }
  } else {
    for (char32_t c : decode_utf8(s)) {
      if (esc(c)) continue;
      if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
        if (c >= 0x10000) {
          char32_t v = c - 0x10000;
          out += hex_escape("\\u", 0xD800 | ((v >> 10) & 0x3FF), 4);
          out += hex_escape("\\u", 0xDC00 | (v & 0x3FF), 4);
        } else {
          out += hex_escape("\\u", c, 4);
        }
      } else {
        append_utf8(out, c);
      }
    }
  }
  out.push_back('"');
}

struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None: one line
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return float_repr(f);
}

void json_dump(std::string& out, const Value& v, const JsonOptions& o, int level) {
  auto newline = [&](int lvl) {
    out.push_back('\n');
    for (int k = 0; k < lvl; ++k) out += *o.indent;
  };
  switch (v.k) {
    case VK::None: out += "null"; return;
    case VK::Bool: out += v.b ? "true" : "false"; return;
    case VK::Int: out += std::to_string(v.i); return;
    case VK::Float: out += json_float(v.f); return;
    case VK::Str: json_escape_string(out, v.s, o.ensure_ascii); return;
    case VK::List: {
      if (!v.list->view.empty()) type_error("Object of type " + type_name(v) + " is not JSON serializable");
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      if (o.indent) newline(level + 1);
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) {
          out += o.item_sep;
          if (o.indent) newline(level + 1);
        }
        json_dump(out, items[k], o, level + 1);
      }
      if (o.indent) newline(level);
      out.push_back(']');
      return;
    }
    case VK::Dict: {
      std::vector<std::pair<std::string, const Value*>> entries;
      entries.reserve(v.dict->items.size());
      std::vector<Value> sort_keys;
      for (const auto& kv : v.dict->items) {
        const Value& key = kv.first;
        std::string ks;
        switch (key.k) {
          case VK::Str: ks = key.s; break;
          case VK::Int: ks = std::to_string(key.i); break;
          case VK::Bool: ks = key.b ? "true" : "false"; break;
          case VK::None: ks = "null"; break;
          case VK::Float: ks = json_float(key.f); break;
          default:
            type_error("keys must be str, int, float, bool or None, not " + type_name(key));
        }
        entries.emplace_back(ks, &kv.second);
        sort_keys.push_back(key);
      }
      if (o.sort_keys) {
        std::vector<size_t> order(entries.size());
        for (size_t k = 0; k < order.size(); ++k) order[k] = k;
        std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
          return py_less(sort_keys[x], sort_keys[y]);
        });
        std::vector<std::pair<std::string, const Value*>> sorted;
        for (size_t k : order) sorted.push_back(entries[k]);
        entries.swap(sorted);
      }
      if (entries.empty()) {
        out += "{}";
        return;
      }
      out.push_back('{');
      if (o.indent) newline(level + 1);
      for (size_t k = 0; k < entries.size(); ++k) {
        if (k) {
          out += o.item_sep;
          if (o.indent) newline(level + 1);
        }
        json_escape_string(out, entries[k].first, o.ensure_ascii);
        out += o.key_sep;
        json_dump(out, *entries[k].second, o, level + 1);
      }
      if (o.indent) newline(level);
      out.push_back('}');
      return;
    }
    default:
      type_error("Object of type " + type_name(v) + " is not JSON serializable");
  }
}


// ---------------------------------------------------------------------------------------
// Lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True)
// ---------------------------------------------------------------------------------------

enum class TT : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  TT type = TT::Eof;
  std::string value;  // data text, name, string value, operator
  int64_t ival = 0;
  double fval = 0.0;
  int line = 1;
};

[[noreturn]] void syntax_error(const std::string& message, int line) {
  raise_error(EKind::Syntax,
              "chat template syntax error: " + message + " (line " + std::to_string(line) + ")");
}

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
bool is_dig(char c) { return c >= '0' && c <= '9'; }
int hex_val(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

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

// ---------------------------------------------------------------------------------------
// AST
// ---------------------------------------------------------------------------------------

enum class EK : uint8_t {
  Const, Name, Getattr, Getitem, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Bin,
  Compare, Concat, Cond, List, Tuple, Dict, Placeholder
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  EK k = EK::Const;
  int line = 0;
  Value val;                 // Const
  std::string name;          // Name; Getattr attribute; Filter/Test name; Bin operator
  // Getattr [obj]; Getitem [obj, arg]; Slice [start, stop, step] (entries may be null);
  // Call [callee, args...]; Filter/Test [subject, args...]; Neg/Pos/Not [x]; And/Or/Bin
  // [l, r]; Compare [first, operands...]; Concat/List/Tuple [items]; Dict [k, v, k, v...];
  // Cond [test, then, else (may be null)]
  std::vector<ExprP> kids;
  std::vector<std::string> ops;  // Compare
  std::vector<std::pair<std::string, ExprP>> kwargs;
  ExprP dyn_args, dyn_kwargs;
};

ExprP new_expr(EK k, int line) {
  auto e = std::make_unique<Expr>();
  e->k = k;
  e->line = line;
  return e;
}

struct Target {
  enum Kind { Name, Tuple, NS } kind = Name;
  std::string name, attr;
  std::vector<Target> items;
};

enum class SK : uint8_t {
  Data, Print, For, If, Set, SetBlock, Macro, FilterBlock, With, Break, Continue, Body
};

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  SK k = SK::Data;
  int line = 0;
  std::string text;  // Data
  ExprP expr;        // Print; For iter; If test; Set value; SetBlock/FilterBlock filter
  ExprP cond;        // For filter
  Target target;     // For, Set, SetBlock
  Body body, orelse;
  std::string name;  // Macro
  std::vector<std::string> params;
  std::vector<ExprP> defaults;  // one per param, null when none
  bool uses_varargs = false, uses_kwargs = false;
  std::vector<Target> targets;  // With
  std::vector<ExprP> values;
  bool is_elif = false;         // an If made from {% elif %}
  // Names the frame this statement opens (loop body, macro, with, set/filter block body,
  // generation body) holds as "missing" from its start: see analyze_scopes().
  std::vector<std::string> frame_undefined;
  std::vector<std::string> else_undefined;  // For: the {% else %} frame
};

// Filters and tests are looked up when the template is parsed, as Jinja2's compiler does.
bool filter_known(const std::string& name);
bool test_known(const std::string& name);

// ---------------------------------------------------------------------------------------
// Parser (jinja2/parser.py)
// ---------------------------------------------------------------------------------------

std::string describe_token(const Token& t) {
  switch (t.type) {
    case TT::Data: return "template data / text";
    case TT::VarBegin: return "begin of print statement";
    case TT::VarEnd: return "end of print statement";
    case TT::BlockBegin: return "begin of statement block";
    case TT::BlockEnd: return "end of statement block";
    case TT::Name: return t.value;
    case TT::String: return "string";
    case TT::Int: return "integer";
    case TT::Float: return "float";
    case TT::Op: return t.value;
    case TT::Eof: return "end of template";
  }
  return "?";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_template() {
    Body body = subparse(nullptr);
    return body;
  }

 private:
  using Ends = std::vector<std::string>;
  std::vector<Token> t_;
  size_t p_ = 0;
  std::vector<std::string> tag_stack_;
  std::vector<Ends> end_stack_;
  int loop_depth_ = 0;
  int macro_depth_ = 0;
  std::vector<Stmt*> macro_stack_;

  const Token& cur() const { return t_[p_]; }
  const Token& look() const { return t_[std::min(p_ + 1, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[p_];
    if (p_ + 1 < t_.size()) ++p_;
    return t;
  }
  bool is_op(const char* op) const { return cur().type == TT::Op && cur().value == op; }
  bool is_name(const char* n) const { return cur().type == TT::Name && cur().value == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  [[noreturn]] void fail(const std::string& msg, int line = -1) {
    syntax_error(msg, line < 0 ? cur().line : line);
  }
  const Token& expect(TT type, const char* what) {
    if (cur().type != type) {
      if (cur().type == TT::Eof) {
        fail(std::string("unexpected end of template, expected '") + what + "'.");
      }
      fail(std::string("expected token '") + what + "', got '" + describe_token(cur()) + "'");
    }
    return next();
  }
  const Token& expect_op(const char* op) {
    if (!is_op(op)) {
      if (cur().type == TT::Eof) fail(std::string("unexpected end of template, expected '") + op + "'.");
      fail(std::string("expected token '") + op + "', got '" + describe_token(cur()) + "'");
    }
    return next();
  }
  const Token& expect_name(const char* n) {
    if (!is_name(n)) {
      if (cur().type == TT::Eof) fail(std::string("unexpected end of template, expected '") + n + "'.");
      fail(std::string("expected token '") + n + "', got '" + describe_token(cur()) + "'");
    }
    return next();
  }

  [[noreturn]] void fail_ut_eof(const std::string* name, int line) {
    std::unordered_set<std::string> expected;
    for (const auto& ends : end_stack_) expected.insert(ends.begin(), ends.end());
    std::string looking;
    if (!end_stack_.empty()) {
      for (size_t k = 0; k < end_stack_.back().size(); ++k) {
        if (k) looking += " or ";
        looking += str_repr(end_stack_.back()[k]);
      }
    }
    std::string msg = name ? "Encountered unknown tag " + str_repr(*name) + "." : "Unexpected end of template.";
    if (!looking.empty()) {
      if (name && expected.count(*name)) {
        msg += " You probably made a nesting mistake. Jinja is expecting this tag, but currently looking for " + looking + ".";
      } else {
        msg += " Jinja was looking for the following tags: " + looking + ".";
      }
    }
    if (!tag_stack_.empty()) {
      msg += " The innermost block that needs to be closed is " + str_repr(tag_stack_.back()) + ".";
    }
    fail(msg, line);
  }

  Body subparse(const Ends* ends) {
    Body body;
    if (ends) end_stack_.push_back(*ends);
    while (cur().type != TT::Eof) {
      const Token& tok = cur();
      if (tok.type == TT::Data) {
        auto s = std::make_unique<Stmt>();
        s->k = SK::Data;
        s->line = tok.line;
        s->text = tok.value;
        next();
        body.push_back(std::move(s));
      } else if (tok.type == TT::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->k = SK::Print;
        s->line = tok.line;
        s->expr = parse_tuple(false, true, nullptr, false);
        expect(TT::VarEnd, "end of print statement");
        body.push_back(std::move(s));
      } else if (tok.type == TT::BlockBegin) {
        next();
        if (ends && cur().type == TT::Name &&
            std::find(ends->begin(), ends->end(), cur().value) != ends->end()) {
          end_stack_.pop_back();
          return body;
        }
        body.push_back(parse_statement());
        expect(TT::BlockEnd, "end of statement block");
      } else {
        fail("internal parser error: unexpected " + describe_token(tok));
      }
    }
    if (ends) fail_ut_eof(nullptr, cur().line);
    return body;
  }

  // parse_statements: `%}` then the body up to one of `ends` (left current, or skipped).
  Body parse_statements(const Ends& ends, bool drop_needle) {
    skip_op(":");
    expect(TT::BlockEnd, "end of statement block");
    Body body = subparse(&ends);
    if (cur().type == TT::Eof) fail_ut_eof(nullptr, cur().line);
    if (drop_needle) next();
    return body;
  }

  StmtP parse_statement() {
    Nest nest(*this);
    const Token& tok = cur();
    if (tok.type != TT::Name) fail("tag name expected");
    std::string name = tok.value;
    int line = tok.line;
    tag_stack_.push_back(name);
    StmtP s;
    if (name == "for") {
      s = parse_for();
    } else if (name == "if") {
      s = parse_if();
    } else if (name == "set") {
      s = parse_set();
    } else if (name == "macro") {
      s = parse_macro();
    } else if (name == "filter") {
      s = parse_filter_block();
    } else if (name == "with") {
      s = parse_with();
    } else if (name == "generation") {
      next();
      s = std::make_unique<Stmt>();
      s->k = SK::Body;
      s->line = line;
      int saved_loop = loop_depth_;  // the body is a macro (caller) in Jinja2
      loop_depth_ = 0;
      s->body = parse_statements({"endgeneration"}, true);
      loop_depth_ = saved_loop;
    } else if (name == "break" || name == "continue") {
      next();
      if (loop_depth_ == 0) fail("'" + name + "' outside loop", line);
      s = std::make_unique<Stmt>();
      s->k = name == "break" ? SK::Break : SK::Continue;
      s->line = line;
    } else if (name == "block" || name == "extends" || name == "include" || name == "import" ||
               name == "from" || name == "call" || name == "autoescape" || name == "scope" ||
               name == "print") {
      fail("{% " + name + " %} is not supported in chat templates", line);
    } else {
      tag_stack_.pop_back();
      fail_ut_eof(&name, line);
    }
    tag_stack_.pop_back();
    return s;
  }

  StmtP parse_for() {
    auto s = std::make_unique<Stmt>();
    s->k = SK::For;
    s->line = expect_name("for").line;
    Ends in_end = {"in"};
    s->target = parse_assign_target(true, false, &in_end, false);
    expect_name("in");
    Ends rec_end = {"recursive"};
    s->expr = parse_tuple(false, false, &rec_end, false);
    if (skip_name("if")) s->cond = parse_expression(true);
    if (is_name("recursive")) fail("recursive loops are not supported in chat templates");
    ++loop_depth_;
    s->body = parse_statements({"endfor", "else"}, false);
    --loop_depth_;
    if (next().value != "endfor") s->orelse = parse_statements({"endfor"}, true);
    return s;
  }

  StmtP parse_if() {
    auto result = std::make_unique<Stmt>();
    result->k = SK::If;
    result->line = expect_name("if").line;
    Stmt* node = result.get();
    while (true) {
      node->expr = parse_tuple(false, false, nullptr, false);
      node->body = parse_statements({"elif", "else", "endif"}, false);
      const Token& t = next();
      if (t.value == "elif") {
        auto elif = std::make_unique<Stmt>();
        elif->k = SK::If;
        elif->is_elif = true;
        elif->line = cur().line;
        Stmt* raw = elif.get();
        node->orelse.push_back(std::move(elif));
        node = raw;
        continue;
      }
      if (t.value == "else") node->orelse = parse_statements({"endif"}, true);
      break;
    }
    return result;
  }

  StmtP parse_set() {
    auto s = std::make_unique<Stmt>();
    s->line = next().line;
    s->target = parse_assign_target(true, false, nullptr, true);
    if (skip_op("=")) {
      s->k = SK::Set;
      s->expr = parse_tuple(false, true, nullptr, false);
      return s;
    }
    s->k = SK::SetBlock;
    if (is_op("|")) s->expr = parse_filter(new_expr(EK::Placeholder, s->line), false);
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  StmtP parse_macro() {
    auto s = std::make_unique<Stmt>();
    s->k = SK::Macro;
    s->line = next().line;
    s->name = expect(TT::Name, "name").value;
    expect_op("(");
    bool have_default = false;
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      s->params.push_back(expect(TT::Name, "name").value);
      if (skip_op("=")) {
        s->defaults.push_back(parse_expression(true));
        have_default = true;
      } else {
        if (have_default) fail("non-default argument follows default argument");
        s->defaults.push_back(nullptr);
      }
    }
    expect_op(")");
    macro_stack_.push_back(s.get());
    int saved_loop = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_statements({"endmacro"}, true);
    loop_depth_ = saved_loop;
    macro_stack_.pop_back();
    return s;
  }

  StmtP parse_filter_block() {
    auto s = std::make_unique<Stmt>();
    s->k = SK::FilterBlock;
    s->line = next().line;
    s->expr = parse_filter(new_expr(EK::Placeholder, s->line), true);
    s->body = parse_statements({"endfilter"}, true);
    return s;
  }

  StmtP parse_with() {
    auto s = std::make_unique<Stmt>();
    s->k = SK::With;
    s->line = next().line;
    while (cur().type != TT::BlockEnd) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(parse_assign_target(true, false, nullptr, false));
      expect_op("=");
      s->values.push_back(parse_expression(true));
    }
    s->body = parse_statements({"endwith"}, true);
    return s;
  }

  Target to_target(const Expr& e) {
    Target t;
    if (e.k == EK::Name) {
      t.kind = Target::Name;
      t.name = e.name;
      return t;
    }
    if (e.k == EK::Tuple) {
      t.kind = Target::Tuple;
      for (const auto& kid : e.kids) t.items.push_back(to_target(*kid));
      return t;
    }
    std::string what = e.k == EK::Const ? "const" : "expression";
    fail("can't assign to '" + what + "'", e.line);
  }

  Target parse_assign_target(bool with_tuple, bool name_only, const Ends* extra_end,
                             bool with_namespace) {
    if (with_namespace && look().type == TT::Op && look().value == ".") {
      Target t;
      t.kind = Target::NS;
      t.name = expect(TT::Name, "name").value;
      next();
      t.attr = expect(TT::Name, "name").value;
      return t;
    }
    if (name_only) {
      Target t;
      t.name = expect(TT::Name, "name").value;
      return t;
    }
    ExprP e = with_tuple ? parse_tuple(true, true, extra_end, false) : parse_primary();
    if (e->k == EK::Name && (e->name == "true" || e->name == "false" || e->name == "none")) {
      fail("can't assign to 'const'", e->line);
    }
    return to_target(*e);
  }

  bool is_tuple_end(const Ends* extra_end) const {
    const Token& t = cur();
    if (t.type == TT::VarEnd || t.type == TT::BlockEnd || (t.type == TT::Op && t.value == ")")) {
      return true;
    }
    if (extra_end && t.type == TT::Name) {
      return std::find(extra_end->begin(), extra_end->end(), t.value) != extra_end->end();
    }
    return false;
  }

  ExprP parse_tuple(bool simplified, bool with_condexpr, const Ends* extra_end,
                    bool explicit_parens) {
    int line = cur().line;
    std::vector<ExprP> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      if (simplified) {
        args.push_back(parse_primary());
      } else {
        args.push_back(parse_expression(with_condexpr));
      }
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens) {
        fail("Expected an expression, got '" + describe_token(cur()) + "'");
      }
    }
    auto e = new_expr(EK::Tuple, line);
    e->kids = std::move(args);
    return e;
  }

  ExprP parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  // Nesting beyond this is refused (Python's parser gives up around the same depth), so a
  // hostile template cannot exhaust the stack.
  static constexpr int kMaxNesting = 200;
  int nesting_ = 0;
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.nesting_ > kMaxNesting) p.fail("template nested too deeply");
    }
    ~Nest() { --p.nesting_; }
  };

  ExprP parse_condexpr() {
    Nest nest(*this);
    int line = cur().line;
    ExprP expr1 = parse_or();
    while (skip_name("if")) {
      ExprP expr2 = parse_or();
      ExprP expr3;
      if (skip_name("else")) expr3 = parse_condexpr();
      auto c = new_expr(EK::Cond, line);
      c->kids.push_back(std::move(expr2));
      c->kids.push_back(std::move(expr1));
      c->kids.push_back(std::move(expr3));
      expr1 = std::move(c);
    }
    return expr1;
  }

  ExprP binary(EK k, ExprP l, ExprP r, int line, std::string op = "") {
    auto e = new_expr(k, line);
    e->name = std::move(op);
    e->kids.push_back(std::move(l));
    e->kids.push_back(std::move(r));
    return e;
  }

  ExprP parse_or() {
    int line = cur().line;
    ExprP left = parse_and();
    while (skip_name("or")) left = binary(EK::Or, std::move(left), parse_and(), line);
    return left;
  }
  ExprP parse_and() {
    int line = cur().line;
    ExprP left = parse_not();
    while (skip_name("and")) left = binary(EK::And, std::move(left), parse_not(), line);
    return left;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      int line = next().line;
      auto e = new_expr(EK::Not, line);
      e->kids.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    int line = cur().line;
    ExprP expr = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprP> operands;
    while (true) {
      if (cur().type == TT::Op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                   cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        ops.push_back(next().value);
        operands.push_back(parse_math1());
      } else if (skip_name("in")) {
        ops.push_back("in");
        operands.push_back(parse_math1());
      } else if (is_name("not") && look().type == TT::Name && look().value == "in") {
        next();
        next();
        ops.push_back("notin");
        operands.push_back(parse_math1());
      } else {
        break;
      }
    }
    if (ops.empty()) return expr;
    auto e = new_expr(EK::Compare, line);
    e->kids.push_back(std::move(expr));
    for (auto& o : operands) e->kids.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }
  ExprP parse_math1() {
    int line = cur().line;
    ExprP left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().value;
      left = binary(EK::Bin, std::move(left), parse_concat(), line, op);
    }
    return left;
  }
  ExprP parse_concat() {
    int line = cur().line;
    std::vector<ExprP> args;
    args.push_back(parse_math2());
    while (skip_op("~")) args.push_back(parse_math2());
    if (args.size() == 1) return std::move(args[0]);
    auto e = new_expr(EK::Concat, line);
    e->kids = std::move(args);
    return e;
  }
  ExprP parse_math2() {
    int line = cur().line;
    ExprP left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().value;
      left = binary(EK::Bin, std::move(left), parse_pow(), line, op);
    }
    return left;
  }
  ExprP parse_pow() {
    int line = cur().line;
    ExprP left = parse_unary(true);
    while (skip_op("**")) left = binary(EK::Bin, std::move(left), parse_unary(true), line, "**");
    return left;
  }
  ExprP parse_unary(bool with_filter) {
    Nest nest(*this);
    int line = cur().line;
    ExprP node;
    if (is_op("-") || is_op("+")) {
      bool neg = next().value == "-";
      node = new_expr(neg ? EK::Neg : EK::Pos, line);
      node->kids.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprP parse_primary() {
    const Token& tok = cur();
    int line = tok.line;
    if (tok.type == TT::Name) {
      auto e = new_expr(EK::Const, line);
      if (tok.value == "true" || tok.value == "True") {
        e->val = make_bool(true);
      } else if (tok.value == "false" || tok.value == "False") {
        e->val = make_bool(false);
      } else if (tok.value == "none" || tok.value == "None") {
        e->val = make_none();
      } else {
        e->k = EK::Name;
        e->name = tok.value;
      }
      next();
      return e;
    }
    if (tok.type == TT::String) {
      std::string buf = next().value;
      while (cur().type == TT::String) buf += next().value;
      auto e = new_expr(EK::Const, line);
      e->val = make_str(std::move(buf));
      return e;
    }
    if (tok.type == TT::Int || tok.type == TT::Float) {
      auto e = new_expr(EK::Const, line);
      e->val = tok.type == TT::Int ? make_int(tok.ival) : make_float(tok.fval);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprP e = parse_tuple(false, true, nullptr, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = new_expr(EK::List, line);
      while (!is_op("]")) {
        if (!e->kids.empty()) expect_op(",");
        if (is_op("]")) break;
        e->kids.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = new_expr(EK::Dict, line);
      while (!is_op("}")) {
        if (!e->kids.empty()) expect_op(",");
        if (is_op("}")) break;
        e->kids.push_back(parse_expression(true));
        expect_op(":");
        e->kids.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    if (tok.type == TT::Eof) fail("unexpected end of template");
    fail("unexpected '" + describe_token(tok) + "'");
  }

  ExprP parse_postfix(ExprP node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        break;
      }
    }
    return node;
  }

  ExprP parse_filter_expr(ExprP node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node), false);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        break;
      }
    }
    return node;
  }

  ExprP parse_subscript(ExprP node) {
    const Token& tok = next();
    int line = tok.line;
    if (tok.value == ".") {
      const Token& attr = cur();
      if (attr.type == TT::Name) {
        auto e = new_expr(EK::Getattr, line);
        e->name = attr.value;
        next();
        e->kids.push_back(std::move(node));
        return e;
      }
      if (attr.type != TT::Int) fail("expected name or number", attr.line);
      auto e = new_expr(EK::Getitem, line);
      auto c = new_expr(EK::Const, attr.line);
      c->val = make_int(attr.ival);
      next();
      e->kids.push_back(std::move(node));
      e->kids.push_back(std::move(c));
      return e;
    }
    // "["
    std::vector<ExprP> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = new_expr(EK::Getitem, line);
    e->kids.push_back(std::move(node));
    if (args.size() == 1) {
      e->kids.push_back(std::move(args[0]));
    } else {
      auto t = new_expr(EK::Tuple, line);
      t->kids = std::move(args);
      e->kids.push_back(std::move(t));
    }
    return e;
  }

  ExprP parse_subscribed() {
    int line = cur().line;
    std::vector<ExprP> args;
    if (is_op(":")) {
      next();
      args.push_back(nullptr);
    } else {
      ExprP node = parse_expression(true);
      if (!is_op(":")) return node;
      next();
      args.push_back(std::move(node));
    }
    if (is_op(":")) {
      args.push_back(nullptr);
    } else if (!is_op("]") && !is_op(",")) {
      args.push_back(parse_expression(true));
    } else {
      args.push_back(nullptr);
    }
    if (is_op(":")) {
      next();
      if (!is_op("]") && !is_op(",")) {
        args.push_back(parse_expression(true));
      } else {
        args.push_back(nullptr);
      }
    } else {
      args.push_back(nullptr);
    }
    auto e = new_expr(EK::Slice, line);
    e->kids = std::move(args);
    return e;
  }

  void parse_call_args(Expr& e) {
    int line = expect_op("(").line;
    bool require_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) fail("invalid syntax for function call expression", line);
    };
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*")) {
        ensure(!e.dyn_args && !e.dyn_kwargs);
        next();
        e.dyn_args = parse_expression(true);
      } else if (is_op("**")) {
        ensure(!e.dyn_kwargs);
        next();
        e.dyn_kwargs = parse_expression(true);
      } else if (cur().type == TT::Name && look().type == TT::Op && look().value == "=") {
        ensure(!e.dyn_kwargs);
        std::string key = next().value;
        next();
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        ensure(!e.dyn_args && !e.dyn_kwargs && e.kwargs.empty());
        e.kids.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprP parse_call(ExprP node) {
    auto e = new_expr(EK::Call, cur().line);
    e->kids.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  ExprP parse_filter(ExprP node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      const Token& tok = expect(TT::Name, "name");
      auto e = new_expr(EK::Filter, tok.line);
      e->name = tok.value;
      while (is_op(".")) {
        next();
        e->name += "." + expect(TT::Name, "name").value;
      }
      e->kids.push_back(std::move(node));
      if (is_op("(")) parse_call_args(*e);
      node = std::move(e);
      start_inline = false;
    }
    return node;
  }

  ExprP parse_test(ExprP node) {
    int line = next().line;  // "is"
    bool negated = skip_name("not");
    std::string name = expect(TT::Name, "name").value;
    while (is_op(".")) {
      next();
      name += "." + expect(TT::Name, "name").value;
    }
    auto e = new_expr(EK::Test, line);
    e->name = name;
    e->kids.push_back(std::move(node));
    const Token& c = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((c.type == TT::Name || c.type == TT::String || c.type == TT::Int ||
                c.type == TT::Float || is_op("[") || is_op("{")) &&
               !(c.type == TT::Name && (c.value == "else" || c.value == "or" || c.value == "and"))) {
      if (c.type == TT::Name && c.value == "is") fail("You cannot chain multiple tests with is");
      ExprP arg = parse_postfix(parse_primary());
      e->kids.push_back(std::move(arg));
    }
    if (!negated) return e;
    auto n = new_expr(EK::Not, line);
    n->kids.push_back(std::move(e));
    return n;
  }
};

// Unknown filters and tests: Jinja2's compiler rejects them, except in a "soft" frame (the
// test and branches of an {% if %}, an inline if), where the error waits until the filter
// runs. Loops, macros, with and set/filter blocks open frames that are not soft.
bool jinja_only_filter(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "filesizeformat", "forceescape", "groupby", "pprint", "random", "slice", "striptags",
      "urlencode", "urlize", "wordwrap", "xmlattr"};
  return names.count(name) > 0;
}

void check_names(const Expr* e, bool soft) {
  if (!e) return;
  bool s = soft || e->k == EK::Cond;
  if (e->k == EK::Filter && !filter_known(e->name) && !s) {
    if (jinja_only_filter(e->name)) syntax_error("filter " + str_repr(e->name) + " is not supported in chat templates", e->line);
    syntax_error("No filter named " + str_repr(e->name) + ".", e->line);
  }
  if (e->k == EK::Test && !test_known(e->name) && !s) syntax_error("No test named " + str_repr(e->name) + ".", e->line);
  for (const auto& k : e->kids) check_names(k.get(), s);
  for (const auto& kv : e->kwargs) check_names(kv.second.get(), s);
  check_names(e->dyn_args.get(), s);
  check_names(e->dyn_kwargs.get(), s);
}

void check_names(const Body& body, bool soft) {
  for (const auto& sp : body) {
    const Stmt& st = *sp;
    switch (st.k) {
      case SK::If:
        check_names(st.expr.get(), true);
        check_names(st.body, true);
        check_names(st.orelse, true);
        break;
      case SK::For:
        check_names(st.expr.get(), soft);
        check_names(st.cond.get(), false);
        check_names(st.body, false);
        check_names(st.orelse, false);
        break;
      case SK::Print:
      case SK::Set: check_names(st.expr.get(), soft); break;
      case SK::With:
        for (const auto& v : st.values) check_names(v.get(), soft);
        check_names(st.body, false);
        break;
      case SK::Macro:
        for (const auto& d : st.defaults) check_names(d.get(), false);
        check_names(st.body, false);
        break;
      case SK::SetBlock:
      case SK::FilterBlock:
        check_names(st.expr.get(), false);
        check_names(st.body, false);
        break;
      case SK::Body: check_names(st.body, false); break;
      default: break;
    }
  }
}

// Whether a macro body reads `varargs` / `kwargs` (Jinja2 only accepts extra arguments then).
void scan_names(const Expr* e, bool& varargs, bool& kwargs);
void scan_names(const Body& body, bool& varargs, bool& kwargs) {
  for (const auto& s : body) {
    if (!s) continue;
    scan_names(s->expr.get(), varargs, kwargs);
    scan_names(s->cond.get(), varargs, kwargs);
    for (const auto& d : s->defaults) scan_names(d.get(), varargs, kwargs);
    for (const auto& v : s->values) scan_names(v.get(), varargs, kwargs);
    scan_names(s->body, varargs, kwargs);
    scan_names(s->orelse, varargs, kwargs);
  }
}
void scan_names(const Expr* e, bool& varargs, bool& kwargs) {
  if (!e) return;
  if (e->k == EK::Name) {
    if (e->name == "varargs") varargs = true;
    if (e->name == "kwargs") kwargs = true;
  }
  for (const auto& k : e->kids) scan_names(k.get(), varargs, kwargs);
  for (const auto& kv : e->kwargs) scan_names(kv.second.get(), varargs, kwargs);
  scan_names(e->dyn_args.get(), varargs, kwargs);
  scan_names(e->dyn_kwargs.get(), varargs, kwargs);
}
void mark_macros(Body& body) {
  for (auto& s : body) {
    if (s->k == SK::Macro) scan_names(s->body, s->uses_varargs, s->uses_kwargs);
    mark_macros(s->body);
    mark_macros(s->orelse);
  }
}

// ---------------------------------------------------------------------------------------
// Scoping (jinja2/idtracking.py)
//
// Jinja2 decides at compile time where each name lives. Every frame (the template, a loop
// body, a loop's else, a macro, a with block, a set/filter block body, a generation body)
// gets a variable for each name it assigns, initialised when the frame starts: from the
// context (a load came first, or the assignment is conditional), from the enclosing frame's
// variable (when that frame has one), or as missing (an unconditional assignment before any
// load). A missing variable reads as undefined until the assignment runs, also from loops and
// macros that run earlier, e.g. {% for m in x %}{{ y }}{% endfor %}{% set y = 1 %} prints
// nothing even when the context has y. The evaluator scopes names dynamically, which agrees
// with these rules except for the missing case; this pass finds those names per frame.
// ---------------------------------------------------------------------------------------

enum class LoadKind : uint8_t { Resolve, Alias, Undefined, Param };

struct Symbols {
  const Symbols* parent = nullptr;
  std::unordered_map<std::string, LoadKind> refs;
  std::unordered_set<std::string> stores;

  bool find_ref(const std::string& n) const {
    for (const Symbols* s = this; s != nullptr; s = s->parent) {
      if (s->refs.count(n)) return true;
    }
    return false;
  }
  void load(const std::string& n) {
    if (!find_ref(n)) refs[n] = LoadKind::Resolve;
  }
  void store(const std::string& n) {
    stores.insert(n);
    if (!refs.count(n)) refs[n] = (parent && parent->find_ref(n)) ? LoadKind::Alias : LoadKind::Undefined;
  }
  void param(const std::string& n) {
    stores.insert(n);
    refs[n] = LoadKind::Param;
  }
  // Jinja2 >= 3.1.5: a name that any branch assigns (and the frame did not before) starts
  // from the context or the enclosing frame, even when every branch assigns it (3.1.2 left
  // a name assigned in all of body, elifs and else missing until then).
  void branch_update(const std::vector<Symbols>& branches) {
    std::unordered_set<std::string> new_stores;
    for (const auto& b : branches) {
      for (const auto& t : b.stores) {
        if (!stores.count(t)) new_stores.insert(t);
      }
    }
    for (const auto& b : branches) {
      for (const auto& kv : b.refs) refs[kv.first] = kv.second;
      stores.insert(b.stores.begin(), b.stores.end());
    }
    for (const auto& n : new_stores) {
      refs[n] = (parent && parent->find_ref(n)) ? LoadKind::Alias : LoadKind::Resolve;
    }
  }
  std::vector<std::string> undefined_names() const {
    std::vector<std::string> out;
    for (const auto& kv : refs) {
      if (kv.second == LoadKind::Undefined) out.push_back(kv.first);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

void sym_expr(const Expr* e, Symbols& s) {
  if (!e) return;
  if (e->k == EK::Name) {
    s.load(e->name);
    return;
  }
  for (const auto& k : e->kids) sym_expr(k.get(), s);
  for (const auto& kv : e->kwargs) sym_expr(kv.second.get(), s);
  sym_expr(e->dyn_args.get(), s);
  sym_expr(e->dyn_kwargs.get(), s);
}

void sym_target(const Target& t, Symbols& s, bool param) {
  switch (t.kind) {
    case Target::Name:
      if (param) {
        s.param(t.name);
      } else {
        s.store(t.name);
      }
      return;
    case Target::Tuple:
      for (const auto& i : t.items) sym_target(i, s, param);
      return;
    case Target::NS: s.load(t.name); return;
  }
}

void sym_stmt(const Stmt& st, Symbols& s);

void sym_body(const Body& body, Symbols& s) {
  for (const auto& st : body) sym_stmt(*st, s);
}

// FrameSymbolVisitor.visit_If: each branch on a copy, then branch_update. Jinja2 keeps all
// elifs in one branch and visits each as an If of its own.
void sym_if(const Stmt& st, Symbols& s, bool as_elif_node) {
  sym_expr(st.expr.get(), s);
  Symbols body_s = s, elif_s = s, else_s = s;
  sym_body(st.body, body_s);
  if (!as_elif_node) {
    const Stmt* cur = &st;
    while (cur->orelse.size() == 1 && cur->orelse[0]->k == SK::If && cur->orelse[0]->is_elif) {
      cur = cur->orelse[0].get();
      sym_if(*cur, elif_s, true);
    }
    sym_body(cur->orelse, else_s);
  }
  s.branch_update({body_s, elif_s, else_s});
}

void sym_stmt(const Stmt& st, Symbols& s) {
  switch (st.k) {
    case SK::Print: sym_expr(st.expr.get(), s); return;
    case SK::If: sym_if(st, s, false); return;
    case SK::For: sym_expr(st.expr.get(), s); return;  // the body is a frame of its own
    case SK::Set:
      sym_expr(st.expr.get(), s);
      sym_target(st.target, s, false);
      return;
    case SK::SetBlock: sym_target(st.target, s, false); return;
    case SK::Macro: s.store(st.name); return;
    case SK::FilterBlock: sym_expr(st.expr.get(), s); return;
    case SK::With:
      for (const auto& v : st.values) sym_expr(v.get(), s);
      return;
    default: return;
  }
}

void analyze_frames(Body& body, const Symbols& frame);

void analyze_frame_of(Stmt& st, const Symbols& parent) {
  Symbols f;
  f.parent = &parent;
  switch (st.k) {
    case SK::For: {
      sym_target(st.target, f, true);
      f.param("loop");
      sym_body(st.body, f);
      st.frame_undefined = f.undefined_names();
      analyze_frames(st.body, f);
      if (!st.orelse.empty()) {
        Symbols e;
        e.parent = &parent;
        sym_body(st.orelse, e);
        st.else_undefined = e.undefined_names();
        analyze_frames(st.orelse, e);
      }
      return;
    }
    case SK::Macro:
      for (const auto& p : st.params) f.param(p);
      for (const auto& d : st.defaults) sym_expr(d.get(), f);
      f.param("varargs");
      f.param("kwargs");
      break;
    case SK::With:
      for (const auto& t : st.targets) sym_target(t, f, true);
      break;
    default: break;
  }
  sym_body(st.body, f);
  if (st.k == SK::FilterBlock) sym_expr(st.expr.get(), f);
  st.frame_undefined = f.undefined_names();
  analyze_frames(st.body, f);
}

// The frames nested in a frame's statements (an If is not a frame: its branches belong to
// the enclosing one).
void analyze_frames(Body& body, const Symbols& frame) {
  for (auto& sp : body) {
    Stmt& st = *sp;
    switch (st.k) {
      case SK::If:
        analyze_frames(st.body, frame);
        analyze_frames(st.orelse, frame);
        break;
      case SK::For:
      case SK::Macro:
      case SK::With:
      case SK::SetBlock:
      case SK::FilterBlock:
      case SK::Body: analyze_frame_of(st, frame); break;
      default: break;
    }
  }
}

std::vector<std::string> analyze_scopes(Body& body) {
  Symbols root;
  sym_body(body, root);
  analyze_frames(body, root);
  return root.undefined_names();
}

// ---------------------------------------------------------------------------------------
// Evaluation helpers
// ---------------------------------------------------------------------------------------

struct Scope {
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> vars;
  explicit Scope(std::shared_ptr<Scope> p) : parent(std::move(p)) {}
  const Value* lookup(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopeP = std::shared_ptr<Scope>;

ScopeP new_frame(const ScopeP& parent, const std::vector<std::string>& missing) {
  auto sc = std::make_shared<Scope>(parent);
  for (const auto& n : missing) sc->vars[n] = undefined_name(n);
  return sc;
}

Value char_value(char32_t c) {
  std::string s;
  append_utf8(s, c);
  return make_str(std::move(s));
}

// iter(v) as a list; TypeError like Python for what is not iterable.
std::vector<Value> iterate(const Value& v) {
  switch (v.k) {
    case VK::Undefined: return {};
    case VK::List: return v.list->items;
    case VK::Dict: {
      std::vector<Value> keys;
      keys.reserve(v.dict->items.size());
      for (const auto& kv : v.dict->items) keys.push_back(kv.first);
      return keys;
    }
    case VK::Str: {
      std::vector<Value> chars;
      if (is_ascii(v.s)) {
        for (char c : v.s) chars.push_back(make_str(std::string(1, c)));
      } else {
        for (char32_t c : decode_utf8(v.s)) chars.push_back(char_value(c));
      }
      return chars;
    }
    case VK::Loop: return v.loop->items;
    case VK::Iter: {
      std::vector<Value> items;
      while (auto x = v.iter->pull()) items.push_back(std::move(*x));
      return items;
    }
    default: type_error(str_repr(type_name(v)) + " object is not iterable");
  }
}

// iter(v), consumed one item at a time (generators stay lazy).
struct Cursor {
  std::vector<Value> items;
  size_t pos = 0;
  std::shared_ptr<IterObj> it;
  std::optional<Value> next() {
    if (it) return it->pull();
    if (pos < items.size()) return items[pos++];
    return std::nullopt;
  }
};
Cursor cursor_of(const Value& v) {
  Cursor c;
  if (v.k == VK::Iter) {
    c.it = v.iter;
  } else {
    c.items = iterate(v);
  }
  return c;
}
bool is_iterable(const Value& v) {
  switch (v.k) {
    case VK::Str: case VK::List: case VK::Dict: case VK::Undefined: case VK::Loop: case VK::Iter: return true;
    default: return false;
  }
}
[[noreturn]] void unhashable(const Value& v) { type_error("unhashable type: " + str_repr(type_name(v))); }
bool is_unhashable(const Value& v) {
  return (v.k == VK::List && (!v.list->tuple || (v.list->view != "" && v.list->view != "range"))) || v.k == VK::Dict || v.k == VK::Namespace;
}

int64_t length_of(const Value& v) {
  switch (v.k) {
    case VK::Undefined: return 0;
    case VK::Str: return static_cast<int64_t>(py_len(v.s));
    case VK::List: return static_cast<int64_t>(v.list->items.size());
    case VK::Dict: return static_cast<int64_t>(v.dict->items.size());
    case VK::Loop: return static_cast<int64_t>(v.loop->items.size());
    default: type_error("object of type " + str_repr(type_name(v)) + " has no len()");
  }
}

bool py_contains(const Value& container, const Value& item) {
  switch (container.k) {
    case VK::Undefined: return false;
    case VK::Str:
      if (item.k != VK::Str) {
        type_error("'in <string>' requires string as left operand, not " + type_name(item));
      }
      return container.s.find(item.s) != std::string::npos;
    case VK::List:
      for (const auto& x : container.list->items) {
        if (py_eq(x, item)) return true;
      }
      return false;
    case VK::Dict:
      if (is_unhashable(item)) unhashable(item);
      return container.dict->find(item) != nullptr;
    case VK::Iter:
      while (auto x = container.iter->pull()) {
        if (py_eq(*x, item)) return true;
      }
      return false;
    case VK::Loop:
      for (const auto& x : container.loop->items) {
        if (py_eq(x, item)) return true;
      }
      return false;
    default:
      type_error("argument of type " + str_repr(type_name(container)) + " is not iterable");
  }
}

// Python slice index normalisation (PySlice_AdjustIndices).
struct SliceIdx {
  int64_t start, stop, step, count;
};
SliceIdx adjust_slice(int64_t len, std::optional<int64_t> start, std::optional<int64_t> stop,
                      std::optional<int64_t> step) {
  int64_t st = step.value_or(1);
  if (st == 0) raise_error(EKind::Type, "slice step cannot be zero");
  auto fix = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= len) {
      x = st < 0 ? len - 1 : len;
    }
    return x;
  };
  int64_t a = fix(start, st < 0 ? len - 1 : 0);
  int64_t b = fix(stop, st < 0 ? -1 : len);
  int64_t count = 0;
  if (st > 0 && a < b) count = (b - a - 1) / st + 1;
  if (st < 0 && a > b) count = (a - b - 1) / (-st) + 1;
  return {a, b, st, count};
}

// ---------------------------------------------------------------------------------------
// Argument binding for builtins
// ---------------------------------------------------------------------------------------

struct Params {
  std::vector<Value> v;
  std::vector<bool> given;
  const Value& operator[](size_t k) const { return v[k]; }
  bool has(size_t k) const { return given[k]; }
};

Params bind(const std::string& fname, const CallArgs& a, std::vector<const char*> names,
            size_t required = 0) {
  Params p;
  p.v.resize(names.size());
  p.given.assign(names.size(), false);
  if (a.pos.size() > names.size()) {
    type_error(fname + "() takes at most " + std::to_string(names.size()) + " argument(s) (" +
               std::to_string(a.pos.size()) + " given)");
  }
  for (size_t k = 0; k < a.pos.size(); ++k) {
    p.v[k] = a.pos[k];
    p.given[k] = true;
  }
  for (const auto& kw : a.kw) {
    size_t idx = names.size();
    for (size_t k = 0; k < names.size(); ++k) {
      if (kw.first == names[k]) idx = k;
    }
    if (idx == names.size()) {
      type_error(fname + "() got an unexpected keyword argument " + str_repr(kw.first));
    }
    if (p.given[idx]) type_error(fname + "() got multiple values for argument " + str_repr(kw.first));
    p.v[idx] = kw.second;
    p.given[idx] = true;
  }
  for (size_t k = 0; k < required; ++k) {
    if (!p.given[k]) type_error(fname + "() missing required argument " + str_repr(names[k]));
  }
  return p;
}

const std::string& need_str(const Value& v, const std::string& what) {
  if (v.k == VK::Undefined) fail_undefined(v);
  if (v.k != VK::Str) type_error((what.empty() ? "" : what + " ") + "must be str, not " + type_name(v));
  return v.s;
}
int64_t need_int(const Value& v, const std::string& what) {
  if (v.k == VK::Undefined) fail_undefined(v);
  if (!v.is_int()) {
    type_error(str_repr(type_name(v)) + " object cannot be interpreted as an integer (" + what + ")");
  }
  return v.as_int();
}

// ---------------------------------------------------------------------------------------
// Python string methods
// ---------------------------------------------------------------------------------------

bool in_set(char32_t c, const std::u32string* chars) {
  if (!chars) return py_isspace(c);
  return chars->find(c) != std::u32string::npos;
}

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

Value str_list(const std::vector<std::string>& parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (const auto& p : parts) items.push_back(make_str(p));
  return make_list(std::move(items));
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
    out += repl;
    start = f + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
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

int64_t py_find(const std::string& s, const std::string& sub, const Value* start, const Value* end,
                bool reverse) {
  std::u32string d = decode_utf8(s);
  std::u32string needle = decode_utf8(sub);
  int64_t len = static_cast<int64_t>(d.size());
  auto norm = [&](const Value* v, int64_t dflt) {
    if (!v || v->k == VK::None) return dflt;
    int64_t x = need_int(*v, "slice index");
    if (x < 0) x = std::max<int64_t>(0, x + len);
    return std::min(x, len);
  };
  int64_t a = norm(start, 0), b = norm(end, len);
  if (b - a < static_cast<int64_t>(needle.size())) return -1;
  std::u32string_view hay(d.data() + a, static_cast<size_t>(b - a));
  size_t f = reverse ? hay.rfind(needle) : hay.find(needle);
  return f == std::u32string_view::npos ? -1 : a + static_cast<int64_t>(f);
}

std::string pad_str(const std::string& s, int64_t width, char32_t fill, char align) {
  int64_t len = static_cast<int64_t>(py_len(s));
  if (width <= len) return s;
  int64_t total = width - len;
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

std::string py_center(const std::string& s, int64_t width, char32_t fill) {
  int64_t len = static_cast<int64_t>(py_len(s));
  if (width <= len) return s;
  int64_t marg = width - len;
  int64_t left = marg / 2 + (marg & width & 1);
  std::string f;
  append_utf8(f, fill);
  std::string out;
  for (int64_t k = 0; k < left; ++k) out += f;
  out += s;
  for (int64_t k = 0; k < marg - left; ++k) out += f;
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
  while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') width = (width < 0 ? 0 : width * 10) + (spec[i++] - '0');
  char grouping = 0;
  if (i < spec.size() && (spec[i] == ',' || spec[i] == '_')) grouping = static_cast<char>(spec[i++]);
  int precision = -1;
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    precision = 0;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') precision = precision * 10 + static_cast<int>(spec[i++] - '0');
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
    for (int64_t k = len; k < width; ++k) pad += f;
    return sign_str + pad + body;
  }
  return pad_str(sign_str + body, width, fill, align == '=' ? '>' : align);
}

Value getattr_value(const Value& obj, const std::string& name);
Value getitem_value(const Value& obj, const Value& key);

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
      while (i < n && is_dig(fmt[i])) width = (width < 0 ? 0 : width * 10) + (fmt[i++] - '0');
    }
    int prec = -1;
    if (i < n && fmt[i] == '.') {
      ++i;
      prec = 0;
      if (i < n && fmt[i] == '*') {
        prec = static_cast<int>(need_int(next_arg(), "* precision"));
        ++i;
      } else {
        while (i < n && is_dig(fmt[i])) prec = prec * 10 + (fmt[i++] - '0');
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

bool starts_or_ends(const std::string& s, const Value& arg, bool ends, const Value* start,
                    const Value* end) {
  std::string view = s;
  if ((start && start->k != VK::None) || (end && end->k != VK::None)) {
    std::u32string d = decode_utf8(s);
    int64_t len = static_cast<int64_t>(d.size());
    auto norm = [&](const Value* v, int64_t dflt) {
      if (!v || v->k == VK::None) return dflt;
      int64_t x = need_int(*v, "slice index");
      if (x < 0) x = std::max<int64_t>(0, x + len);
      return std::min(x, len);
    };
    int64_t a = norm(start, 0), b = norm(end, len);
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
      if (idx++) out += self;
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

// ---------------------------------------------------------------------------------------
// Attribute and item access (the sandbox's getattr/getitem)
// ---------------------------------------------------------------------------------------

bool is_unsafe_mutator(const Value& obj, const std::string& name) {
  static const std::unordered_set<std::string> list_mut = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"};
  static const std::unordered_set<std::string> dict_mut = {"clear", "pop", "popitem", "setdefault", "update"};
  if (is_plain_list(obj)) return list_mut.count(name) > 0;
  if (obj.k == VK::Dict) return dict_mut.count(name) > 0;
  return false;
}

Value loop_attr(const Value& obj, const std::string& name) {
  const LoopState& L = *obj.loop;
  int64_t idx = static_cast<int64_t>(L.index);
  int64_t len = static_cast<int64_t>(L.items.size());
  if (name == "index") return make_int(idx + 1);
  if (name == "index0") return make_int(idx);
  if (name == "revindex") return make_int(len - idx);
  if (name == "revindex0") return make_int(len - idx - 1);
  if (name == "first") return make_bool(idx == 0);
  if (name == "last") return make_bool(idx == len - 1);
  if (name == "length") return make_int(len);
  if (name == "depth") return make_int(1);
  if (name == "depth0") return make_int(0);
  if (name == "previtem") {
    return idx > 0 ? L.items[static_cast<size_t>(idx - 1)] : make_undefined("there is no previous item");
  }
  if (name == "nextitem") {
    return idx + 1 < len ? L.items[static_cast<size_t>(idx + 1)] : make_undefined("there is no next item");
  }
  if (name == "cycle") {
    std::shared_ptr<LoopState> st = obj.loop;
    return make_func("cycle", [st](Interp&, CallArgs& a) -> Value {
      if (a.pos.empty()) type_error("no items for cycling given");
      return a.pos[st->index % a.pos.size()];
    }, "method");
  }
  if (name == "changed") {
    std::shared_ptr<LoopState> st = obj.loop;
    return make_func("changed", [st](Interp&, CallArgs& a) -> Value {
      bool same = st->has_last_changed && st->last_changed.size() == a.pos.size();
      for (size_t k = 0; same && k < a.pos.size(); ++k) same = py_eq(st->last_changed[k], a.pos[k]);
      if (same) return make_bool(false);
      st->has_last_changed = true;
      st->last_changed = a.pos;
      return make_bool(true);
    }, "method");
  }
  return undefined_attr(obj, name);
}

// Python's getattr(obj, name) where the object has such an attribute; nullopt when not.
std::optional<Value> python_attr(const Value& obj, const std::string& name) {
  switch (obj.k) {
    case VK::Str:
      if (python_str_methods().count(name)) {
        std::string self = obj.s;
        return make_func(name, [self, name](Interp&, CallArgs& a) { return call_str_method(self, name, a); }, "method");
      }
      return std::nullopt;
    case VK::Dict: {
      static const std::unordered_set<std::string> methods = {"get", "items", "keys", "values", "copy", "clear", "pop", "popitem", "setdefault", "update", "fromkeys"};
      if (!methods.count(name)) return std::nullopt;
      if (is_unsafe_mutator(obj, name)) return unsafe_undefined(obj, name);
      Value self = obj;
      return make_func(name, [self, name](Interp&, CallArgs& a) -> Value {
        const DictObj& d = *self.dict;
        if (name == "get") {
          Params p = bind("dict.get", a, {"key", "default"}, 1);
          const Value* v = d.find(p[0]);
          if (v) return *v;
          return p.has(1) ? p[1] : make_none();
        }
        bind("dict." + name, a, {});
        std::vector<Value> out;
        out.reserve(d.items.size());
        for (const auto& kv : d.items) {
          if (name == "items") {
            out.push_back(make_list({kv.first, kv.second}, true));
          } else if (name == "keys") {
            out.push_back(kv.first);
          } else if (name == "values") {
            out.push_back(kv.second);
          }
        }
        if (name == "copy") {
          Value c = make_dict();
          for (const auto& kv : d.items) c.dict->set(kv.first, kv.second);
          return c;
        }
        if (name == "fromkeys") raise_error(EKind::Runtime, "dict.fromkeys() is not supported in chat templates");
        return make_view(name == "items" ? "dict_items" : name == "keys" ? "dict_keys" : "dict_values", std::move(out));
      }, "method");
    }
    case VK::List: {
      static const std::unordered_set<std::string> methods = {"append", "clear", "copy", "count", "extend", "index", "insert", "pop", "remove", "reverse", "sort"};
      if (!methods.count(name) || !is_seq(obj)) return std::nullopt;
      if (obj.list->tuple && name != "count" && name != "index") return std::nullopt;
      if (is_unsafe_mutator(obj, name)) return unsafe_undefined(obj, name);
      Value self = obj;
      return make_func(name, [self, name](Interp&, CallArgs& a) -> Value {
        const auto& items = self.list->items;
        if (name == "copy") {
          bind("list.copy", a, {});
          return make_list(items);
        }
        if (name == "count") {
          Params p = bind("count", a, {"value"}, 1);
          int64_t c = 0;
          for (const auto& x : items) c += py_eq(x, p[0]) ? 1 : 0;
          return make_int(c);
        }
        Params p = bind("index", a, {"value", "start", "stop"}, 1);
        auto adj = adjust_slice(static_cast<int64_t>(items.size()),
                                p.has(1) ? std::optional<int64_t>(need_int(p[1], "start")) : std::nullopt,
                                p.has(2) ? std::optional<int64_t>(need_int(p[2], "stop")) : std::nullopt, 1);
        for (int64_t k = std::max<int64_t>(0, adj.start); k < adj.stop; ++k) {
          if (py_eq(items[static_cast<size_t>(k)], p[0])) return make_int(k);
        }
        raise_error(EKind::Type, py_repr(p[0]) + " is not in " + (self.list->tuple ? "tuple" : "list"));
      }, "method");
    }
    case VK::Namespace: {
      const Value* v = obj.dict->find(name);
      if (v) return *v;
      return std::nullopt;
    }
    case VK::Loop: {
      Value v = loop_attr(obj, name);
      if (v.k == VK::Undefined && !v.undef->message.empty() && v.undef->message.find("has no attribute") != std::string::npos) {
        return std::nullopt;
      }
      return v;
    }
    default: return std::nullopt;
  }
}

Value getattr_value(const Value& obj, const std::string& name) {
  if (obj.k == VK::Undefined) fail_undefined(obj);
  if (!name.empty() && name[0] == '_') {
    if (name.size() > 1 && name[1] == '_') return unsafe_undefined(obj, name);
    if (obj.k == VK::Dict) {
      const Value* v = obj.dict->find(name);
      if (v) return *v;
    }
    return undefined_attr(obj, name);
  }
  if (auto v = python_attr(obj, name)) return *v;
  if (obj.k == VK::Dict) {
    const Value* v = obj.dict->find(name);
    if (v) return *v;
  }
  return undefined_attr(obj, name);
}

Value index_seq(const Value& obj, int64_t idx) {
  if (obj.k == VK::Str) {
    if (is_ascii(obj.s)) {
      int64_t len = static_cast<int64_t>(obj.s.size());
      int64_t k = idx < 0 ? idx + len : idx;
      if (k < 0 || k >= len) return undefined_elem(obj, make_int(idx));
      return make_str(std::string(1, obj.s[static_cast<size_t>(k)]));
    }
    std::u32string d = decode_utf8(obj.s);
    int64_t len = static_cast<int64_t>(d.size());
    int64_t k = idx < 0 ? idx + len : idx;
    if (k < 0 || k >= len) return undefined_elem(obj, make_int(idx));
    return char_value(d[static_cast<size_t>(k)]);
  }
  const auto& items = obj.list->items;
  int64_t len = static_cast<int64_t>(items.size());
  int64_t k = idx < 0 ? idx + len : idx;
  if (k < 0 || k >= len) return undefined_elem(obj, make_int(idx));
  return items[static_cast<size_t>(k)];
}

Value getitem_value(const Value& obj, const Value& key) {
  if (obj.k == VK::Undefined) fail_undefined(obj);
  switch (obj.k) {
    case VK::Dict: {
      const Value* v = obj.dict->find(key);
      if (v) return *v;
      break;
    }
    case VK::List:
      if (key.is_int() && (obj.list->view.empty() || obj.list->view == "range")) return index_seq(obj, key.as_int());
      break;
    case VK::Str:
      if (key.is_int()) return index_seq(obj, key.as_int());
      break;
    default: break;
  }
  if (key.k == VK::Str) {
    if (!key.s.empty() && key.s[0] == '_') return undefined_elem(obj, key);
    if (auto v = python_attr(obj, key.s)) return *v;
  }
  return undefined_elem(obj, key);
}

Value slice_value(const Value& obj, std::optional<int64_t> start, std::optional<int64_t> stop,
                  std::optional<int64_t> step, const std::string& slice_repr) {
  if (obj.k == VK::Undefined) fail_undefined(obj);
  if (obj.k == VK::Str) {
    std::u32string d = decode_utf8(obj.s);
    auto s = adjust_slice(static_cast<int64_t>(d.size()), start, stop, step);
    std::string out;
    for (int64_t k = 0, i = s.start; k < s.count; ++k, i += s.step) append_utf8(out, d[static_cast<size_t>(i)]);
    return make_str(out);
  }
  if (obj.k == VK::List && (obj.list->view.empty() || obj.list->view == "range")) {
    const auto& items = obj.list->items;
    auto s = adjust_slice(static_cast<int64_t>(items.size()), start, stop, step);
    std::vector<Value> out;
    for (int64_t k = 0, i = s.start; k < s.count; ++k, i += s.step) out.push_back(items[static_cast<size_t>(i)]);
    if (obj.list->view == "range") {
      const ListObj& r = *obj.list;
      int64_t nstart = r.r_start + s.start * r.r_step, nstep = r.r_step * s.step;
      return make_range(nstart, nstart + s.count * nstep, nstep, std::move(out));
    }
    return make_list(std::move(out), obj.list->tuple);
  }
  return make_undefined(object_type_repr(obj) + " has no element " + slice_repr);
}

// ---------------------------------------------------------------------------------------
// Arithmetic
// ---------------------------------------------------------------------------------------

std::string html_escape(const std::string& s);
Value make_markup(std::string s) {
  Value v = make_str(std::move(s));
  v.markup = true;
  return v;
}
// markupsafe.escape(): Markup stays as it is, anything else is str()'d and escaped.
Value markup_escape(const Value& v) {
  if (v.k == VK::Str && v.markup) return v;
  return make_markup(html_escape(py_str(v)));
}

[[noreturn]] void unsupported_operands(const std::string& op, const Value& a, const Value& b) {
  type_error("unsupported operand type(s) for " + op + ": " + str_repr(type_name(a)) + " and " + str_repr(type_name(b)));
}

double float_mod(double vx, double wx) {
  double mod = std::fmod(vx, wx);
  if (mod != 0.0) {
    if ((wx < 0) != (mod < 0)) mod += wx;
  } else {
    mod = std::copysign(0.0, wx);
  }
  return mod;
}
double float_floordiv(double vx, double wx) {
  double mod = std::fmod(vx, wx);
  double div = (vx - mod) / wx;
  if (mod != 0.0) {
    if ((wx < 0) != (mod < 0)) div -= 1.0;
  }
  double floordiv;
  if (div != 0.0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, vx / wx);
  }
  return floordiv;
}

Value repeat(const Value& seq, int64_t n) {
  if (seq.k == VK::Str) {
    std::string out;
    for (int64_t k = 0; k < n; ++k) out += seq.s;
    return make_str(out);
  }
  std::vector<Value> out;
  for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.list->items.begin(), seq.list->items.end());
  return make_list(std::move(out), seq.list->tuple);
}

[[noreturn]] void int_overflow() {
  raise_error(EKind::Type, "integer overflow (chat templates use 64-bit integers)");
}
int64_t add_i64(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) int_overflow();
  return r;
}
int64_t sub_i64(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) int_overflow();
  return r;
}
int64_t mul_i64(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) int_overflow();
  return r;
}

Value binop(const std::string& op, const Value& a, const Value& b) {
  if (a.k == VK::Undefined) fail_undefined(a);
  if (op == "%" && a.k == VK::Str && !a.markup) return make_str(py_percent_format(a.s, b));
  if (b.k == VK::Undefined) fail_undefined(b);
  bool both_num = a.is_num() && b.is_num();
  bool both_int = a.is_int() && b.is_int();
  if ((a.markup || b.markup) && (op == "+" || op == "%" || op == "*")) {
    // markupsafe.Markup: the plain operand is escaped and the result stays Markup
    if (op == "+" && a.k == VK::Str && b.k == VK::Str) return make_markup(markup_escape(a).s + markup_escape(b).s);
    if (op == "+") unsupported_operands("+", a, b);
    if (op == "*" && a.k == VK::Str && b.is_int()) return make_markup(repeat(a, b.as_int()).s);
    if (op == "*" && b.k == VK::Str && a.is_int()) return make_markup(repeat(b, a.as_int()).s);
    if (op == "%" && a.markup) {
      Value args = b;
      if (b.is_tuple()) {
        std::vector<Value> esc;
        for (const auto& x : b.list->items) esc.push_back(x.k == VK::Str ? markup_escape(x) : x);
        args = make_list(std::move(esc), true);
      } else if (b.k == VK::Str) {
        args = markup_escape(b);
      }
      return make_markup(py_percent_format(a.s, args));
    }
  }
  if (op == "+") {
    if (both_int) return make_int(add_i64(a.as_int(), b.as_int()));
    if (both_num) return make_float(a.as_double() + b.as_double());
    if (a.k == VK::Str && b.k == VK::Str) return make_str(a.s + b.s);
    if (is_seq(a) && is_seq(b) && a.list->tuple == b.list->tuple) {
      std::vector<Value> out = a.list->items;
      out.insert(out.end(), b.list->items.begin(), b.list->items.end());
      return make_list(std::move(out), a.list->tuple);
    }
    if (a.k == VK::Str || is_seq(a)) {
      type_error("can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a));
    }
    unsupported_operands("+", a, b);
  }
  if (op == "-") {
    if (both_int) return make_int(sub_i64(a.as_int(), b.as_int()));
    if (both_num) return make_float(a.as_double() - b.as_double());
    unsupported_operands("-", a, b);
  }
  if (op == "*") {
    if (both_int) return make_int(mul_i64(a.as_int(), b.as_int()));
    if (both_num) return make_float(a.as_double() * b.as_double());
    if ((a.k == VK::Str || is_seq(a)) && b.is_int()) return repeat(a, b.as_int());
    if ((b.k == VK::Str || is_seq(b)) && a.is_int()) return repeat(b, a.as_int());
    if (a.k == VK::Str || is_seq(a)) type_error("can't multiply sequence by non-int of type " + str_repr(type_name(b)));
    if (b.k == VK::Str || is_seq(b)) type_error("can't multiply sequence by non-int of type " + str_repr(type_name(a)));
    unsupported_operands("*", a, b);
  }
  if (op == "/") {
    if (!both_num) unsupported_operands("/", a, b);
    if (b.as_double() == 0.0) raise_error(EKind::Type, both_int ? "division by zero" : "float division by zero");
    return make_float(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (!both_num) unsupported_operands("//", a, b);
    if (both_int) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) raise_error(EKind::Type, "integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) int_overflow();
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return make_int(q);
    }
    if (b.as_double() == 0.0) raise_error(EKind::Type, "float floor division by zero");
    return make_float(float_floordiv(a.as_double(), b.as_double()));
  }
  if (op == "%") {
    if (a.k == VK::Str) return make_str(py_percent_format(a.s, b));
    if (!both_num) unsupported_operands("%", a, b);
    if (both_int) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) raise_error(EKind::Type, "integer modulo by zero");
      if (y == -1) return make_int(0);
      int64_t r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return make_int(r);
    }
    if (b.as_double() == 0.0) raise_error(EKind::Type, "float modulo");
    return make_float(float_mod(a.as_double(), b.as_double()));
  }
  if (op == "**") {
    if (!both_num) unsupported_operands("** or pow()", a, b);
    if (both_int && b.as_int() >= 0) {
      int64_t base = a.as_int(), e = b.as_int(), r = 1;
      while (e > 0) {
        if (e & 1) r = mul_i64(r, base);
        e >>= 1;
        if (e > 0) base = mul_i64(base, base);
      }
      return make_int(r);
    }
    double x = a.as_double(), y = b.as_double();
    if (x == 0.0 && y < 0) raise_error(EKind::Type, "0.0 cannot be raised to a negative power");
    if (x < 0 && std::isfinite(y) && y != std::floor(y)) {
      raise_error(EKind::Type, "complex numbers (a negative number to a fractional power) are not supported in chat templates");
    }
    double r = std::pow(x, y);
    if (std::isinf(r) && std::isfinite(x) && std::isfinite(y)) raise_error(EKind::Type, "(34, 'Numerical result out of range')");
    return make_float(r);
  }
  raise_error(EKind::Runtime, "unknown operator " + op);
}

bool compare_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return py_eq(a, b);
  if (op == "!=") return !py_eq(a, b);
  if (op == "in") return py_contains(b, a);
  if (op == "notin") return !py_contains(b, a);
  auto c = py_compare(a, b, op.c_str());
  if (!c) return false;
  if (op == "<") return *c < 0;
  if (op == "<=") return *c <= 0;
  if (op == ">") return *c > 0;
  return *c >= 0;
}

// ---------------------------------------------------------------------------------------
// Interpreter
// ---------------------------------------------------------------------------------------

using FilterFn = std::function<Value(Interp&, const Value&, CallArgs&)>;
using TestFn = std::function<bool(Interp&, const Value&, CallArgs&)>;
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();

// Thrown while folding constants: the expression cannot be computed at compile time.
struct Impossible {};

class Interp {
 public:
  enum class Flow { Normal, Break, Continue };

  // Jinja2's optimizer (nodes.*.as_const): no variables, no calls, no context filters, and
  // the sandbox's forgiving getitem for slices too.
  bool const_mode_ = false;

  Value call(const Value& callee, CallArgs& args) {
    if (callee.k == VK::Undefined) fail_undefined(callee);
    if (callee.k != VK::Func) type_error(str_repr(type_name(callee)) + " object is not callable");
    return callee.fn->call(*this, args);
  }

  Value apply_filter(const std::string& name, const Value& v, CallArgs& args) {
    auto it = filters().find(name);
    if (it == filters().end()) {
      if (jinja_only_filter(name)) raise_error(EKind::Runtime, "filter " + str_repr(name) + " is not supported in chat templates");
      raise_error(EKind::Runtime, "No filter named " + str_repr(name) + " found.");
    }
    return it->second(*this, v, args);
  }

  bool apply_test(const std::string& name, const Value& v, CallArgs& args) {
    auto it = tests().find(name);
    if (it == tests().end()) raise_error(EKind::Runtime, "No test named " + str_repr(name) + " found.");
    return it->second(*this, v, args);
  }

  CallArgs eval_args(const Expr& e, size_t first, const ScopeP& sc) {
    CallArgs a;
    for (size_t k = first; k < e.kids.size(); ++k) a.pos.push_back(eval(*e.kids[k], sc));
    for (const auto& kv : e.kwargs) a.kw.emplace_back(kv.first, eval(*kv.second, sc));
    if (e.dyn_args) {
      for (auto& v : iterate(eval(*e.dyn_args, sc))) a.pos.push_back(std::move(v));
    }
    if (e.dyn_kwargs) {
      Value d = eval(*e.dyn_kwargs, sc);
      if (d.k != VK::Dict) type_error("argument after ** must be a mapping, not " + type_name(d));
      for (const auto& kv : d.dict->items) a.kw.emplace_back(py_str(kv.first), kv.second);
    }
    return a;
  }

  Value eval(const Expr& e, const ScopeP& sc) {
    switch (e.k) {
      case EK::Const: return e.val;
      case EK::Name: {
        if (const_mode_) throw Impossible{};
        const Value* v = sc->lookup(e.name);
        return v ? *v : undefined_name(e.name);
      }
      case EK::Getattr: return getattr_value(eval(*e.kids[0], sc), e.name);
      case EK::Getitem: {
        Value obj = eval(*e.kids[0], sc);
        const Expr& arg = *e.kids[1];
        if (arg.k == EK::Slice) {
          std::optional<int64_t> idx[3];
          std::string repr = "slice(";
          bool bad = false;
          for (int k = 0; k < 3; ++k) {
            if (k) repr += ", ";
            if (!arg.kids[k]) {
              repr += "None";
              continue;
            }
            Value v = eval(*arg.kids[k], sc);
            repr += py_repr(v);
            if (v.k == VK::None) continue;
            if (!v.is_int()) {
              bad = true;
              continue;
            }
            idx[k] = v.as_int();
          }
          repr += ")";
          // Jinja2 compiles a slice to a plain Python subscript, outside the sandbox's
          // getitem, so its errors surface as Python's.
          if (obj.k == VK::Undefined) fail_undefined(obj);
          bool sliceable = obj.k == VK::Str || (obj.k == VK::List && (obj.list->view.empty() || obj.list->view == "range"));
          if (const_mode_ && (!sliceable || bad)) {
            // constant folding goes through the sandbox's getitem, which turns the
            // TypeError into an undefined value
            return make_undefined(object_type_repr(obj) + " has no element " + repr);
          }
          if (obj.k == VK::Dict) type_error("unhashable type: 'slice'");
          if (!sliceable) type_error(str_repr(type_name(obj)) + " object is not subscriptable");
          if (bad) type_error("slice indices must be integers or None or have an __index__ method");
          return slice_value(obj, idx[0], idx[1], idx[2], repr);
        }
        Value key = eval(arg, sc);
        return getitem_value(obj, key);
      }
      case EK::Slice: raise_error(EKind::Runtime, "slice outside of a subscript");
      case EK::Call: {
        if (const_mode_) throw Impossible{};
        Value callee = eval(*e.kids[0], sc);
        CallArgs a = eval_args(e, 1, sc);
        return call(callee, a);
      }
      case EK::Filter: {
        if (const_mode_ && (e.name == "map" || e.name == "select" || e.name == "reject" ||
                            e.name == "selectattr" || e.name == "rejectattr")) {
          throw Impossible{};  // @pass_context filters
        }
        Value v = eval(*e.kids[0], sc);
        CallArgs a = eval_args(e, 1, sc);
        return apply_filter(e.name, v, a);
      }
      case EK::Test: {
        Value v = eval(*e.kids[0], sc);
        CallArgs a = eval_args(e, 1, sc);
        return make_bool(apply_test(e.name, v, a));
      }
      case EK::Neg:
      case EK::Pos: {
        Value v = eval(*e.kids[0], sc);
        if (v.k == VK::Undefined) fail_undefined(v);
        bool neg = e.k == EK::Neg;
        if (v.is_int()) {
          if (neg && v.as_int() == INT64_MIN) int_overflow();
          return make_int(neg ? -v.as_int() : v.as_int());
        }
        if (v.k == VK::Float) return make_float(neg ? -v.f : v.f);
        type_error(std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": " + str_repr(type_name(v)));
      }
      case EK::Not: return make_bool(!truthy(eval(*e.kids[0], sc)));
      case EK::And: {
        Value l = eval(*e.kids[0], sc);
        if (!truthy(l)) return l;
        return eval(*e.kids[1], sc);
      }
      case EK::Or: {
        Value l = eval(*e.kids[0], sc);
        if (truthy(l)) return l;
        return eval(*e.kids[1], sc);
      }
      case EK::Bin: {
        Value l = eval(*e.kids[0], sc);  // Python evaluates the left operand first
        Value r = eval(*e.kids[1], sc);
        if (!const_mode_ && e.name == "**" && e.kids[0]->k == EK::Const && l.is_num() &&
            (l.k == VK::Float ? std::signbit(l.f) : l.as_int() < 0)) {
          // Jinja2 writes a folded negative constant as its repr without parentheses, so
          // `(-2) ** n` runs as Python's `-2 ** n`, which is -(2 ** n).
          Value mag = l.k == VK::Float ? make_float(-l.f) : make_int(-l.as_int());
          Value p = binop("**", mag, r);
          return p.k == VK::Float ? make_float(-p.f) : make_int(-p.as_int());
        }
        return binop(e.name, l, r);
      }
      case EK::Compare: {
        Value left = eval(*e.kids[0], sc);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.kids[k + 1], sc);
          if (!compare_op(e.ops[k], left, right)) return make_bool(false);
          left = std::move(right);
        }
        return make_bool(true);
      }
      case EK::Concat: {
        std::string out;
        for (const auto& k : e.kids) out += py_str(eval(*k, sc));
        return make_str(std::move(out));
      }
      case EK::Cond: {
        if (truthy(eval(*e.kids[0], sc))) return eval(*e.kids[1], sc);
        if (e.kids[2]) return eval(*e.kids[2], sc);
        return make_undefined("the inline if-expression on line " + std::to_string(e.line) +
                              " evaluated to false and no else section was defined.");
      }
      case EK::List:
      case EK::Tuple: {
        std::vector<Value> items;
        items.reserve(e.kids.size());
        for (const auto& k : e.kids) items.push_back(eval(*k, sc));
        return make_list(std::move(items), e.k == EK::Tuple);
      }
      case EK::Dict: {
        Value d = make_dict();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = eval(*e.kids[k], sc);
          if (is_unhashable(key)) unhashable(key);
          d.dict->set(key, eval(*e.kids[k + 1], sc));
        }
        return d;
      }
      case EK::Placeholder:
        if (const_mode_) throw Impossible{};
        return placeholder_;
    }
    raise_error(EKind::Runtime, "unknown expression");
  }

  void assign(const Target& t, const Value& v, const ScopeP& sc) {
    switch (t.kind) {
      case Target::Name: sc->vars[t.name] = v; return;
      case Target::Tuple: {
        std::vector<Value> items = iterate(v);
        if (items.size() > t.items.size()) {
          raise_error(EKind::Type, "too many values to unpack (expected " + std::to_string(t.items.size()) + ")");
        }
        if (items.size() < t.items.size()) {
          raise_error(EKind::Type, "not enough values to unpack (expected " + std::to_string(t.items.size()) +
                                       ", got " + std::to_string(items.size()) + ")");
        }
        for (size_t k = 0; k < items.size(); ++k) assign(t.items[k], items[k], sc);
        return;
      }
      case Target::NS: {
        const Value* ns = sc->lookup(t.name);
        if (!ns || ns->k != VK::Namespace) {
          raise_error(EKind::Runtime, "cannot assign attribute on non-namespace object");
        }
        ns->dict->set(make_str(t.attr), v);
        return;
      }
    }
  }

  Value call_macro(const Stmt& m, const ScopeP& def_scope, CallArgs& a) {
    // Python stops runaway recursion with RecursionError; so do we, before the C++ stack runs out
    struct DepthGuard {
      int& d;
      explicit DepthGuard(int& depth) : d(depth) {
        if (++d > kMaxMacroDepth) {
          --d;
          raise_error(EKind::Runtime, "maximum recursion depth exceeded (macro calls nested more than " +
                                          std::to_string(kMaxMacroDepth) + " deep)");
        }
      }
      ~DepthGuard() { --d; }
    } guard(macro_depth_);
    auto sc = new_frame(def_scope, m.frame_undefined);
    const size_t np = m.params.size();
    if (a.pos.size() > np && !m.uses_varargs) {
      type_error("macro " + str_repr(m.name) + " takes not more than " + std::to_string(np) + " argument(s)");
    }
    std::vector<bool> bound(np, false);
    for (size_t k = 0; k < a.pos.size() && k < np; ++k) {
      sc->vars[m.params[k]] = a.pos[k];
      bound[k] = true;
    }
    Value kwargs = make_dict();
    for (const auto& kw : a.kw) {
      auto it = std::find(m.params.begin(), m.params.end(), kw.first);
      if (it != m.params.end()) {
        size_t idx = static_cast<size_t>(it - m.params.begin());
        if (bound[idx]) type_error("macro " + str_repr(m.name) + " got multiple values for argument " + str_repr(kw.first));
        sc->vars[kw.first] = kw.second;
        bound[idx] = true;
      } else if (m.uses_kwargs) {
        kwargs.dict->set(make_str(kw.first), kw.second);
      } else {
        type_error("macro " + str_repr(m.name) + " takes no keyword argument " + str_repr(kw.first));
      }
    }
    for (size_t k = 0; k < np; ++k) {
      if (bound[k]) continue;
      if (m.defaults[k]) {
        sc->vars[m.params[k]] = eval(*m.defaults[k], sc);
      } else {
        sc->vars[m.params[k]] = make_undefined("parameter " + str_repr(m.params[k]) + " was not provided");
      }
    }
    std::vector<Value> extra;
    for (size_t k = np; k < a.pos.size(); ++k) extra.push_back(a.pos[k]);
    sc->vars["varargs"] = make_list(std::move(extra), true);
    sc->vars["kwargs"] = kwargs;
    std::string out;
    exec(m.body, sc, out);
    return make_str(std::move(out));
  }

  Flow exec(const Body& body, const ScopeP& sc, std::string& out) {
    for (const auto& sp : body) {
      const Stmt& s = *sp;
      switch (s.k) {
        case SK::Data: out += s.text; break;
        case SK::Print: out += py_str(eval(*s.expr, sc)); break;
        case SK::If: {
          Flow f = truthy(eval(*s.expr, sc)) ? exec(s.body, sc, out) : exec(s.orelse, sc, out);
          if (f != Flow::Normal) return f;
          break;
        }
        case SK::For: exec_for(s, sc, out); break;
        case SK::Set: assign(s.target, eval(*s.expr, sc), sc); break;
        case SK::SetBlock: {
          std::string text;
          exec(s.body, new_frame(sc, s.frame_undefined), text);
          Value v = make_str(std::move(text));
          if (s.expr) v = apply_block_filter(*s.expr, v, sc);
          assign(s.target, v, sc);
          break;
        }
        case SK::FilterBlock: {
          std::string text;
          auto frame = new_frame(sc, s.frame_undefined);
          exec(s.body, frame, text);
          out += py_str(apply_block_filter(*s.expr, make_str(std::move(text)), frame));
          break;
        }
        case SK::Macro: {
          const Stmt* mp = &s;
          ScopeP def = sc;
          // The macro holds its defining scope; the scope then holds the macro. Break the
          // cycle with a weak reference: scopes outlive the macros called while rendering.
          std::weak_ptr<Scope> weak = def;
          sc->vars[s.name] = make_func(s.name, [mp, weak](Interp& in, CallArgs& a) -> Value {
            ScopeP d = weak.lock();
            if (!d) raise_error(EKind::Runtime, "macro called after its template finished rendering");
            return in.call_macro(*mp, d, a);
          }, "Macro");
          break;
        }
        case SK::With: {
          auto inner = new_frame(sc, s.frame_undefined);
          for (size_t k = 0; k < s.targets.size(); ++k) assign(s.targets[k], eval(*s.values[k], sc), inner);
          Flow f = exec(s.body, inner, out);
          if (f != Flow::Normal) return f;
          break;
        }
        case SK::Body: exec(s.body, new_frame(sc, s.frame_undefined), out); break;
        case SK::Break: return Flow::Break;
        case SK::Continue: return Flow::Continue;
      }
    }
    return Flow::Normal;
  }

  static constexpr int kMaxMacroDepth = 100;
  int macro_depth_ = 0;

  Value apply_block_filter(const Expr& filter, const Value& v, const ScopeP& sc) {
    Value saved = placeholder_;
    placeholder_ = v;
    Value r = eval(filter, sc);
    placeholder_ = saved;
    return r;
  }

  void exec_for(const Stmt& s, const ScopeP& sc, std::string& out) {
    Value seq = eval(*s.expr, sc);
    std::vector<Value> items = iterate(seq);
    if (s.cond) {
      std::vector<Value> kept;
      for (auto& item : items) {
        auto probe = std::make_shared<Scope>(sc);
        assign(s.target, item, probe);
        if (truthy(eval(*s.cond, probe))) kept.push_back(std::move(item));
      }
      items.swap(kept);
    }
    if (items.empty()) {
      exec(s.orelse, new_frame(sc, s.else_undefined), out);
      return;
    }
    Value loop;
    loop.k = VK::Loop;
    loop.loop = std::make_shared<LoopState>();
    loop.loop->items = std::move(items);
    const size_t n = loop.loop->items.size();
    for (size_t k = 0; k < n; ++k) {
      loop.loop->index = k;
      auto it = new_frame(sc, s.frame_undefined);
      assign(s.target, loop.loop->items[k], it);
      it->vars["loop"] = loop;
      if (exec(s.body, it, out) == Flow::Break) break;
    }
  }

 private:
  Value placeholder_;
};

// ---------------------------------------------------------------------------------------
// Filters (jinja2/filters.py; tojson as transformers defines it)
// ---------------------------------------------------------------------------------------

std::vector<Value> attribute_parts(const Value& attribute) {
  if (attribute.k != VK::Str) return {attribute};
  std::vector<Value> parts;
  for (const std::string& p : py_split_sep(attribute.s, ".", -1, false)) {
    if (!p.empty() && std::all_of(p.begin(), p.end(), is_dig)) {
      parts.push_back(make_int(std::stoll(p)));
    } else {
      parts.push_back(make_str(p));
    }
  }
  return parts;
}

Value get_attribute(const Value& item, const std::vector<Value>& parts, const Value* dflt = nullptr) {
  Value v = item;
  for (const auto& p : parts) v = getitem_value(v, p);
  if (dflt && dflt->k != VK::None && v.k == VK::Undefined) return *dflt;
  return v;
}

Value ignore_case(const Value& v) { return v.k == VK::Str ? make_str(lower_str(v.s)) : v; }

std::string soft_str(const Value& v) { return py_str(v); }

std::vector<Value> sorted_values(std::vector<Value> items, const std::function<Value(const Value&)>& key,
                                 bool reverse) {
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const auto& x : items) keys.push_back(key(x));
  std::vector<size_t> order(items.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  // Python's sorted(reverse=True) keeps equal items in their original order.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return reverse ? py_less(keys[b], keys[a]) : py_less(keys[a], keys[b]);
  });
  std::vector<Value> out;
  out.reserve(items.size());
  for (size_t k : order) out.push_back(std::move(items[k]));
  return out;
}

// A generator like Jinja2's: `first_use` runs when the first item is asked for (Jinja2's
// filters check their arguments inside the generator), then `step` maps each source item
// (nullopt: skip it).
struct GenState {
  bool started = false;
  Cursor cur;
  std::function<std::optional<Value>(const Value&)> step;
};
Value lazy_generator(const char* func, const Value& source, bool empty_when_falsy,
                     std::function<std::function<std::optional<Value>(const Value&)>()> first_use) {
  auto st = std::make_shared<GenState>();
  return make_iter("generator", func, [st, source, empty_when_falsy, first_use]() -> std::optional<Value> {
    if (!st->started) {
      st->started = true;
      if (empty_when_falsy && !truthy(source)) return std::nullopt;
      st->step = first_use();
      st->cur = cursor_of(source);
    }
    if (!st->step) return std::nullopt;
    while (auto x = st->cur.next()) {
      if (auto y = st->step(*x)) return y;
    }
    return std::nullopt;
  });
}

Value select_or_reject(Interp& in, const Value& seq, CallArgs& a, bool select, bool attr) {
  Interp* ip = &in;
  CallArgs args = a;
  return lazy_generator("select_or_reject", seq, true, [ip, args, select, attr]() {
    size_t off = 0;
    std::vector<Value> parts;
    if (attr) {
      if (args.pos.empty()) raise_error(EKind::Runtime, "Missing parameter for attribute name");
      parts = attribute_parts(args.pos[0]);
      off = 1;
    }
    bool has_test = args.pos.size() > off;
    std::string test_name = has_test ? py_str(args.pos[off]) : "";
    CallArgs targs;
    for (size_t k = off + 1; k < args.pos.size(); ++k) targs.pos.push_back(args.pos[k]);
    targs.kw = args.kw;
    return std::function<std::optional<Value>(const Value&)>(
        [ip, parts, has_test, test_name, targs, select, attr](const Value& item) -> std::optional<Value> {
          Value v = attr ? get_attribute(item, parts) : item;
          bool r;
          if (has_test) {
            CallArgs copy = targs;
            r = ip->apply_test(test_name, v, copy);
          } else {
            r = truthy(v);
          }
          if (r == select) return item;
          return std::nullopt;
        });
  });
}

Value min_max(const Value& seq, CallArgs& a, bool want_max, const char* fname) {
  Params p = bind(fname, a, {"case_sensitive", "attribute"});
  bool cs = p.has(0) && truthy(p[0]);
  std::vector<Value> parts;
  if (p.has(1) && p[1].k != VK::None) parts = attribute_parts(p[1]);
  std::vector<Value> items = iterate(seq);
  if (items.empty()) return make_undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& x) {
    Value v = parts.empty() ? x : get_attribute(x, parts);
    return cs ? v : ignore_case(v);
  };
  size_t best = 0;
  Value bk = key(items[0]);
  for (size_t k = 1; k < items.size(); ++k) {
    Value kk = key(items[k]);
    auto c = py_compare(kk, bk, want_max ? ">" : "<");
    if (c && (want_max ? *c > 0 : *c < 0)) {
      best = k;
      bk = kk;
    }
  }
  return items[best];
}

std::string do_indent(const std::string& s_in, const Value& width, bool first, bool blank) {
  std::string indention = width.k == VK::Str ? width.s : std::string(static_cast<size_t>(std::max<int64_t>(0, need_int(width, "width"))), ' ');
  std::string s = s_in + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) rv += "\n" + indention;
      rv += lines[k];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    if (lines.size() > 1) {
      rv += "\n";
      for (size_t k = 1; k < lines.size(); ++k) {
        if (k > 1) rv += "\n";
        rv += lines[k].empty() ? lines[k] : indention + lines[k];
      }
    }
  }
  if (first) rv = indention + rv;
  return rv;
}

std::optional<double> parse_py_float(const std::string& s_in) {
  std::string s = py_strip(s_in, nullptr, true, true);
  std::string t;
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k] == '_') {
      if (k == 0 || k + 1 >= s.size() || !is_dig(s[k - 1]) || !is_dig(s[k + 1])) return std::nullopt;
      continue;
    }
    t.push_back(s[k]);
  }
  if (t.empty()) return std::nullopt;
  std::string low = lower_str(t);
  std::string body = (low[0] == '+' || low[0] == '-') ? low.substr(1) : low;
  if (body == "inf" || body == "infinity" || body == "nan") {
    double v = body == "nan" ? NAN : INFINITY;
    return low[0] == '-' ? -v : v;
  }
  for (char c : body) {
    if (!(is_dig(c) || c == '.' || c == 'e' || c == '+' || c == '-')) return std::nullopt;
  }
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return v;
}

std::optional<int64_t> parse_py_int(const std::string& s_in, int base) {
  std::string s = py_strip(s_in, nullptr, true, true);
  bool neg = false;
  size_t k = 0;
  if (k < s.size() && (s[k] == '+' || s[k] == '-')) neg = s[k++] == '-';
  std::string digits;
  std::string rest = lower_str(s.substr(k));
  if ((base == 16 || base == 0) && rest.compare(0, 2, "0x") == 0) {
    base = 16;
    rest = rest.substr(2);
  } else if ((base == 8 || base == 0) && rest.compare(0, 2, "0o") == 0) {
    base = 8;
    rest = rest.substr(2);
  } else if ((base == 2 || base == 0) && rest.compare(0, 2, "0b") == 0) {
    base = 2;
    rest = rest.substr(2);
  }
  if (base == 0) base = 10;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == '_') {
      if (i == 0 || i + 1 >= rest.size() || rest[i + 1] == '_') return std::nullopt;
      continue;
    }
    int d = hex_val(rest[i]);
    if (d < 0 || d >= base) return std::nullopt;
    digits.push_back(rest[i]);
  }
  if (digits.empty()) return std::nullopt;
  errno = 0;
  unsigned long long v = std::strtoull(digits.c_str(), nullptr, base);
  if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX)) return std::nullopt;
  return neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
}

Value py_round(const Value& v, int64_t precision) {
  if (v.is_int()) {
    if (precision >= 0) return make_int(v.as_int());
    double p = std::pow(10.0, static_cast<double>(-precision));
    double r = std::nearbyint(static_cast<double>(v.as_int()) / p) * p;
    return make_int(static_cast<int64_t>(r));
  }
  double x = v.as_double();
  if (!std::isfinite(x)) return make_float(x);
  if (precision == 0) return make_float(std::nearbyint(x));
  if (precision > 0 && precision < 300) {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), x);
    return make_float(std::strtod(buf, nullptr));
  }
  double p = std::pow(10.0, static_cast<double>(-precision));
  return make_float(std::nearbyint(x / p) * p);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string jinja_title(const std::string& s) {
  // "".join(item[0].upper() + item[1:].lower() for item in re.split(r"([-\s({\[<]+)", s) if item)
  std::u32string d = decode_utf8(s);
  auto is_sep = [](char32_t c) { return c == '-' || py_isspace(c) || c == '(' || c == '{' || c == '[' || c == '<'; };
  std::string out;
  size_t i = 0;
  while (i < d.size()) {
    size_t j = i;
    bool sep = is_sep(d[i]);
    while (j < d.size() && is_sep(d[j]) == sep) ++j;
    for (size_t k = i; k < j; ++k) append_utf8(out, k == i ? to_upper_cp(d[k]) : to_lower_cp(d[k]));
    i = j;
  }
  return out;
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> table = [] {
    std::unordered_map<std::string, FilterFn> f;
    f["abs"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("abs", a, {});
      if (v.is_int()) {
        if (v.as_int() == INT64_MIN) raise_error(EKind::Type, "integer overflow (chat templates use 64-bit integers)");
        return make_int(std::llabs(v.as_int()));
      }
      if (v.k == VK::Float) return make_float(std::fabs(v.f));
      type_error("bad operand type for abs(): " + str_repr(type_name(v)));
    };
    f["attr"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("attr", a, {"name"}, 1);
      std::string name = soft_str(p[0]);
      if (v.k == VK::Undefined) fail_undefined(v);
      if (!name.empty() && name[0] == '_') return name.size() > 1 && name[1] == '_' ? unsafe_undefined(v, name) : undefined_attr(v, name);
      if (auto r = python_attr(v, name)) return *r;
      return undefined_attr(v, name);
    };
    f["batch"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("batch", a, {"linecount", "fill_with"}, 1);
      Value linecount = p[0];
      Value fill = p.has(1) ? p[1] : make_none();
      struct St {
        bool started = false, finished = false;
        Cursor cur;
        std::vector<Value> tmp;
      };
      auto st = std::make_shared<St>();
      return make_iter("generator", "do_batch", [st, v, linecount, fill]() -> std::optional<Value> {
        if (!st->started) {
          st->started = true;
          st->cur = cursor_of(v);
        }
        if (st->finished) return std::nullopt;
        while (auto x = st->cur.next()) {
          if (py_eq(make_int(static_cast<int64_t>(st->tmp.size())), linecount)) {
            Value out = make_list(std::move(st->tmp));
            st->tmp = {*x};
            return out;
          }
          st->tmp.push_back(*x);
        }
        st->finished = true;
        if (st->tmp.empty()) return std::nullopt;
        if (fill.k != VK::None) {
          int64_t n = need_int(linecount, "linecount");
          while (static_cast<int64_t>(st->tmp.size()) < n) st->tmp.push_back(fill);
        }
        return make_list(std::move(st->tmp));
      });
    };
    f["capitalize"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("capitalize", a, {});
      return make_str(py_capitalize(soft_str(v)));
    };
    f["center"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("center", a, {"width"});
      return make_str(py_center(soft_str(v), p.has(0) ? need_int(p[0], "width") : 80, ' '));
    };
    f["length"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("length", a, {});
      return make_int(length_of(v));
    };
    f["count"] = f["length"];
    f["default"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("default", a, {"default_value", "boolean"});
      Value dflt = p.has(0) ? p[0] : make_str("");
      if (v.k == VK::Undefined || (p.has(1) && truthy(p[1]) && !truthy(v))) return dflt;
      return v;
    };
    f["d"] = f["default"];
    f["dictsort"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("dictsort", a, {"case_sensitive", "by", "reverse"});
      bool cs = p.has(0) && truthy(p[0]);
      std::string by = p.has(1) ? need_str(p[1], "by") : "key";
      if (by != "key" && by != "value") raise_error(EKind::Runtime, "You can only sort by either \"key\" or \"value\"");
      if (v.k == VK::Undefined) fail_undefined(v);
      if (v.k != VK::Dict) type_error(str_repr(type_name(v)) + " object has no attribute 'items'");
      std::vector<Value> items;
      for (const auto& kv : v.dict->items) items.push_back(make_list({kv.first, kv.second}, true));
      size_t pos = by == "key" ? 0 : 1;
      return make_list(sorted_values(std::move(items), [&](const Value& x) {
        const Value& e = x.list->items[pos];
        return cs ? e : ignore_case(e);
      }, p.has(2) && truthy(p[2])));
    };
    f["escape"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("escape", a, {});
      return markup_escape(v);
    };
    f["e"] = f["escape"];
    f["first"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("first", a, {});
      Cursor c = cursor_of(v);
      auto x = c.next();
      return x ? *x : make_undefined("No first item, sequence was empty.");
    };
    f["last"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("last", a, {});
      if (v.k == VK::Iter) type_error(str_repr(type_name(v)) + " object is not reversible");
      if (!is_iterable(v)) type_error(str_repr(type_name(v)) + " object is not reversible");
      std::vector<Value> items = iterate(v);
      return items.empty() ? make_undefined("No last item, sequence was empty.") : items.back();
    };
    f["float"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("float", a, {"default"});
      Value dflt = p.has(0) ? p[0] : make_float(0.0);
      if (v.k == VK::Undefined) fail_undefined(v);  // Undefined.__float__
      if (v.is_num()) return make_float(v.as_double());
      if (v.k == VK::Str) {
        auto d = parse_py_float(v.s);
        return d ? make_float(*d) : dflt;
      }
      return dflt;
    };
    f["format"] = [](Interp&, const Value& v, CallArgs& a) {
      Value args;
      if (!a.kw.empty()) {
        args = make_dict();
        for (const auto& kw : a.kw) args.dict->set(make_str(kw.first), kw.second);
      } else {
        args = make_list(a.pos, true);
      }
      return make_str(py_percent_format(soft_str(v), args));
    };
    f["indent"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("indent", a, {"width", "first", "blank"});
      if (v.k == VK::Undefined) fail_undefined(v);
      if (is_plain_list(v)) raise_error(EKind::Runtime, "'list' object has no attribute 'splitlines'");
      if (v.is_tuple()) type_error("can only concatenate tuple (not \"str\") to tuple");
      if (v.k != VK::Str) type_error("unsupported operand type(s) for +=: " + str_repr(type_name(v)) + " and 'str'");
      return make_str(do_indent(soft_str(v), p.has(0) ? p[0] : make_int(4), p.has(1) && truthy(p[1]), p.has(2) && truthy(p[2])));
    };
    f["int"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("int", a, {"default", "base"});
      Value dflt = p.has(0) ? p[0] : make_int(0);
      int base = p.has(1) ? static_cast<int>(need_int(p[1], "base")) : 10;
      if (v.k == VK::Undefined) fail_undefined(v);  // Undefined.__int__
      if (v.is_int()) return make_int(v.as_int());
      auto to_int = [](double d) {
        double t = std::trunc(d);
        if (!(t >= -9223372036854775808.0 && t < 9223372036854775808.0)) int_overflow();
        return make_int(static_cast<int64_t>(t));
      };
      if (v.k == VK::Float) {
        if (!std::isfinite(v.f)) return dflt;
        return to_int(v.f);
      }
      if (v.k == VK::Str) {
        if (auto i = parse_py_int(v.s, base)) return make_int(*i);
        if (auto d = parse_py_float(v.s)) {
          if (std::isfinite(*d)) return to_int(*d);
        }
      }
      return dflt;
    };
    f["items"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("items", a, {});
      auto st = std::make_shared<std::pair<bool, Cursor>>();
      return make_iter("generator", "do_items", [st, v]() -> std::optional<Value> {
        if (!st->first) {
          st->first = true;
          if (v.k == VK::Undefined) return std::nullopt;
          if (v.k != VK::Dict) type_error("Can only get item pairs from a mapping.");
          for (const auto& kv : v.dict->items) st->second.items.push_back(make_list({kv.first, kv.second}, true));
        }
        return st->second.next();
      });
    };
    f["join"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("join", a, {"d", "attribute"});
      std::string sep = p.has(0) ? soft_str(p[0]) : "";
      std::vector<Value> parts;
      if (p.has(1) && p[1].k != VK::None) parts = attribute_parts(p[1]);
      std::string out;
      bool first = true;
      for (const Value& x : iterate(v)) {
        if (!first) out += sep;
        first = false;
        out += soft_str(parts.empty() ? x : get_attribute(x, parts));
      }
      return make_str(out);
    };
    f["list"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("list", a, {});
      return make_list(iterate(v));
    };
    f["lower"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("lower", a, {});
      return make_str(lower_str(soft_str(v)));
    };
    f["upper"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("upper", a, {});
      return make_str(upper_str(soft_str(v)));
    };
    f["map"] = [](Interp& in, const Value& v, CallArgs& a) {
      Interp* ip = &in;
      CallArgs args = a;
      return lazy_generator("sync_do_map", v, true, [ip, args]() {
        using Step = std::function<std::optional<Value>(const Value&)>;
        bool has_attribute = false;
        for (const auto& kw : args.kw) has_attribute = has_attribute || kw.first == "attribute";
        if (args.pos.empty() && has_attribute) {
          Value attribute, dflt = make_none();
          for (const auto& kw : args.kw) {
            if (kw.first == "attribute") {
              attribute = kw.second;
            } else if (kw.first == "default") {
              dflt = kw.second;
            } else {
              raise_error(EKind::Runtime, "Unexpected keyword argument " + str_repr(kw.first));
            }
          }
          std::vector<Value> parts = attribute_parts(attribute);
          return Step([parts, dflt](const Value& x) -> std::optional<Value> { return get_attribute(x, parts, &dflt); });
        }
        if (args.pos.empty()) raise_error(EKind::Runtime, "map requires a filter argument");
        std::string name = py_str(args.pos[0]);
        CallArgs rest;
        rest.pos.assign(args.pos.begin() + 1, args.pos.end());
        rest.kw = args.kw;
        return Step([ip, name, rest](const Value& x) -> std::optional<Value> {
          CallArgs copy = rest;
          return ip->apply_filter(name, x, copy);
        });
      });
    };
    f["max"] = [](Interp&, const Value& v, CallArgs& a) { return min_max(v, a, true, "max"); };
    f["min"] = [](Interp&, const Value& v, CallArgs& a) { return min_max(v, a, false, "min"); };
    f["select"] = [](Interp& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, true, false); };
    f["reject"] = [](Interp& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, false, false); };
    f["selectattr"] = [](Interp& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, true, true); };
    f["rejectattr"] = [](Interp& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, false, true); };
    f["replace"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("replace", a, {"old", "new", "count"}, 2);
      int64_t count = p.has(2) && p[2].k != VK::None ? need_int(p[2], "count") : -1;
      return make_str(py_replace(soft_str(v), soft_str(p[0]), soft_str(p[1]), count));
    };
    f["reverse"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("reverse", a, {});
      if (v.k == VK::Str) {
        std::u32string d = decode_utf8(v.s);
        std::reverse(d.begin(), d.end());
        return make_str(encode_utf8(d));
      }
      std::string it_type;  // reversed(value), where Python has it
      if (is_plain_list(v)) {
        it_type = "list_reverseiterator";
      } else if (v.k == VK::List && v.list->view == "range") {
        it_type = "range_iterator";
      } else if (v.k == VK::Dict || (v.k == VK::List && v.list->view == "dict_keys")) {
        it_type = "dict_reversekeyiterator";
      } else if (v.k == VK::List && v.list->view == "dict_items") {
        it_type = "dict_reverseitemiterator";
      } else if (v.k == VK::List && v.list->view == "dict_values") {
        it_type = "dict_reversevalueiterator";
      } else if (v.is_tuple() || v.k == VK::Undefined) {
        it_type = "reversed";
      }
      std::vector<Value> items;
      try {
        items = iterate(v);
      } catch (const ChatTemplateError& e) {
        if (e.kind() != EKind::Type) throw;
        raise_error(EKind::Runtime, "argument must be iterable");  // FilterArgumentError
      }
      std::reverse(items.begin(), items.end());
      if (it_type.empty()) return make_list(std::move(items));  // list(value), reversed
      auto cur = std::make_shared<Cursor>();
      cur->items = std::move(items);
      return make_iter(it_type, "", [cur]() { return cur->next(); });
    };
    f["round"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("round", a, {"precision", "method"});
      int64_t prec = p.has(0) ? need_int(p[0], "precision") : 0;
      std::string method = p.has(1) ? need_str(p[1], "method") : "common";
      if (method != "common" && method != "ceil" && method != "floor") {
        raise_error(EKind::Runtime, "method must be common, ceil or floor");
      }
      if (!v.is_num()) type_error("type " + type_name(v) + " doesn't define __round__ method");
      if (method == "common") return py_round(v, prec);
      double m = std::pow(10.0, static_cast<double>(prec));
      double x = v.as_double() * m;
      return make_float((method == "ceil" ? std::ceil(x) : std::floor(x)) / m);
    };
    f["safe"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("safe", a, {});
      return make_markup(soft_str(v));
    };
    f["sort"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("sort", a, {"reverse", "case_sensitive", "attribute"});
      bool cs = p.has(1) && truthy(p[1]);
      std::vector<std::vector<Value>> keys;
      if (p.has(2) && p[2].k != VK::None) {
        const Value& attr = p[2];
        if (attr.k == VK::Str) {
          for (const std::string& part : py_split_sep(attr.s, ",", -1, false)) keys.push_back(attribute_parts(make_str(part)));
        } else {
          keys.push_back(attribute_parts(attr));
        }
      }
      return make_list(sorted_values(iterate(v), [&](const Value& x) {
        if (keys.empty()) return cs ? x : ignore_case(x);
        if (keys.size() == 1) {
          Value k = get_attribute(x, keys[0]);
          return cs ? k : ignore_case(k);
        }
        std::vector<Value> tuple;
        for (const auto& parts : keys) {
          Value k = get_attribute(x, parts);
          tuple.push_back(cs ? k : ignore_case(k));
        }
        return make_list(std::move(tuple), true);
      }, p.has(0) && truthy(p[0])));
    };
    f["string"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("string", a, {});
      return make_str(soft_str(v));
    };
    f["sum"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("sum", a, {"attribute", "start"});
      std::vector<Value> parts;
      if (p.has(0) && p[0].k != VK::None) parts = attribute_parts(p[0]);
      Value total = p.has(1) ? p[1] : make_int(0);
      for (const Value& x : iterate(v)) total = binop("+", total, parts.empty() ? x : get_attribute(x, parts));
      return total;
    };
    f["title"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("title", a, {});
      return make_str(jinja_title(soft_str(v)));
    };
    f["tojson"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
      JsonOptions o;
      o.ensure_ascii = p.has(0) && truthy(p[0]);
      if (p.has(1) && p[1].k != VK::None) {
        if (p[1].k == VK::Str) {
          o.indent = p[1].s;
        } else {
          int64_t n = need_int(p[1], "indent");
          o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, n)), ' ');
        }
        o.item_sep = ",";
      }
      if (p.has(2) && p[2].k != VK::None) {
        std::vector<Value> seps = iterate(p[2]);
        if (seps.size() != 2) raise_error(EKind::Type, "separators must be a (item_separator, key_separator) pair");
        o.item_sep = need_str(seps[0], "item separator");
        o.key_sep = need_str(seps[1], "key separator");
      }
      o.sort_keys = p.has(3) && truthy(p[3]);
      std::string out;
      json_dump(out, v, o, 0);
      return make_str(out);
    };
    f["trim"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("trim", a, {"chars"});
      return make_str(py_strip(soft_str(v), p.has(0) ? &p[0] : nullptr, true, true));
    };
    f["truncate"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("truncate", a, {"length", "killwords", "end", "leeway"});
      if (v.k != VK::Str) {
        int64_t n = length_of(v);
        int64_t lim = (p.has(0) ? need_int(p[0], "length") : 255) + (p.has(3) && p[3].k != VK::None ? need_int(p[3], "leeway") : 5);
        if (n <= lim) return v;
        type_error("truncate of a " + type_name(v) + " is not supported in chat templates");
      }
      std::u32string s = decode_utf8(soft_str(v));
      int64_t length = p.has(0) ? need_int(p[0], "length") : 255;
      bool killwords = p.has(1) && truthy(p[1]);
      std::u32string end = decode_utf8(p.has(2) ? soft_str(p[2]) : "...");
      int64_t leeway = p.has(3) && p[3].k != VK::None ? need_int(p[3], "leeway") : 5;
      if (static_cast<int64_t>(s.size()) <= length + leeway) return make_str(encode_utf8(s));
      int64_t keep = std::max<int64_t>(0, length - static_cast<int64_t>(end.size()));
      std::u32string cut = s.substr(0, static_cast<size_t>(keep));
      if (!killwords) {
        size_t sp = cut.rfind(U' ');
        if (sp != std::u32string::npos) cut = cut.substr(0, sp);
      }
      return make_str(encode_utf8(cut + end));
    };
    f["unique"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("unique", a, {"case_sensitive", "attribute"});
      bool cs = p.has(0) && truthy(p[0]);
      std::vector<Value> parts;
      if (p.has(1) && p[1].k != VK::None) parts = attribute_parts(p[1]);
      auto seen = std::make_shared<std::vector<Value>>();
      return lazy_generator("do_unique", v, false, [seen, parts, cs]() {
        return std::function<std::optional<Value>(const Value&)>([seen, parts, cs](const Value& x) -> std::optional<Value> {
          Value k = parts.empty() ? x : get_attribute(x, parts);
          if (!cs) k = ignore_case(k);
          if (is_unhashable(k)) unhashable(k);
          for (const auto& s : *seen) {
            if (py_eq(s, k)) return std::nullopt;
          }
          seen->push_back(k);
          return x;
        });
      });
    };
    f["wordcount"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("wordcount", a, {});
      int64_t n = 0;
      bool in_word = false;
      for (char32_t c : decode_utf8(soft_str(v))) {
        bool w = is_alnum_cp(c) || c == '_';
        if (w && !in_word) ++n;
        in_word = w;
      }
      return make_int(n);
    };
    return f;
  }();
  return table;
}

// ---------------------------------------------------------------------------------------
// Tests (jinja2/tests.py)
// ---------------------------------------------------------------------------------------

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> table = [] {
    std::unordered_map<std::string, TestFn> t;
    auto no_args = [](const char* name, std::function<bool(const Value&)> fn) {
      std::string n = name;
      return [n, fn](Interp&, const Value& v, CallArgs& a) {
        bind(n, a, {});
        return fn(v);
      };
    };
    t["defined"] = no_args("defined", [](const Value& v) { return v.k != VK::Undefined; });
    t["undefined"] = no_args("undefined", [](const Value& v) { return v.k == VK::Undefined; });
    t["none"] = no_args("none", [](const Value& v) { return v.k == VK::None; });
    t["boolean"] = no_args("boolean", [](const Value& v) { return v.k == VK::Bool; });
    t["true"] = no_args("true", [](const Value& v) { return v.k == VK::Bool && v.b; });
    t["false"] = no_args("false", [](const Value& v) { return v.k == VK::Bool && !v.b; });
    t["integer"] = no_args("integer", [](const Value& v) { return v.k == VK::Int; });
    t["float"] = no_args("float", [](const Value& v) { return v.k == VK::Float; });
    t["number"] = no_args("number", [](const Value& v) { return v.is_num(); });
    t["string"] = no_args("string", [](const Value& v) { return v.k == VK::Str; });
    t["mapping"] = no_args("mapping", [](const Value& v) { return v.k == VK::Dict; });
    t["sequence"] = no_args("sequence", [](const Value& v) {
      return v.k == VK::Str || is_seq(v) || (v.k == VK::List && v.list->view == "range") || v.k == VK::Dict ||
             v.k == VK::Undefined;
    });
    t["iterable"] = no_args("iterable", [](const Value& v) { return is_iterable(v); });
    t["callable"] = no_args("callable", [](const Value& v) { return v.k == VK::Func || v.k == VK::Undefined; });
    t["escaped"] = no_args("escaped", [](const Value&) { return false; });
    t["lower"] = no_args("lower", [](const Value& v) {
      return truthy(call_str_method(soft_str(v), "islower", CallArgs{}));
    });
    t["upper"] = no_args("upper", [](const Value& v) {
      return truthy(call_str_method(soft_str(v), "isupper", CallArgs{}));
    });
    t["odd"] = no_args("odd", [](const Value& v) { return py_eq(binop("%", v, make_int(2)), make_int(1)); });
    t["even"] = no_args("even", [](const Value& v) { return py_eq(binop("%", v, make_int(2)), make_int(0)); });
    t["divisibleby"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("divisibleby", a, {"num"}, 1);
      return py_eq(binop("%", v, p[0]), make_int(0));
    };
    t["in"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("in", a, {"seq"}, 1);
      return py_contains(p[0], v);
    };
    t["sameas"] = [](Interp&, const Value& v, CallArgs& a) {
      Params p = bind("sameas", a, {"other"}, 1);
      const Value& o = p[0];
      if (v.k != o.k) return false;
      switch (v.k) {
        case VK::None: return true;
        case VK::Bool: return v.b == o.b;
        case VK::Int: return v.i == o.i && v.i >= -5 && v.i <= 256;
        case VK::List: return v.list == o.list;
        case VK::Dict:
        case VK::Namespace: return v.dict == o.dict;
        case VK::Func: return v.fn == o.fn;
        case VK::Loop: return v.loop == o.loop;
        case VK::Iter: return v.iter == o.iter;
        default: return false;
      }
    };
    auto cmp = [](const char* name, const char* op) {
      std::string n = name, o = op;
      return [n, o](Interp&, const Value& v, CallArgs& a) {
        Params p = bind(n, a, {"other"}, 1);
        return compare_op(o, v, p[0]);
      };
    };
    t["eq"] = t["equalto"] = t["=="] = cmp("eq", "==");
    t["ne"] = t["!="] = cmp("ne", "!=");
    t["lt"] = t["lessthan"] = t["<"] = cmp("lt", "<");
    t["le"] = t["<="] = cmp("le", "<=");
    t["gt"] = t["greaterthan"] = t[">"] = cmp("gt", ">");
    t["ge"] = t[">="] = cmp("ge", ">=");
    t["filter"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("filter", a, {});
      return v.k == VK::Str && filters().count(v.s) > 0;
    };
    t["test"] = [](Interp&, const Value& v, CallArgs& a) {
      bind("test", a, {});
      return v.k == VK::Str && tests().count(v.s) > 0;
    };
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------------------------------
// Globals
// ---------------------------------------------------------------------------------------

void install_globals(Scope& g) {
  g.vars["raise_exception"] = make_func("raise_exception", [](Interp&, CallArgs& a) -> Value {
    Params p = bind("raise_exception", a, {"message"}, 1);
    raise_error(EKind::Raised, py_str(p[0]));
  }, "function");
  g.vars["strftime_now"] = make_func("strftime_now", [](Interp&, CallArgs& a) -> Value {
    Params p = bind("strftime_now", a, {"format"}, 1);
    const std::string& fmt = need_str(p[0], "strftime() argument 1");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    if (fmt.empty()) return make_str("");
    std::vector<char> buf(256 + fmt.size() * 8);
    // strftime returns 0 both for "too small" and for an empty result; a marker tells them apart
    std::string f = fmt + "\x01";
    size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &tm);
    if (n == 0) raise_error(EKind::Type, "strftime result too long");
    return make_str(std::string(buf.data(), n - 1));
  }, "function");
  g.vars["namespace"] = make_func("namespace", [](Interp&, CallArgs& a) -> Value {
    Value ns = make_namespace();
    if (a.pos.size() > 1) type_error("namespace expected at most 1 positional argument");
    if (!a.pos.empty()) {
      const Value& init = a.pos[0];
      if (init.k == VK::Dict || init.k == VK::Namespace) {
        for (const auto& kv : init.dict->items) ns.dict->set(kv.first, kv.second);
      } else {
        for (const Value& pair : iterate(init)) {
          std::vector<Value> kv = iterate(pair);
          if (kv.size() != 2) raise_error(EKind::Type, "dictionary update sequence element has wrong length");
          ns.dict->set(kv[0], kv[1]);
        }
      }
    }
    for (const auto& kw : a.kw) ns.dict->set(make_str(kw.first), kw.second);
    return ns;
  }, "type");
  g.vars["dict"] = make_func("dict", [](Interp&, CallArgs& a) -> Value {
    Value d = make_dict();
    if (a.pos.size() > 1) type_error("dict expected at most 1 argument, got " + std::to_string(a.pos.size()));
    if (!a.pos.empty()) {
      const Value& init = a.pos[0];
      if (init.k == VK::Dict) {
        for (const auto& kv : init.dict->items) d.dict->set(kv.first, kv.second);
      } else {
        for (const Value& pair : iterate(init)) {
          std::vector<Value> kv = iterate(pair);
          if (kv.size() != 2) raise_error(EKind::Type, "dictionary update sequence element has wrong length");
          d.dict->set(kv[0], kv[1]);
        }
      }
    }
    for (const auto& kw : a.kw) d.dict->set(make_str(kw.first), kw.second);
    return d;
  }, "type");
  g.vars["range"] = make_func("range", [](Interp&, CallArgs& a) -> Value {
    if (!a.kw.empty()) type_error("range() takes no keyword arguments");
    if (a.pos.empty() || a.pos.size() > 3) type_error("range expected at most 3 arguments, got " + std::to_string(a.pos.size()));
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = need_int(a.pos[0], "range");
    } else {
      start = need_int(a.pos[0], "range");
      stop = need_int(a.pos[1], "range");
      if (a.pos.size() == 3) step = need_int(a.pos[2], "range");
    }
    if (step == 0) raise_error(EKind::Type, "range() arg 3 must not be zero");
    int64_t count = 0;
    if (step > 0 && start < stop) count = (stop - start - 1) / step + 1;
    if (step < 0 && start > stop) count = (start - stop - 1) / (-step) + 1;
    if (count > 100000) {
      raise_error(EKind::Type, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    std::vector<Value> out;
    out.reserve(static_cast<size_t>(count));
    for (int64_t k = 0, v = start; k < count; ++k, v += step) out.push_back(make_int(v));
    return make_range(start, stop, step, std::move(out));
  }, "type");
  g.vars["joiner"] = make_func("joiner", [](Interp&, CallArgs& a) -> Value {
    Params p = bind("joiner", a, {"sep"});
    std::string sep = p.has(0) ? soft_str(p[0]) : ", ";
    auto used = std::make_shared<bool>(false);
    return make_func("joiner", [sep, used](Interp&, CallArgs&) -> Value {
      if (!*used) {
        *used = true;
        return make_str("");
      }
      return make_str(sep);
    }, "Joiner");
  }, "type");
}

// Constant folding as Jinja2 does it at compile time: an expression without variables,
// calls or context filters (nodes.*.as_const) is computed once; anything that fails while
// folding is left to run at render time. Folding differs from running only where the
// optimizer's getitem forgives what a runtime subscript does not (slices of non-sequences).
std::optional<Value> try_const(const Expr& e) {
  try {
    Interp in;
    in.const_mode_ = true;
    return in.eval(e, std::make_shared<Scope>(nullptr));
  } catch (const Impossible&) {
  } catch (const ChatTemplateError&) {
  }
  return std::nullopt;
}

// jinja2.compiler.has_safe_repr: what the optimizer may turn into a Const node.
bool has_safe_repr(const Value& v) {
  switch (v.k) {
    case VK::None: case VK::Bool: case VK::Int: case VK::Float: case VK::Str: return true;
    case VK::List:
      if (v.list->view == "range") return true;
      if (!v.list->view.empty()) return false;
      for (const auto& x : v.list->items) {
        if (!has_safe_repr(x)) return false;
      }
      return true;
    case VK::Dict:
      for (const auto& kv : v.dict->items) {
        if (!has_safe_repr(kv.first) || !has_safe_repr(kv.second)) return false;
      }
      return true;
    default: return false;
  }
}

// jinja2.optimizer: a node whose value is known at compile time becomes that constant
// (children first, as NodeTransformer does).
void fold_expr(ExprP& e) {
  if (!e || e->k == EK::Const) return;
  for (auto& k : e->kids) fold_expr(k);
  for (auto& kv : e->kwargs) fold_expr(kv.second);
  fold_expr(e->dyn_args);
  fold_expr(e->dyn_kwargs);
  if (e->k == EK::Slice) return;  // folded as part of its subscript
  if (auto v = try_const(*e)) {
    if (has_safe_repr(*v)) {
      auto c = new_expr(EK::Const, e->line);
      c->val = *v;
      e = std::move(c);
    }
  }
}

void fold_constants(Body& body) {
  for (auto& sp : body) {
    Stmt& st = *sp;
    if (st.k == SK::Print) {
      // the code generator writes a constant {{ }} as its str(), whatever its type
      if (auto v = try_const(*st.expr)) {
        st.text = py_str(*v);
        st.k = SK::Data;
        st.expr.reset();
        continue;
      }
    }
    fold_expr(st.expr);
    fold_expr(st.cond);
    for (auto& d : st.defaults) fold_expr(d);
    for (auto& v : st.values) fold_expr(v);
    fold_constants(st.body);
    fold_constants(st.orelse);
  }
}

bool filter_known(const std::string& name) { return filters().count(name) > 0; }
bool test_known(const std::string& name) { return tests().count(name) > 0; }

}  // namespace

struct JinjaProgram {
  Body body;
  std::vector<std::string> root_undefined;
};

std::shared_ptr<const JinjaProgram> jinja_parse(const std::string& source) {
  auto prog = std::make_shared<JinjaProgram>();
  Lexer lexer(source);
  Parser parser(lexer.run());
  prog->body = parser.parse_template();
  check_names(prog->body, false);
  mark_macros(prog->body);
  prog->root_undefined = analyze_scopes(prog->body);
  fold_constants(prog->body);
  return prog;
}

std::string jinja_render(const JinjaProgram& program, const nlohmann::ordered_json& context) {
  auto globals = std::make_shared<Scope>(nullptr);
  install_globals(*globals);
  auto ctx = std::make_shared<Scope>(globals);
  if (context.is_object()) {
    for (auto it = context.begin(); it != context.end(); ++it) ctx->vars[it.key()] = from_json(it.value());
  }
  auto root = new_frame(ctx, program.root_undefined);
  Interp interp;
  std::string out;
  interp.exec(program.body, root, out);
  return out;
}

}  // namespace replica::text::detail
