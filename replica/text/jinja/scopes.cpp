// Jinja interpreter: compile-time scoping (jinja2/idtracking.py), runtime scopes and the
// template globals. See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>
#include <ctime>

namespace replica::text::detail::jinja {

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

namespace {

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

}  // namespace

std::vector<std::string> analyze_scopes(Body& body) {
  Symbols root;
  sym_body(body, root);
  analyze_frames(body, root);
  return root.undefined_names();
}

// ---------------------------------------------------------------------------------------
// Runtime scopes
// ---------------------------------------------------------------------------------------

ScopeP new_frame(const ScopeP& parent, const std::vector<std::string>& missing) {
  auto sc = std::make_shared<Scope>(parent);
  for (const auto& n : missing) sc->vars[n] = undefined_name(n);
  return sc;
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

}  // namespace replica::text::detail::jinja
