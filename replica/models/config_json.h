// Reading config.json fields (llama.cpp, decoder_family.cpp): absent and null are the same
// ("use the default"); a value of the wrong type is an error naming the file and the field.
#pragma once

#include "replica/core/error.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace replica::models::config_json {

using json = nlohmann::json;

inline const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

inline int64_t as_int(const json& v, const char* key, const std::string& src) {
  if (v.is_number_integer() || v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::floor(d) == d && std::fabs(d) < 9e15) return static_cast<int64_t>(d);
  }
  fail("{}: {} must be an integer, got {}", src, key, v.dump());
}

inline double as_number(const json& v, const char* key, const std::string& src) {
  if (!v.is_number()) fail("{}: {} must be a number, got {}", src, key, v.dump());
  return v.get<double>();
}

inline int64_t required_int(const json& j, const char* key, const std::string& src) {
  const json* v = field(j, key);
  if (!v) fail("{}: required field {} is missing", src, key);
  int64_t value = as_int(*v, key, src);
  if (value < 1) fail("{}: {} must be at least 1, got {}", src, key, value);
  return value;
}

inline int64_t optional_int(const json& j, const char* key, const std::string& src, int64_t def) {
  const json* v = field(j, key);
  return v ? as_int(*v, key, src) : def;
}

inline double optional_number(const json& j, const char* key, const std::string& src, double def) {
  const json* v = field(j, key);
  return v ? as_number(*v, key, src) : def;
}

inline std::optional<double> optional_number(const json& j, const char* key, const std::string& src) {
  const json* v = field(j, key);
  if (!v) return std::nullopt;
  return as_number(*v, key, src);
}

inline bool optional_bool(const json& j, const char* key, const std::string& src, bool def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (!v->is_boolean()) fail("{}: {} must be true or false, got {}", src, key, v->dump());
  return v->get<bool>();
}

inline std::optional<std::string> optional_string(const json& j, const char* key, const std::string& src) {
  const json* v = field(j, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail("{}: {} must be a string, got {}", src, key, v->dump());
  return v->get<std::string>();
}

}  // namespace replica::models::config_json
