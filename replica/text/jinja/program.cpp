// Jinja interpreter: constant folding as Jinja2's optimizer does it, and the entry points
// jinja_parse / jinja_render (chat_template.h). See jinja.h.
#include "replica/text/jinja/jinja.h"

namespace replica::text::detail::jinja {

namespace {

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

}  // namespace

}  // namespace replica::text::detail::jinja

namespace replica::text::detail {

struct JinjaProgram {
  jinja::Body body;
  std::vector<std::string> root_undefined;
};

std::shared_ptr<const JinjaProgram> jinja_parse(const std::string& source) {
  using namespace jinja;
  auto prog = std::make_shared<JinjaProgram>();
  prog->body = parse_template(lex_template(source));
  check_names(prog->body, false);
  mark_macros(prog->body);
  prog->root_undefined = analyze_scopes(prog->body);
  {
    // Constant folding runs template code: one budget for the whole template (what does not
    // fold within it is left to render time, where the render's budget applies).
    RenderBudget folding;
    fold_constants(prog->body);
  }
  return prog;
}

namespace {

// The size of the render's input, for its budget (Note [bounded templates]): JSON values and
// string bytes. Iterative, so any nesting is measured in bounded stack.
void measure_input(const nlohmann::ordered_json& root, uint64_t& values, uint64_t& bytes) {
  std::vector<const nlohmann::ordered_json*> todo{&root};
  while (!todo.empty()) {
    const nlohmann::ordered_json* j = todo.back();
    todo.pop_back();
    ++values;
    if (j->is_string()) {
      bytes += j->get_ref<const std::string&>().size();
    } else if (j->is_object()) {
      for (auto it = j->begin(); it != j->end(); ++it) {
        bytes += it.key().size();
        todo.push_back(&it.value());
      }
    } else if (j->is_array()) {
      for (const auto& x : *j) todo.push_back(&x);
    }
  }
}

}  // namespace

std::string jinja_render(const JinjaProgram& program, const nlohmann::ordered_json& context) {
  using namespace jinja;
  uint64_t input_values = 0, input_bytes = 0;
  measure_input(context, input_values, input_bytes);
  RenderBudget budget(input_values, input_bytes + input_values * sizeof(Value));
  Interp interp;
  try {
    auto globals = std::make_shared<Scope>(nullptr);
    install_globals(*globals);
    auto ctx = std::make_shared<Scope>(globals);
    if (context.is_object()) {
      for (auto it = context.begin(); it != context.end(); ++it) ctx->vars[it.key()] = from_json(it.value());
    }
    auto root = new_frame(ctx, program.root_undefined);
    std::string out;
    interp.exec(program.body, root, out);
    return out;
  } catch (const ChatTemplateError& e) {
    // The line where it arose, for ChatTemplate to name (the message stays Jinja2's).
    throw ChatTemplateError(e.kind(), e.what(), interp.line_);
  }
}

}  // namespace replica::text::detail
