// Jinja interpreter: the filters (jinja2/filters.py; tojson as transformers defines it)
// and tests (jinja2/tests.py). See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// Filters (jinja2/filters.py; tojson as transformers defines it)
// ---------------------------------------------------------------------------------------

std::string soft_str(const Value& v) { return py_str(v); }

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

namespace {

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
  std::string indention;
  if (width.k == VK::Str) {
    indention = width.s;
  } else {
    const int64_t n = std::max<int64_t>(0, need_int(width, "width"));
    charge_bytes(static_cast<uint64_t>(n));  // Note [bounded templates]
    indention.assign(static_cast<size_t>(n), ' ');
  }
  std::string s = s_in + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  charge_bytes(lines.size() + 1, indention.size());
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

}  // namespace

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
          if (n > static_cast<int64_t>(st->tmp.size())) charge_steps(static_cast<uint64_t>(n) - st->tmp.size());
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
        if (!first) {
          charge_bytes(sep.size());  // a long separator between many items
          out += sep;
        }
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
          int64_t n = std::max<int64_t>(0, need_int(p[1], "indent"));
          charge_bytes(static_cast<uint64_t>(n));  // Note [bounded templates]
          o.indent = std::string(static_cast<size_t>(n), ' ');
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

bool filter_known(const std::string& name) { return filters().count(name) > 0; }
bool test_known(const std::string& name) { return tests().count(name) > 0; }

}  // namespace replica::text::detail::jinja
