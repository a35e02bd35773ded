#include "replica/core/json.h"

#include "replica/core/error.h"
#include "replica/core/files.h"

namespace replica {
namespace {

// Thrown from the parser's callback: aborts the parse before a deeper level is built.
struct TooDeep {};

template <typename Json>
Json parse_bounded(std::string_view text, const std::string& source, int max_depth) {
  auto bound = [max_depth](int depth, nlohmann::json::parse_event_t event, Json&) {
    if ((event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start) &&
        depth >= max_depth) {
      throw TooDeep{};
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), bound);
  } catch (const TooDeep&) {
    fail("{}: JSON nested more than {} levels deep", source, max_depth);
  } catch (const nlohmann::json::exception& e) {
    // e.what() is nlohmann's "[json.exception.parse_error.101] parse error at line 1, column 2: ...".
    std::string reason = e.what();
    if (auto pos = reason.find("] "); pos != std::string::npos) reason = reason.substr(pos + 2);
    if (reason.size() > 200) reason = reason.substr(0, 200) + "...";
    fail("{}: not valid JSON: {}", source, reason);
  }
}

template <typename Json>
void excerpt(const Json& v, int depth_left, std::size_t budget, std::string& out) {
  if (out.size() > budget) return;
  if (v.is_object() || v.is_array()) {
    const bool object = v.is_object();
    if (depth_left <= 0) {
      out += object ? "{...}" : "[...]";
      return;
    }
    out += object ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (out.size() > budget) return;
      if (!first) out += ", ";
      first = false;
      if (object) out += Json(it.key()).dump() + ": ";
      excerpt(*it, depth_left - 1, budget, out);
    }
    out += object ? '}' : ']';
    return;
  }
  std::string leaf = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (leaf.size() > budget + 1) leaf.resize(budget + 1);
  out += leaf;
}

template <typename Json>
std::string excerpt_of(const Json& value, std::size_t max_chars, int max_depth) {
  std::string out;
  excerpt(value, max_depth, max_chars, out);
  if (out.size() > max_chars) {
    out.resize(max_chars);
    out += "...";
  }
  return out;
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& source, int max_depth) {
  return parse_bounded<nlohmann::json>(text, source, max_depth);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& source, int max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, source, max_depth);
}

nlohmann::json read_json_file(const std::string& path, int max_depth) {
  return parse_json(read_file(path), path, max_depth);
}

std::string json_excerpt(const nlohmann::json& value, std::size_t max_chars, int max_depth) {
  return excerpt_of(value, max_chars, max_depth);
}

std::string json_excerpt(const nlohmann::ordered_json& value, std::size_t max_chars, int max_depth) {
  return excerpt_of(value, max_chars, max_depth);
}

}  // namespace replica
