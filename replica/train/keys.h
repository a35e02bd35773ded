// The key tables' machinery: how one `params:` key is declared once and read, checked,
// written, compared and explained from that one declaration.
//
//   key("lora_r", &LlmParams::lora_r, "LoRA rank").at_least(1)
//
// binds the name to its field (in RunParams, the keys every task has, or in a task's own params
// struct, held by RunConfig::task_params); the field's C++ type picks how a value is read from YAML or a
// flag (Codec below: integers, numbers, true/false, text, lists, the enumerations of
// run_config.h), and the modifiers add aliases, checks and help. Messages follow one form:
// "FILE:LINE: key 'params.lora_r' must be >= 1, got 0".
#pragma once

#include "replica/core/error.h"
#include "replica/core/text.h"
#include "replica/train/run_config.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace replica::train {

// Where each key was written (FILE:LINE, or the flag that set it), so that messages name it.
class KeyLocation {
 public:
  KeyLocation(std::string source, bool has_lines) : source_(std::move(source)), has_lines_(has_lines) {}
  void note(const std::string& key, const YAML::Node& key_node) {
    if (has_lines_ && !key_node.Mark().is_null()) origins_[key] = fmt::format("{}:{}: ", source_, key_node.Mark().line + 1);
    given_.insert(key);
  }
  // A key the file wrote under another name (hub.username for params.username): messages name it so.
  void note_as(const std::string& key, const YAML::Node& key_node, const std::string& written) {
    note(key, key_node);
    written_[key] = written;
  }
  // The key as the file or the flags wrote it ("params.lr", "hub.username", "--lr").
  std::string name(const std::string& key) const {
    auto it = written_.find(key);
    return it == written_.end() ? key : it->second;
  }
  // Whether the file or a flag gave the key (a config built in code gives none).
  bool given(const std::string& key) const { return given_.count(key) > 0; }
  // A key set by a flag after the file was read: "--max-steps: " in messages.
  void note_flag(const std::string& key, const std::string& flag) {
    origins_[key] = flag + ": ";
    given_.insert(key);
  }
  bool has(const std::string& key) const { return origins_.count(key) > 0; }
  // "FILE:LINE: " where the key was written, "--flag: ", "FILE: " or "" (a config built in code).
  std::string where(const std::string& key) const {
    auto it = origins_.find(key);
    if (it != origins_.end()) return it->second;
    return source_.empty() ? "" : source_ + ": ";
  }
  std::string at(const YAML::Node& node) const {
    if (!has_lines_ || node.Mark().is_null()) return source_.empty() ? "" : source_ + ": ";
    return fmt::format("{}:{}: ", source_, node.Mark().line + 1);
  }

 private:
  std::string source_;
  bool has_lines_;
  std::map<std::string, std::string> origins_;
  std::map<std::string, std::string> written_;
  std::set<std::string> given_;
};

// One `params:` key. Every function is set by the builder; `key` in messages is "params.NAME".
struct KeySpec {
  std::string name;                   // as YAML writes it; the flag is --name-with-hyphens
  std::string kind;                   // what a value is: "an integer", "one of sgd, adamw", ...
  std::string value_hint;             // --help's placeholder: N, X, TEXT, sgd|adamw ("" for a switch)
  std::string help;
  std::string group;                  // --help's heading
  bool is_switch = false;             // true/false: a bare flag means true
  bool secret = false;                // read, never written (token)
  std::vector<std::string> known_as;  // other tools' names for it (learning_rate): "did you mean" only
  std::vector<std::string> synonyms;  // other names it is read by (save_steps for checkpoint_every)
  // Why the key, given, does nothing in this run ("for trainer sft: only dpo reads it"); "" when
  // it does something. A key given that does nothing is accepted with a note saying so.
  std::function<std::string(const RunConfig&)> unused;
  std::function<void(RunConfig&, const YAML::Node& value, const std::string& key, const KeyLocation&)> read;
  std::function<void(const RunConfig&, const std::string& key, const KeyLocation&)> check;
  std::function<void(YAML::Emitter&, const RunConfig&)> write;
  std::function<nlohmann::json(const RunConfig&)> json;
  std::function<bool(const RunConfig&)> in_json;  // training_params.json holds it (default: always)
  std::function<std::string(const RunConfig&)> text;  // the value as --help shows a default
  std::function<bool(const RunConfig&, const RunConfig&)> same;
};

