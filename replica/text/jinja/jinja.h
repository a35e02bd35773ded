// Internals of the chat-template engine: a Jinja2-subset interpreter with Python semantics.
//
// What: the Jinja2 that Hugging Face chat templates are written for, as transformers
// configures it: ImmutableSandboxedEnvironment, trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False, the loopcontrols extension ({% break %}, {% continue %}),
// transformers' {% generation %} tag (rendered as its body), the globals raise_exception
// and strftime_now, and transformers' tojson filter (json.dumps with ensure_ascii=False by
// default). Structure follows jinja2/lexer.py, jinja2/parser.py, jinja2/idtracking.py and
// jinja2's optimizer closely (same precedence, same whitespace rules, same error texts
// where it matters); the evaluator follows the generated Python code's semantics: Python
// truthiness, str()/repr(), float formatting, integer/float arithmetic, Undefined.
//
// Why hand-written: the existing C++ Jinja engines (minja, inja) do not give byte for byte
// the output of Python's jinja2 on the chat templates we test: whitespace control
// (trim_blocks/lstrip_blocks, `-`/`+` markers, raw blocks), loop and namespace() scoping,
// Python's string methods and jinja2's filters as HF templates use them (str.format, %
// formatting, split/strip/title, tojson's json.dumps spacing, float repr), the error
// messages templates raise or trigger (raise_exception, UndefinedError, TypeError texts),
// and jinja2 3.1.5+'s branch-set rules for names assigned in {% if %} branches. The
// conformance tests (replica/text/tests/chat_template_conformance_test.cpp) render every
// template and snippet with Python's jinja2 3.1.6 and require byte equality.
//
// Map (all in replica/text/jinja/, namespace replica::text::detail::jinja):
//   python_text.cpp  UTF-8 (surrogateescape), Python's character classes, case mapping,
//                    float repr and str repr
//   values.cpp       Value and its objects (list/tuple/range/dict views, dict, namespace,
//                    loop, functions, generators, Undefined); str(), repr(), truthiness,
//                    equality, ordering; JSON in (nlohmann) and out (json.dumps);
//                    iteration, `in`, len(), slices; argument binding for builtins
//   lexer.cpp        tokens (jinja2/lexer.py with trim_blocks and lstrip_blocks)
//   parser.cpp       the AST's parser (jinja2/parser.py), the compile-time checks of
//                    filter and test names, macros' use of varargs/kwargs
//   scopes.cpp       compile-time scoping (jinja2/idtracking.py), runtime scopes, globals
//   strings.cpp      Python's str methods, str.format, printf-style % formatting
//   interp.cpp       the sandbox's getattr/getitem, arithmetic and comparison, the
//                    interpreter (expressions and statements, macros, loops)
//   filters.cpp      filters (jinja2/filters.py) and tests (jinja2/tests.py)
//   program.cpp      constant folding (jinja2's optimizer) and the entry points
//                    jinja_parse / jinja_render declared in chat_template.h
#pragma once

#include "replica/text/chat_template.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace replica::text::detail::jinja {

using EKind = ChatTemplateError::Kind;

[[noreturn]] void raise_error(EKind kind, const std::string& message);
[[noreturn]] void type_error(const std::string& message);

// ---- Limits (jinja/limits.cpp) ----
//
// Note [bounded templates]
// A chat template comes with a model (from whoever published it) and a conversation from a
// data set: neither is trusted. Python's Jinja2 stops runaway recursion with RecursionError
// and nothing else; replica must never overflow the stack, run for hours or exhaust memory,
// so every template is held to these bounds, each a ChatTemplateError (named with the
// template's source and line by ChatTemplate):
//  - parsing: blocks and expressions nest at most kMaxNesting deep, counting both the
//    parser's recursion and the height of each expression tree, which is checked as each
//    node is built (an iterative loop like `x.a.a.a...` or `a+a+a...` builds a deep tree
//    without recursing), so every walk over the parsed template is bounded too;
//  - recursion at render time: every recursive walk (evaluating expressions and statements,
//    macro calls, str()/repr()/tojson/== of values, JSON input, a generator pulling from a
//    generator) holds a RecursionGuard: at most kMaxRecursion nested per thread;
//  - destruction: a value never frees its contents recursively (Value's destructor hands the
//    last reference to a container to an iterative release loop), so a list nested a
//    million deep by a loop is freed in constant stack;
//  - work: a render has a budget of steps (nodes evaluated, statements run, loop iterations,
//    items materialised, generator pulls) and of bytes (strings built, output written), so a
//    loop over range(10**5) inside another ends in an error instead of running for hours;
//    sizes that multiply (str * n, list * n, padding widths, long separators and
//    replacements) are charged before anything is allocated. Every real chat template is far
//    inside the budget: see RenderBudget.

