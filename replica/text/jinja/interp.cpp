// Jinja interpreter: the sandbox's attribute and item access, arithmetic and comparison,
// and the evaluator of expressions and statements. See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <cmath>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// Attribute and item access (the sandbox's getattr/getitem)
// ---------------------------------------------------------------------------------------

namespace {

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
  // The methods hold the loop as a Value (Note [bounded templates]: released iteratively).
  if (name == "cycle") {
    return make_func("cycle", [obj](Interp&, CallArgs& a) -> Value {
      if (a.pos.empty()) type_error("no items for cycling given");
      return a.pos[obj.loop->index % a.pos.size()];
    }, "method");
  }
  if (name == "changed") {
    return make_func("changed", [obj](Interp&, CallArgs& a) -> Value {
      LoopState* st = obj.loop.get();
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

}  // namespace

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

// ---------------------------------------------------------------------------------------
// Arithmetic
// ---------------------------------------------------------------------------------------

namespace {

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
  // Note [bounded templates]: 'x' * 10**12 is charged before anything is allocated.
  const uint64_t times = n > 0 ? static_cast<uint64_t>(n) : 0;
  if (seq.k == VK::Str) {
    charge_bytes(times, seq.s.size());
    std::string out;
    for (int64_t k = 0; k < n; ++k) out += seq.s;
    return make_str(out);
  }
  charge_items(times, seq.list->items);
  std::vector<Value> out;
  for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.list->items.begin(), seq.list->items.end());
  return make_list(std::move(out), seq.list->tuple);
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

}  // namespace

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

[[noreturn]] void int_overflow() {
  raise_error(EKind::Type, "integer overflow (chat templates use 64-bit integers)");
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

Value Interp::call(const Value& callee, CallArgs& args) {
  if (callee.k == VK::Undefined) fail_undefined(callee);
  if (callee.k != VK::Func) type_error(str_repr(type_name(callee)) + " object is not callable");
  return callee.fn->call(*this, args);
}

Value Interp::apply_filter(const std::string& name, const Value& v, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) {
    if (jinja_only_filter(name)) raise_error(EKind::Runtime, "filter " + str_repr(name) + " is not supported in chat templates");
    raise_error(EKind::Runtime, "No filter named " + str_repr(name) + " found.");
  }
  return it->second(*this, v, args);
}

bool Interp::apply_test(const std::string& name, const Value& v, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) raise_error(EKind::Runtime, "No test named " + str_repr(name) + " found.");
  return it->second(*this, v, args);
}

CallArgs Interp::eval_args(const Expr& e, size_t first, const ScopeP& sc) {
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

Value Interp::eval(const Expr& e, const ScopeP& sc) {
  RecursionGuard guard;
  charge_steps(1);
  line_ = e.line;
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

void Interp::assign(const Target& t, const Value& v, const ScopeP& sc) {
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

Value Interp::call_macro(const Stmt& m, const ScopeP& def_scope, CallArgs& a) {
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

Interp::Flow Interp::exec(const Body& body, const ScopeP& sc, std::string& out) {
  RecursionGuard guard;
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    charge_steps(1);
    line_ = s.line;
    switch (s.k) {
      case SK::Data:
        charge_bytes(s.text.size());
        out += s.text;
        break;
      case SK::Print: {
        std::string text = py_str(eval(*s.expr, sc));
        charge_bytes(text.size());
        out += text;
        break;
      }
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

Value Interp::apply_block_filter(const Expr& filter, const Value& v, const ScopeP& sc) {
  Value saved = placeholder_;
  placeholder_ = v;
  Value r = eval(filter, sc);
  placeholder_ = saved;
  return r;
}

void Interp::exec_for(const Stmt& s, const ScopeP& sc, std::string& out) {
  Value seq = eval(*s.expr, sc);
  std::vector<Value> items = iterate(seq);
  if (s.cond) {
    std::vector<Value> kept;
    for (auto& item : items) {
      charge_steps(1);
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
    charge_steps(1);  // an empty body still costs its iterations
    line_ = s.line;
    loop.loop->index = k;
    auto it = new_frame(sc, s.frame_undefined);
    assign(s.target, loop.loop->items[k], it);
    it->vars["loop"] = loop;
    if (exec(s.body, it, out) == Flow::Break) break;
  }
}

}  // namespace replica::text::detail::jinja