// "a mapping", "a list", "null" or the scalar quoted, for "got ..." in messages.
std::string describe(const YAML::Node& node);

// Writes text so that it reads back as the same text: as yaml-cpp's emitter chooses, unless that
// form reads back as something else (its plain style takes some leading line breaks and
// brackets), then double-quoted.
void write_text(YAML::Emitter& e, const std::string& text);

// Shortest text that reads back as the same double and that YAML 1.1 readers (PyYAML) also
// take for a float: they need a '.' in the mantissa.
std::string float_text(double value);

std::optional<int64_t> parse_int(const std::string& text);
std::optional<double> parse_float(const std::string& text);
std::optional<bool> parse_bool(std::string text);  // true/false/yes/no/on/off, any case

// "a, b, c" for messages, "a|b|c" for --help, "a,b" for target_modules: `names` (strings or
// C strings) joined with `separator`.
template <class Names>
std::string join_names(const Names& names, const char* separator) {
  std::string out;
  for (const auto& n : names) {
    if (!out.empty()) out += separator;
    out += n;
  }
  return out;
}

// ---- Codec<T>: reading a YAML value into a field of type T, and writing it back.
// read() returns false for a value that is not of the kind, setting `culprit` to the node at
// fault (an item of a list) when it is not the value itself.

template <class T, class Enable = void>
struct Codec;

template <class T>
struct Codec<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static constexpr const char* kind = "an integer";
  static constexpr const char* hint = "N";
  static bool read(const YAML::Node& n, T& out, YAML::Node& culprit) {
    auto v = n.IsScalar() ? parse_int(n.Scalar()) : std::nullopt;
    if (!v || *v < std::numeric_limits<T>::min() || *v > std::numeric_limits<T>::max()) return false;
    out = static_cast<T>(*v);
    return true;
  }
  static void write(YAML::Emitter& e, T v) { e << static_cast<long long>(v); }
  static nlohmann::json json(T v) { return v; }
  static std::string text(T v) { return std::to_string(v); }
};

template <>
struct Codec<double> {
  static constexpr const char* kind = "a number";
  static constexpr const char* hint = "X";
  static bool read(const YAML::Node& n, double& out, YAML::Node& culprit) {
    auto v = n.IsScalar() ? parse_float(n.Scalar()) : std::nullopt;
    if (!v) return false;
    out = *v;
    return true;
  }
  static void write(YAML::Emitter& e, double v) { e << float_text(v); }
  static nlohmann::json json(double v) { return v; }
  static std::string text(double v) { return fmt::format("{}", v); }
};

template <>
struct Codec<bool> {
  static constexpr const char* kind = "true or false";
  static constexpr const char* hint = "";
  static bool read(const YAML::Node& n, bool& out, YAML::Node& culprit) {
    auto v = n.IsScalar() ? parse_bool(n.Scalar()) : std::nullopt;
    if (!v) return false;
    out = *v;
    return true;
  }
  static void write(YAML::Emitter& e, bool v) { e << (v ? "true" : "false"); }
  static nlohmann::json json(bool v) { return v; }
  static std::string text(bool v) { return v ? "true" : "false"; }
};

template <>
struct Codec<std::string> {
  static constexpr const char* kind = "a string";
  static constexpr const char* hint = "TEXT";
  static bool read(const YAML::Node& n, std::string& out, YAML::Node& culprit) {
    if (!n.IsScalar()) return false;
    out = n.Scalar();
    return true;
  }
  static void write(YAML::Emitter& e, const std::string& v) { write_text(e, v); }
  static nlohmann::json json(const std::string& v) { return v; }
  static std::string text(const std::string& v) { return v.empty() ? "none" : v; }
};