// Parser recursion and expression-tree height (Python's parser gives up around the same).
inline constexpr int kMaxNesting = 200;
// Nested evaluation and value walks at render time (each frame < ~1 KB of stack).
inline constexpr int kMaxRecursion = 2000;

// Holds one level of a recursive walk; a Runtime error past kMaxRecursion.
class RecursionGuard {
 public:
  RecursionGuard();
  ~RecursionGuard();
  RecursionGuard(const RecursionGuard&) = delete;
  RecursionGuard& operator=(const RecursionGuard&) = delete;
};

// The work allowed for one render (or for the constant folding of one parse). Installed for
// the current thread while it lives; charges made with none installed are not counted.
class RenderBudget {
 public:
  // What real templates use: the fixtures' chats (chat_templates/expected.json) at most
  // ~1,200 steps and 12 KB; Qwen3's template over a 2,000-message conversation (2 MB)
  // ~10**5 steps and 9 MB. The budget: 2*10**6 steps and 128 MiB, plus an allowance for the
  // input (input_values JSON values, input_bytes of strings and values in it), so a bigger
  // conversation gets a proportionally bigger budget.
  static constexpr uint64_t kBaseSteps = 2'000'000;
  static constexpr uint64_t kStepsPerInputValue = 100;
  static constexpr uint64_t kBaseBytes = uint64_t{128} << 20;
  static constexpr uint64_t kBytesPerInputByte = 32;
  RenderBudget(uint64_t input_values = 0, uint64_t input_bytes = 0);
  ~RenderBudget();
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;
  uint64_t steps_used() const { return steps_limit_ - steps_left_; }
  uint64_t bytes_used() const { return bytes_limit_ - bytes_left_; }

 private:
  friend void charge_steps(uint64_t n);
  friend void charge_bytes(uint64_t n);
  uint64_t steps_limit_, steps_left_, bytes_limit_, bytes_left_;
  RenderBudget* outer_;
};

// Counts n steps / bytes against the installed budget; a Runtime error when it is spent.
void charge_steps(uint64_t n);
void charge_bytes(uint64_t n);
// charge_bytes(count * each) without overflowing: for sizes that multiply.
void charge_bytes(uint64_t count, uint64_t each);
struct Value;
// `times` copies of `items` into a list: steps per item, bytes per item and per string.
void charge_items(uint64_t times, const std::vector<Value>& items);

// ---- UTF-8, Python's character classes, number formatting (jinja/python_text.cpp) ----

// Invalid bytes decode to U+DC80..U+DCFF (Python's surrogateescape) and encode back to the
// same byte, so any byte string survives a decode/encode round trip.
void append_utf8(std::string& out, char32_t c);
std::u32string decode_utf8(const std::string& s);
std::string encode_utf8(const char32_t* b, const char32_t* e);
std::string encode_utf8(const std::u32string& s);
bool is_ascii(const std::string& s);
bool py_isspace(char32_t c);  // Python's str.isspace() (also what `\s` matches)
char32_t to_lower_cp(char32_t c);
char32_t to_upper_cp(char32_t c);
bool is_alpha_cp(char32_t c);
bool is_digit_cp(char32_t c);
bool is_alnum_cp(char32_t c);
bool is_lower_cp(char32_t c);
bool is_upper_cp(char32_t c);
std::string lower_str(const std::string& s);  // str.lower()
std::string upper_str(const std::string& s);  // str.upper()
size_t py_len(const std::string& s);          // len(str): code points
std::string hex_escape(const char* prefix, uint32_t v, int width);
std::string float_repr(double v);             // repr(float)
std::string str_repr(const std::string& s);   // repr(str)

// ---- Values (jinja/values.cpp) ----

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
  Value() = default;
  Value(const Value&) = default;
  Value(Value&&) noexcept = default;
  Value& operator=(const Value&) = default;
  Value& operator=(Value&&) noexcept = default;
  // Note [bounded templates]: the last reference to a container is released iteratively.
  ~Value() {
    if (list || dict || fn || loop || iter) release_contents();
  }

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

 private:
  void release_contents() noexcept;
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
    RecursionGuard guard;  // a generator over a generator over ...
    charge_steps(1);
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

