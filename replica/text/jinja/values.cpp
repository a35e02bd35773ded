// Jinja interpreter: values with Python semantics (str(), repr(), truthiness, equality,
// ordering), JSON in and out, iteration and slicing, argument binding. See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <cmath>

namespace replica::text::detail::jinja {

[[noreturn]] void raise_error(EKind kind, const std::string& message) {
  throw ChatTemplateError(kind, message);
}
[[noreturn]] void type_error(const std::string& message) { raise_error(EKind::Type, message); }

// ---------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------

bool Value::is_tuple() const { return k == VK::List && list->tuple && list->view.empty(); }

// A list or a tuple (not a range or a dict view).
bool is_seq(const Value& v) { return v.k == VK::List && v.list->view.empty(); }
bool is_plain_list(const Value& v) { return is_seq(v) && !v.list->tuple; }

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
  charge_bytes(s.size());  // Note [bounded templates]
  Value v;
  v.k = VK::Str;
  v.s = std::move(s);
  return v;
}
Value make_list(std::vector<Value> items, bool tuple) {
  charge_items(1, items);  // Note [bounded templates]
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
                std::string type_name) {
  Value v;
  v.k = VK::Func;
  v.fn = std::make_shared<Function>();
  v.fn->name = std::move(name);
  v.fn->type_name = std::move(type_name);
  v.fn->call = std::move(call);
  return v;
}
Value make_undefined(std::string message, EKind kind) {
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

namespace {

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

}  // namespace

std::string py_repr(const Value& v) {
  switch (v.k) {
    case VK::Str: return str_repr(v.s);
    case VK::Undefined: return "Undefined";
    default: return py_str(v);
  }
}

std::string py_str(const Value& v) {
  RecursionGuard guard;  // lists and dicts print their items
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
  RecursionGuard guard;
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
  RecursionGuard guard;
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
  RecursionGuard guard;
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

template Value from_json(const nlohmann::ordered_json& j);

namespace {

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

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return float_repr(f);
}

}  // namespace

void json_dump(std::string& out, const Value& v, const JsonOptions& o, int level) {
  RecursionGuard guard;
  auto newline = [&](int lvl) {
    charge_bytes(static_cast<uint64_t>(lvl), o.indent->size());  // a huge indent, many lines
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
// Evaluation helpers
// ---------------------------------------------------------------------------------------

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

Cursor cursor_of(const Value& v) {
  Cursor c;
  if (v.k == VK::Iter) {
    c.it = v;
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

Params bind(const std::string& fname, const CallArgs& a, std::vector<const char*> names,
            size_t required) {
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

}  // namespace replica::text::detail::jinja
