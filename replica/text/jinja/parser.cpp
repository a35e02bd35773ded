// Jinja interpreter: the parser (jinja2/parser.py) and the checks Jinja2's compiler makes
// on the parsed template. See jinja.h.
#include "replica/text/jinja/jinja.h"

#include <algorithm>

namespace replica::text::detail::jinja {

// ---------------------------------------------------------------------------------------
// AST
// ---------------------------------------------------------------------------------------

ExprP new_expr(EK k, int line) {
  auto e = std::make_unique<Expr>();
  e->k = k;
  e->line = line;
  return e;
}

// ---------------------------------------------------------------------------------------
// Parser (jinja2/parser.py)
// ---------------------------------------------------------------------------------------

namespace {

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
    // Each {% elif %} is an If nested in the previous one's else: it counts as a level.
    const int saved_nesting = nesting_;
    struct Restore {
      int& n;
      int v;
      ~Restore() { n = v; }
    } restore{nesting_, saved_nesting};
    while (true) {
      node->expr = parse_tuple(false, false, nullptr, false);
      node->body = parse_statements({"elif", "else", "endif"}, false);
      const Token& t = next();
      if (t.value == "elif") {
        if (++nesting_ > kMaxNesting) {
          fail("template nested too deeply (blocks, {% elif %} branches and expressions nest at most " +
               std::to_string(kMaxNesting) + " levels)");
        }
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
    return built(std::move(e));
  }

  ExprP parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  // Note [bounded templates]: the parser's recursion is bounded here, and each expression
  // tree's height by built() (loops such as `a.b.c...` or `a + b + c...` build deep trees
  // without recursing, and everything after parsing walks the tree recursively).
  int nesting_ = 0;
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.nesting_ > kMaxNesting) {
        p.fail("template nested too deeply (blocks and expressions nest at most " +
               std::to_string(kMaxNesting) + " levels)");
      }
    }
    ~Nest() { --p.nesting_; }
  };
  // A node whose children are all attached: its height, refused past kMaxNesting.
  ExprP built(ExprP e) {
    int h = 0;
    for (const auto& k : e->kids) h = std::max(h, k ? k->height : 0);
    for (const auto& kv : e->kwargs) h = std::max(h, kv.second ? kv.second->height : 0);
    if (e->dyn_args) h = std::max(h, e->dyn_args->height);
    if (e->dyn_kwargs) h = std::max(h, e->dyn_kwargs->height);
    e->height = h + 1;
    if (e->height > kMaxNesting) {
      fail("expression nested too deeply (at most " + std::to_string(kMaxNesting) +
               " levels of operators, calls, filters, subscripts and brackets)",
           e->line);
    }
    return e;
  }

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
      expr1 = built(std::move(c));
    }
    return expr1;
  }

  ExprP binary(EK k, ExprP l, ExprP r, int line, std::string op = "") {
    auto e = new_expr(k, line);
    e->name = std::move(op);
    e->kids.push_back(std::move(l));
    e->kids.push_back(std::move(r));
    return built(std::move(e));
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
      Nest nest(*this);  // `not not not ... x`
      int line = next().line;
      auto e = new_expr(EK::Not, line);
      e->kids.push_back(parse_not());
      return built(std::move(e));
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
    return built(std::move(e));
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
    return built(std::move(e));
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
      node = built(std::move(node));
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
      return built(std::move(e));
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
      return built(std::move(e));
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
        return built(std::move(e));
      }
      if (attr.type != TT::Int) fail("expected name or number", attr.line);
      auto e = new_expr(EK::Getitem, line);
      auto c = new_expr(EK::Const, attr.line);
      c->val = make_int(attr.ival);
      next();
      e->kids.push_back(std::move(node));
      e->kids.push_back(std::move(c));
      return built(std::move(e));
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
      e->kids.push_back(built(std::move(t)));
    }
    return built(std::move(e));
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
    return built(std::move(e));
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
    return built(std::move(e));
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
      node = built(std::move(e));
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
    e = built(std::move(e));
    if (!negated) return e;
    auto n = new_expr(EK::Not, line);
    n->kids.push_back(std::move(e));
    return built(std::move(n));
  }
};

}  // namespace

Body parse_template(std::vector<Token> tokens) {
  Parser parser(std::move(tokens));
  return parser.parse_template();
}

// Unknown filters and tests: Jinja2's compiler rejects them, except in a "soft" frame (the
// test and branches of an {% if %}, an inline if), where the error waits until the filter
// runs. Loops, macros, with and set/filter blocks open frames that are not soft.
bool jinja_only_filter(const std::string& name) {
  static const std::unordered_set<std::string> names = {
      "filesizeformat", "forceescape", "groupby", "pprint", "random", "slice", "striptags",
      "urlencode", "urlize", "wordwrap", "xmlattr"};
  return names.count(name) > 0;
}

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

void mark_macros(Body& body) {
  for (auto& s : body) {
    if (s->k == SK::Macro) scan_names(s->body, s->uses_varargs, s->uses_kwargs);
    mark_macros(s->body);
    mark_macros(s->orelse);
  }
}

}  // namespace replica::text::detail::jinja
