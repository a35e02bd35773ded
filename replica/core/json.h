// The one way replica parses JSON it did not write itself (config.json, tokenizer.json,
// tokenizer_config.json, safetensors headers, DeepSpeed JSON, MDS indexes, data rows, ...).
//
// Why not nlohmann::json::parse directly: its parser keeps an explicit stack, but everything
// done with the value afterwards recurses (dump() while formatting a message, replica's own
// walks, the chat template's conversion of the value), so a value nested 10^6 deep parses and
// then overflows the stack. parse_json refuses nesting beyond a bound while parsing, before the
// value exists, and names the source; every message that shows a value shows json_excerpt's
// few characters of it, never the whole value.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

namespace replica {

// Deeper than any real file: tokenizer.json's normalizer sequences reach ~6, chat messages
// with tool calls ~8, DeepSpeed JSON 3.
inline constexpr int kMaxJsonDepth = 128;

// The value of `text`. replica::Error "SOURCE: not valid JSON: ..." or "SOURCE: JSON nested more
// than N levels deep" (SOURCE: a file's path, or "file:line" for a row of a JSONL file).
nlohmann::json parse_json(std::string_view text, const std::string& source, int max_depth = kMaxJsonDepth);
// The same with the keys kept in file order (chat messages, templates' inputs).
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& source,
                                          int max_depth = kMaxJsonDepth);
// read_file(path) (regular files only, bounded) parsed by parse_json, the path as source.
nlohmann::json read_json_file(const std::string& path, int max_depth = kMaxJsonDepth);

// At most `max_chars` of the value's JSON text, "..." after a cut: for messages. Nesting below
// `max_depth` is shown as "[...]" / "{...}", so any value, however deep, prints in bounded
// stack and memory.
std::string json_excerpt(const nlohmann::json& value, std::size_t max_chars = 60, int max_depth = 4);
std::string json_excerpt(const nlohmann::ordered_json& value, std::size_t max_chars = 60, int max_depth = 4);

}  // namespace replica