// hidden_sizes: a YAML list of positive integers.
template <>
struct Codec<std::vector<int64_t>> {
  static constexpr const char* kind = "a list of positive integers";
  static constexpr const char* hint = "N,N,...";
  static bool read(const YAML::Node& n, std::vector<int64_t>& out, YAML::Node& culprit) {
    // A flag may give the list as 256,128 (a YAML scalar): split at the commas, each piece an
    // integer (not parsed again as YAML, whose errors would name neither the file nor the key).
    if (n.IsScalar() && n.Scalar().find(',') != std::string::npos) {
      std::vector<int64_t> values;
      const std::string& text = n.Scalar();
      for (std::size_t from = 0;;) {
        const std::size_t comma = text.find(',', from);
        std::string piece = text.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
        piece.erase(0, piece.find_first_not_of(" \t"));
        piece.erase(piece.find_last_not_of(" \t") + 1);
        const auto v = parse_int(piece);
        if (!v || *v < 1) return false;
        values.push_back(*v);
        if (comma == std::string::npos) break;
        from = comma + 1;
      }
      out = std::move(values);
      return true;
    }
    if (!n.IsSequence()) return false;
    std::vector<int64_t> values;
    for (const auto& item : n) {
      auto v = item.IsScalar() ? parse_int(item.Scalar()) : std::nullopt;
      if (!v || *v < 1) {
        culprit.reset(item);  // rebinds (operator= would overwrite the node it refers to)
        return false;
      }
      values.push_back(*v);
    }
    out = std::move(values);
    return true;
  }
  static void write(YAML::Emitter& e, const std::vector<int64_t>& v) {
    e << YAML::Flow << YAML::BeginSeq;
    for (int64_t x : v) e << static_cast<long long>(x);
    e << YAML::EndSeq;
  }
  static nlohmann::json json(const std::vector<int64_t>& v) { return v; }
  static std::string text(const std::vector<int64_t>& v) {
    std::string out;
    for (int64_t x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
    return out.empty() ? "[]" : out;
  }
};

// target_modules: PEFT's list, or AutoTrain's comma-separated text; written in AutoTrain's form.
template <>
struct Codec<std::vector<std::string>> {
  static constexpr const char* kind = "a list of names or a comma-separated string";
  static constexpr const char* hint = "A,B,...";
  static bool read(const YAML::Node& n, std::vector<std::string>& out, YAML::Node& culprit);
  static std::string joined(const std::vector<std::string>& v) { return join_names(v, ","); }
  static void write(YAML::Emitter& e, const std::vector<std::string>& v) { write_text(e, joined(v)); }
  static nlohmann::json json(const std::vector<std::string>& v) { return joined(v); }
  static std::string text(const std::vector<std::string>& v) { return joined(v); }
};

// shard_optimizer: true, false or auto (null): auto is decided by the trainer.
template <>
struct Codec<std::optional<bool>> {
  static constexpr const char* kind = "true, false or 'auto'";
  static constexpr const char* hint = "true|false|auto";
  static bool read(const YAML::Node& n, std::optional<bool>& out, YAML::Node& culprit) {
    if (n.IsNull() || (n.IsScalar() && n.Scalar() == "auto")) {
      out.reset();
      return true;
    }
    auto v = n.IsScalar() ? parse_bool(n.Scalar()) : std::nullopt;
    if (!v) return false;
    out = *v;
    return true;
  }
  static void write(YAML::Emitter& e, const std::optional<bool>& v) {
    if (v) {
      e << *v;
    } else {
      e << "auto";
    }
  }
  static nlohmann::json json(const std::optional<bool>& v) { return v ? nlohmann::json(*v) : nlohmann::json("auto"); }
  static std::string text(const std::optional<bool>& v) { return v ? (*v ? "true" : "false") : "auto"; }
};

// The enumerations of run_config.h, by their names.
template <class E>
struct Codec<E, std::enable_if_t<std::is_enum_v<E>>> {
  static std::string names() { return join_names(EnumNames<E>::names, ", "); }
  static std::string hint_text() { return join_names(EnumNames<E>::names, "|"); }
  static bool read(const YAML::Node& n, E& out, YAML::Node& culprit) {
    auto v = n.IsScalar() ? enum_from<E>(n.Scalar()) : std::nullopt;
    if (!v) return false;
    out = *v;
    return true;
  }
  static void write(YAML::Emitter& e, E v) { e << name_of(v); }
  static nlohmann::json json(E v) { return name_of(v); }
  static std::string text(E v) { return name_of(v); }
};

// ---- The builder.

// The section a key's field lives in: the common RunParams, or the task's own struct.
template <class Section>
Section& section_of(RunConfig& c) {
  if constexpr (std::is_same_v<Section, RunParams>) {
    return c.params;
  } else {
    return c.task_params.get<Section>();
  }
}
template <class Section>
const Section& section_of(const RunConfig& c) {
  if constexpr (std::is_same_v<Section, RunParams>) {
    return c.params;
  } else {
    return c.task_params.get<Section>();
  }
}

template <class Section, class T>
class Key {
 public:
  using Check = std::function<std::string(const T&)>;  // "" when fine, else "must be ..., got ..."

