// The key tables' machinery (keys.h): reading and writing scalars the same way for every key.
#include "replica/train/keys.h"

#include "replica/core/text.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace replica::train {

// ---------------------------------------------------------------------------------------
// Scalars, shared by every key (keys.h).

std::string describe(const YAML::Node& node) {
  if (node.IsMap()) return "a mapping";
  if (node.IsSequence()) return "a list";
  if (node.IsNull()) return "null";
  return "'" + excerpt(node.Scalar()) + "'";
}

void write_text(YAML::Emitter& e, const std::string& text) {
  // Probed where config.yaml writes text: as a mapping's value (the emitter's choice depends on
  // it) with a line after it (a trailing carriage return before the line break is dropped).
  YAML::Emitter probe;
  probe << YAML::BeginMap << YAML::Key << "k" << YAML::Value << text << YAML::Key << "z" << YAML::Value << 0
        << YAML::EndMap;
  bool same = false;
  try {
    const YAML::Node back = YAML::Load(probe.c_str());
    same = back.IsMap() && back["k"].IsScalar() && back["k"].Scalar() == text;
  } catch (const YAML::Exception&) {
  }
  if (same) {
    e << text;
  } else {
    e << YAML::DoubleQuoted << text;
  }
}

std::string float_text(double value) {
  const std::string text = fmt::format("{}", value);
  if (!std::isfinite(value)) return text;
  const auto e = text.find('e');
  std::string mantissa = text.substr(0, e);
  if (mantissa.find('.') == std::string::npos) mantissa += ".0";
  return e == std::string::npos ? mantissa : mantissa + text.substr(e);
}

std::optional<int64_t> parse_int(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') return std::nullopt;
  return static_cast<int64_t>(value);
}

std::optional<double> parse_float(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == text.c_str() || *end != '\0' || !std::isfinite(value)) return std::nullopt;
  return value;
}

std::optional<bool> parse_bool(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text == "true" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "no" || text == "off") return false;
  return std::nullopt;
}

bool Codec<std::vector<std::string>>::read(const YAML::Node& n, std::vector<std::string>& out, YAML::Node& culprit) {
  std::vector<std::string> names;
  if (n.IsSequence()) {
    for (const auto& item : n) {
      if (!item.IsScalar() || item.Scalar().empty()) {
        culprit.reset(item);  // rebinds (operator= would overwrite the node it refers to)
        return false;
      }
      names.push_back(item.Scalar());
    }
  } else if (n.IsScalar()) {
    std::string text = n.Scalar();
    size_t start = 0;
    while (start <= text.size()) {
      const size_t comma = std::min(text.find(',', start), text.size());
      std::string name = text.substr(start, comma - start);
      name.erase(0, name.find_first_not_of(" \t"));
      name.erase(name.find_last_not_of(" \t") + 1);
      if (!name.empty()) names.push_back(name);
      start = comma + 1;
    }
  } else {
    return false;
  }
  if (names.empty()) return false;
  out = std::move(names);
  return true;
}

}  // namespace replica::train