bool is_seq(const Value& v);  // a list or a tuple (not a range or a dict view)
bool is_plain_list(const Value& v);

Value make_none();
Value make_bool(bool b);
Value make_int(int64_t i);
Value make_float(double f);
Value make_str(std::string s);
Value make_list(std::vector<Value> items, bool tuple = false);
Value make_view(const char* view, std::vector<Value> items);
Value make_range(int64_t start, int64_t stop, int64_t step, std::vector<Value> items);
Value make_iter(std::string type_name, std::string func, std::function<std::optional<Value>()> next);
Value make_dict();
Value make_namespace();
Value make_func(std::string name, std::function<Value(Interp&, CallArgs&)> call,
                std::string type_name = "builtin_function_or_method");
Value make_undefined(std::string message, EKind kind = EKind::Undefined);

std::string type_name(const Value& v);         // type(v).__name__
std::string object_type_repr(const Value& v);  // jinja2.utils.object_type_repr
[[noreturn]] void fail_undefined(const Value& v);
Value undefined_name(const std::string& name);
Value undefined_attr(const Value& obj, const std::string& name);
Value undefined_elem(const Value& obj, const Value& key);
Value unsafe_undefined(const Value& obj, const std::string& name);

std::string py_repr(const Value& v);
std::string py_str(const Value& v);
bool truthy(const Value& v);
// Three-way comparison for <, <=, >, >=; nullopt when unordered (NaN). TypeError like Python
// when the types do not compare.
std::optional<int> py_compare(const Value& a, const Value& b, const char* op);
bool py_less(const Value& a, const Value& b);

// JSON in; instantiated in jinja/values.cpp for nlohmann::ordered_json (the render context).
template <typename Json>
Value from_json(const Json& j);
extern template Value from_json(const nlohmann::ordered_json& j);

// JSON out: Python's json.dumps.
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None: one line
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

void json_dump(std::string& out, const Value& v, const JsonOptions& o, int level);

Value char_value(char32_t c);
// iter(v) as a list; TypeError like Python for what is not iterable.
std::vector<Value> iterate(const Value& v);

// iter(v), consumed one item at a time (generators stay lazy).
struct Cursor {
  std::vector<Value> items;
  size_t pos = 0;
  Value it;  // the generator (a Value, so that it is released iteratively), or Undefined
  std::optional<Value> next() {
    if (it.iter) return it.iter->pull();
    if (pos < items.size()) return items[pos++];
    return std::nullopt;
  }
};
Cursor cursor_of(const Value& v);
bool is_iterable(const Value& v);
[[noreturn]] void unhashable(const Value& v);
bool is_unhashable(const Value& v);
int64_t length_of(const Value& v);
bool py_contains(const Value& container, const Value& item);

// Python slice index normalisation (PySlice_AdjustIndices).
struct SliceIdx {
  int64_t start, stop, step, count;
};
SliceIdx adjust_slice(int64_t len, std::optional<int64_t> start, std::optional<int64_t> stop,
                      std::optional<int64_t> step);

// Argument binding for builtins: Python's binding of positional and keyword arguments to
// `names`, the first `required` of them mandatory.
struct Params {
  std::vector<Value> v;
  std::vector<bool> given;
  const Value& operator[](size_t k) const { return v[k]; }
  bool has(size_t k) const { return given[k]; }
};

Params bind(const std::string& fname, const CallArgs& a, std::vector<const char*> names,
            size_t required = 0);
const std::string& need_str(const Value& v, const std::string& what);
int64_t need_int(const Value& v, const std::string& what);

// ---- Lexer (jinja/lexer.cpp) ----

enum class TT : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  TT type = TT::Eof;
  std::string value;  // data text, name, string value, operator
  int64_t ival = 0;
  double fval = 0.0;
  int line = 1;
};

[[noreturn]] void syntax_error(const std::string& message, int line);
bool is_dig(char c);
int hex_val(char c);
// The template's tokens (jinja2's lexer with trim_blocks and lstrip_blocks), ending in Eof.
std::vector<Token> lex_template(const std::string& source);

// ---- AST and parser (jinja/parser.cpp) ----