  Key(const char* name, T Section::*member, const char* help) : name_(name), member_(member), help_(help) {
    if constexpr (std::is_enum_v<T>) {
      kind_ = "one of " + Codec<T>::names();
      hint_ = Codec<T>::hint_text();
      enumeration_ = true;
    } else {
      kind_ = Codec<T>::kind;
      hint_ = Codec<T>::hint;
    }
  }

  Key& group(const char* heading) { group_ = heading; return *this; }
  // Text read as `value` (deepspeed -> zero3, adamw_torch -> adamw, default -> sft).
  Key& alias(const std::string& text, T value) { aliases_.emplace_back(text, std::move(value)); return *this; }
  // YAML null reads as `value` (AutoTrain's null for "none" or "the default").
  Key& null_is(T value) { null_ = std::move(value); return *this; }
  // A word read as `value` and written for it (nproc_per_node: auto = 0).
  Key& keyword(const std::string& text, T value) {
    keyword_ = std::make_pair(text, std::move(value));
    hint_ += "|" + text;
    return *this;
  }
  // --help's placeholder for a value from a short list of numbers (zero_stage: 0|1|2|3).
  Key& hint(std::string text) { hint_ = std::move(text); return *this; }
  // The allowed values as messages list them (distributed_backend lists its aliases too).
  Key& shown(const std::string& allowed) { kind_ = "one of " + allowed; return *this; }
  // A text key that takes only these values.
  Key& one_of(std::vector<std::string> allowed) {
    kind_ = "one of " + join_names(allowed, ", ");
    hint_ = join_names(allowed, "|");
    allowed_ = std::move(allowed);
    enumeration_ = true;
    return *this;
  }
  // The value is of the kind only when `valid` holds (nproc_per_node's positive integers).
  Key& valid_if(std::function<bool(const T&)> valid, std::string kind) {
    valid_ = std::move(valid);
    kind_ = std::move(kind);
    return *this;
  }
  Key& check(Check c) { checks_.push_back(std::move(c)); return *this; }
  Key& at_least(T min) {
    return check([min](const T& v) { return v < min ? fmt::format("must be >= {}, got {}", min, v) : std::string(); });
  }
  Key& positive() {
    return check([](const T& v) { return !(v > 0) ? fmt::format("must be > 0, got {}", v) : std::string(); });
  }
  // A fraction: in [0, 1).
  Key& fraction() {
    return check([](const T& v) { return v < 0 || v >= 1 ? fmt::format("must be in [0, 1), got {}", v) : std::string(); });
  }
  // `off` (a word saying what it means) or >= min: max_steps -1, block_size -1.
  Key& off_or_at_least(T off, T min, const char* meaning) {
    return check([off, min, meaning](const T& v) {
      return v != off && v < min ? fmt::format("must be {} ({}) or >= {}, got {}", off, meaning, min, v) : std::string();
    });
  }
  Key& not_empty() {
    return check([](const T& v) { return v.empty() ? std::string("must not be empty") : std::string(); });
  }
  Key& known_as(std::vector<std::string> names) { known_as_ = std::move(names); return *this; }
  // Another name the key is read by (a file or a flag may give either, not both); config.yaml
  // writes the key's own name.
  Key& synonym(std::string name) { synonyms_.push_back(std::move(name)); return *this; }
  // `why(config)`: "" when the key does something in this run, else why it does not.
  Key& unused_when(std::function<std::string(const RunConfig&)> why) { unused_ = std::move(why); return *this; }
  // A list of one value reads as that value (AutoTrain's block_size: 64 or [64] or "64"); a longer
  // list is refused with `why`.
  Key& list_of_one(std::string why) { list_of_one_ = std::move(why); return *this; }
  Key& secret() { secret_ = true; return *this; }
  Key& in_json_when(std::function<bool(const RunConfig&)> when) { in_json_ = std::move(when); return *this; }

