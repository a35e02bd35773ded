// Tabular training records from JSON Lines or CSV files, as JSON objects.
//
// Why JSON objects: SFT data comes as a text column, a messages column (a list of
// {role, content}) or prompt + completion columns; JSON holds all three. CSV cells are
// strings, except that a cell holding a JSON list (a messages column written by pandas'
// to_csv with json.dumps) is parsed as JSON.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace replica::data {

// The longest record (a JSONL line, a CSV row) replica reads. Why 16 MiB: a 1M-token
// conversation is ~4 MB of text, so real rows stay far below it; the JSON value parsed from a
// row takes several times its text, so the bound also bounds the memory one row may claim. It
// is checked while the row is read, so a 100 MB line (or a file without newlines) is refused
// after 16 MiB, not after all of it has been buffered.
inline constexpr std::size_t kMaxRecordBytes = std::size_t{16} << 20;

// `path` is a .jsonl/.json/.csv file, or a directory holding <split>.jsonl or <split>.csv.
// Errors (missing file, a file that is not a regular file, a line that is not a JSON object or
// is nested too deep (core/json.h), a row longer than kMaxRecordBytes, a CSV row with the wrong
// number of cells, an unterminated quote) name the file and line.
std::vector<nlohmann::json> read_records(const std::string& path, const std::string& split = "train");

// A record and the line of its file it starts on (1-based), for errors about its values.
struct NumberedRecord {
  nlohmann::json value;
  size_t line = 0;
};

// read_records with each record's line number.
std::vector<NumberedRecord> read_numbered_records(const std::string& path, const std::string& split = "train");

// The file read_records would read for (path, split). It is not opened here: the reader
// refuses it then when it is not a regular file (a FIFO, a device), naming it.
std::string resolve_records_file(const std::string& path, const std::string& split);

// Column names for messages: "prompt, chosen, rejected" (the keys of a record), "none" for
// an empty one.
std::string columns_of(const nlohmann::json& record);

// The column `mapping` (data.column_mapping) names for `key`, else `fallback`.
std::string mapped_column(const std::map<std::string, std::string>& mapping, const std::string& key,
                          const std::string& fallback);

}  // namespace replica::data