enum class EK : uint8_t {
  Const, Name, Getattr, Getitem, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Bin,
  Compare, Concat, Cond, List, Tuple, Dict, Placeholder
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  EK k = EK::Const;
  int line = 0;
  int height = 1;            // of the tree below and including this node (<= kMaxNesting)
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

ExprP new_expr(EK k, int line);
// The template's statements (jinja2/parser.py); ChatTemplateError(Kind::Syntax) when it
// does not parse.
Body parse_template(std::vector<Token> tokens);
// Filters of jinja2 that chat templates do not get (an error naming them as unsupported).
bool jinja_only_filter(const std::string& name);
// Unknown filters and tests: rejected at compile time except in a "soft" frame.
void check_names(const Body& body, bool soft);
// Records on each macro whether its body reads `varargs` / `kwargs`.
void mark_macros(Body& body);

// ---- Scopes and environment (jinja/scopes.cpp) ----

// Compile-time scoping (jinja2/idtracking.py): fills each frame's `frame_undefined` and
// returns the template frame's own "missing" names.
std::vector<std::string> analyze_scopes(Body& body);

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

// A frame whose `missing` names read as undefined until assigned.
ScopeP new_frame(const ScopeP& parent, const std::vector<std::string>& missing);
// raise_exception, strftime_now, namespace, dict, range, joiner.
void install_globals(Scope& g);

// ---- Python string methods (jinja/strings.cpp) ----

std::string py_strip(const std::string& s, const Value* chars_arg, bool left, bool right);
std::vector<std::string> py_split_sep(const std::string& s, const std::string& sep,
                                      int64_t maxsplit, bool from_right);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count);
std::string py_capitalize(const std::string& s);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends);
std::string py_center(const std::string& s, int64_t width, char32_t fill);
// printf-style `fmt % args`.
std::string py_percent_format(const std::string& fmt, const Value& args);
const std::unordered_set<std::string>& python_str_methods();
Value call_str_method(const std::string& self, const std::string& name, const CallArgs& a);

// ---- Filters and tests (jinja/filters.cpp) ----

using FilterFn = std::function<Value(Interp&, const Value&, CallArgs&)>;
using TestFn = std::function<bool(Interp&, const Value&, CallArgs&)>;
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();
// Filters and tests are looked up when the template is parsed, as Jinja2's compiler does.
bool filter_known(const std::string& name);
bool test_known(const std::string& name);
std::string html_escape(const std::string& s);
std::string soft_str(const Value& v);

// ---- Interpreter (jinja/interp.cpp) ----

// The sandbox's getattr/getitem. python_attr: Python's getattr(obj, name) where the object
// has such an attribute; nullopt when not.
std::optional<Value> python_attr(const Value& obj, const std::string& name);
Value getattr_value(const Value& obj, const std::string& name);
Value getitem_value(const Value& obj, const Value& key);

Value make_markup(std::string s);
// markupsafe.escape(): Markup stays as it is, anything else is str()'d and escaped.
Value markup_escape(const Value& v);
[[noreturn]] void int_overflow();
Value binop(const std::string& op, const Value& a, const Value& b);
bool compare_op(const std::string& op, const Value& a, const Value& b);

// Thrown while folding constants: the expression cannot be computed at compile time.
struct Impossible {};

// Evaluates expressions and runs statements: one per render, and one per folded constant.
class Interp {
 public:
  enum class Flow { Normal, Break, Continue };

  // Jinja2's optimizer (nodes.*.as_const): no variables, no calls, no context filters, and
  // the sandbox's forgiving getitem for slices too.
  bool const_mode_ = false;

  Value call(const Value& callee, CallArgs& args);
  Value apply_filter(const std::string& name, const Value& v, CallArgs& args);
  bool apply_test(const std::string& name, const Value& v, CallArgs& args);
  CallArgs eval_args(const Expr& e, size_t first, const ScopeP& sc);
  Value eval(const Expr& e, const ScopeP& sc);
  void assign(const Target& t, const Value& v, const ScopeP& sc);
  Value call_macro(const Stmt& m, const ScopeP& def_scope, CallArgs& a);
  Flow exec(const Body& body, const ScopeP& sc, std::string& out);

  static constexpr int kMaxMacroDepth = 100;
  int macro_depth_ = 0;
  // The template line of the statement or expression evaluated last: where an error arose.
  int line_ = 0;

  Value apply_block_filter(const Expr& filter, const Value& v, const ScopeP& sc);
  void exec_for(const Stmt& s, const ScopeP& sc, std::string& out);

 private:
  Value placeholder_;
};

}  // namespace replica::text::detail::jinja