  operator KeySpec() const {  // NOLINT: the table lists Keys as KeySpecs
    KeySpec s;
    s.name = name_;
    s.kind = kind_;
    s.value_hint = hint_;
    s.help = help_;
    s.group = group_;
    s.is_switch = std::is_same_v<T, bool>;
    s.secret = secret_;
    s.known_as = known_as_;
    s.synonyms = synonyms_;
    s.unused = unused_;
    const auto member = member_;
    auto get = [member](const RunConfig& c) -> const T& { return section_of<Section>(c).*member; };
    s.read = [self = *this, member](RunConfig& c, const YAML::Node& n, const std::string& key, const KeyLocation& loc) {
      section_of<Section>(c).*member = self.read_value(n, key, loc);
    };
    s.check = [checks = checks_, get](const RunConfig& c, const std::string& key, const KeyLocation& loc) {
      for (const auto& check : checks) {
        const std::string problem = check(get(c));
        if (!problem.empty()) fail("{}key '{}' {}", loc.where(key), loc.name(key), problem);
      }
    };
    if (!secret_) {
      s.write = [keyword = keyword_, get](YAML::Emitter& e, const RunConfig& c) {
        if (keyword && get(c) == keyword->second) {
          e << keyword->first;
        } else {
          Codec<T>::write(e, get(c));
        }
      };
      s.json = [keyword = keyword_, get](const RunConfig& c) {
        if (keyword && get(c) == keyword->second) return nlohmann::json(keyword->first);
        return Codec<T>::json(get(c));
      };
      s.in_json = in_json_ ? in_json_ : [](const RunConfig&) { return true; };
    }
    s.text = [keyword = keyword_, get](const RunConfig& c) {
      if (keyword && get(c) == keyword->second) return keyword->first;
      return Codec<T>::text(get(c));
    };
    s.same = [get](const RunConfig& a, const RunConfig& b) { return get(a) == get(b); };
    return s;
  }

 private:
  T read_value(const YAML::Node& n, const std::string& key, const KeyLocation& loc) const {
    if (n.IsNull() && null_) return *null_;
    if (list_of_one_) {
      std::vector<YAML::Node> items;
      if (n.IsSequence()) {
        for (const auto& item : n) items.push_back(item);
      } else if (n.IsScalar() && n.Scalar().find(',') != std::string::npos) {
        const std::string& text = n.Scalar();
        for (std::size_t from = 0;;) {
          const std::size_t comma = text.find(',', from);
          std::string piece = text.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
          piece.erase(0, piece.find_first_not_of(" \t"));
          piece.erase(piece.find_last_not_of(" \t") + 1);
          items.emplace_back(piece);
          if (comma == std::string::npos) break;
          from = comma + 1;
        }
      }
      if (items.size() > 1) fail("{}key '{}' is a list of {} values: {}", loc.at(n), loc.name(key), items.size(), *list_of_one_);
      if (items.size() == 1) return read_value(items.front(), key, loc);
      if (n.IsSequence()) fail("{}key '{}' must be {}, got an empty list", loc.at(n), loc.name(key), kind_);
    }
    if (n.IsScalar()) {
      for (const auto& [text, value] : aliases_) {
        if (n.Scalar() == text) return value;
      }
      if (keyword_ && n.Scalar() == keyword_->first) return keyword_->second;
    }
    T value{};
    YAML::Node culprit = n;
    bool ok = Codec<T>::read(n, value, culprit);
    if constexpr (std::is_same_v<T, std::string>) {
      if (ok && !allowed_.empty() && std::find(allowed_.begin(), allowed_.end(), value) == allowed_.end()) ok = false;
    }
    if (ok && valid_ && !valid_(value)) ok = false;
    if (!ok) {
      // No "did you mean" for a value: the lists are short and a near value (fp16 for fp32)
      // is rarely a typo.
      if (enumeration_ && n.IsScalar()) {
        fail("{}key '{}' must be {}, got '{}'", loc.at(n), loc.name(key), kind_, excerpt(n.Scalar()));
      }
      fail("{}key '{}' must be {}, got {}", loc.at(culprit), loc.name(key), kind_, describe(culprit));
    }
    return value;
  }

  std::string name_;
  T Section::*member_;
  std::string help_;
  std::string group_;
  std::string kind_;
  std::string hint_;
  bool enumeration_ = false;
  bool secret_ = false;
  std::vector<std::pair<std::string, T>> aliases_;
  std::optional<T> null_;
  std::optional<std::pair<std::string, T>> keyword_;
  std::vector<std::string> allowed_;
  std::function<bool(const T&)> valid_;
  std::vector<Check> checks_;
  std::vector<std::string> known_as_;
  std::vector<std::string> synonyms_;
  std::function<std::string(const RunConfig&)> unused_;
  std::optional<std::string> list_of_one_;
  std::function<bool(const RunConfig&)> in_json_;
};

template <class Section, class T>
Key<Section, T> key(const char* name, T Section::*member, const char* help) {
  return Key<Section, T>(name, member, help);
}

}  // namespace replica::train
