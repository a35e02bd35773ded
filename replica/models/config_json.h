// Reading config.json fields (llama.cpp, decoder_family.cpp): absent and null are the same
// ("use the default"); a value of the wrong type or out of its range is an error naming the
// file and the field. Messages show at most json_excerpt of a value.
#pragma once

#include "replica/core/error.h"
#include "replica/core/json.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace replica::models::config_json {

using json = nlohmann::json;

// Note [config.json bounds]
// Every size config.json gives is read as a 64-bit integer and checked against a bound before
// anything is sized from it: `hidden_size: 1e12` would otherwise ask LibTorch for terabytes
// (or wrap when narrowed). The bounds are far above every published checkpoint (largest seen:
// vocab 262,208, hidden 16,384, intermediate 53,248, 126 layers, 128 heads, head_dim 256, 10M
// positions, 512 experts) and far below sizes no machine holds; the weight files are then
// checked against the config before the model is built (hf_model_dir.cpp).
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 23;
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;
inline constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
inline constexpr int64_t kMaxLayers = int64_t{1} << 12;
inline constexpr int64_t kMaxHeads = int64_t{1} << 12;
inline constexpr int64_t kMaxHeadDim = int64_t{1} << 12;
inline constexpr int64_t kMaxPositions = int64_t{1} << 24;
inline constexpr int64_t kMaxExperts = int64_t{1} << 12;
// Token ids, window lengths, layer indices: not sizes of anything, but narrowed to int64
// exactly only below 2^53, and never meaningful beyond 2^31.
inline constexpr int64_t kMaxPlainInt = (int64_t{1} << 31) - 1;
// The most bytes read from config.json or adapter_config.json (real ones: a few KB), and from
// model.safetensors.index.json (about 100 KB for the largest models).
inline constexpr std::uint64_t kMaxConfigJsonBytes = std::uint64_t{16} << 20;
inline constexpr std::uint64_t kMaxIndexJsonBytes = std::uint64_t{64} << 20;

// A text from config.json as messages quote it: cut to 60 characters.
inline std::string quote_excerpt(const std::string& text) {
  return "'" + (text.size() <= 60 ? text : text.substr(0, 60) + "...") + "'";
}

inline const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

// The integer value of `v`, exactly, in [min, max]; an integral float (1e3, 4096.0) counts.
// The one place config.json's integers are narrowed: a value outside the range is an error
// before it is converted, so nothing wraps.
inline int64_t as_int(const json& v, const char* key, const std::string& src, int64_t min = -kMaxPlainInt,
                      int64_t max = kMaxPlainInt) {
  bool integral = false;
  double d = 0;
  if (v.is_number_unsigned()) {
    integral = true;
    d = static_cast<double>(v.get<uint64_t>());
  } else if (v.is_number_integer()) {
    integral = true;
    d = static_cast<double>(v.get<int64_t>());
  } else if (v.is_number_float()) {
    d = v.get<double>();
    integral = std::isfinite(d) && std::floor(d) == d;
  }
  if (!integral) fail("{}: {} must be an integer, got {}", src, key, json_excerpt(v));
  if (d < static_cast<double>(min) || d > static_cast<double>(max)) {
    fail("{}: {} must be between {} and {}, got {}", src, key, min, max, json_excerpt(v));
  }
  if (v.is_number_float()) return static_cast<int64_t>(d);
  return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
}

inline double as_number(const json& v, const char* key, const std::string& src) {
  if (!v.is_number()) fail("{}: {} must be a number, got {}", src, key, json_excerpt(v));
  const double d = v.get<double>();
  if (!std::isfinite(d)) fail("{}: {} must be a finite number, got {}", src, key, json_excerpt(v));
  return d;
}

// A size: required, in [1, max].
inline int64_t required_int(const json& j, const char* key, const std::string& src, int64_t max) {
  const json* v = field(j, key);
  if (!v) fail("{}: required field {} is missing", src, key);
  return as_int(*v, key, src, 1, max);
}

inline int64_t optional_int(const json& j, const char* key, const std::string& src, int64_t def,
                            int64_t min = -kMaxPlainInt, int64_t max = kMaxPlainInt) {
  const json* v = field(j, key);
  return v ? as_int(*v, key, src, min, max) : def;
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
  if (!v->is_boolean()) fail("{}: {} must be true or false, got {}", src, key, json_excerpt(*v));
  return v->get<bool>();
}

inline std::optional<std::string> optional_string(const json& j, const char* key, const std::string& src) {
  const json* v = field(j, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail("{}: {} must be a string, got {}", src, key, json_excerpt(*v));
  return v->get<std::string>();
}

}  // namespace replica::models::config_json
