// Tabular training records from JSON Lines or CSV files, as JSON objects.
//
// Why JSON objects: SFT data comes as a text column, a messages column (a list of
// {role, content}) or prompt + completion columns; JSON holds all three. CSV cells are
// strings, except that a cell holding a JSON list (a messages column written by pandas'
// to_csv with json.dumps) is parsed as JSON.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace replica::data {

// `path` is a .jsonl/.json/.csv file, or a directory holding <split>.jsonl or <split>.csv.
// Errors (missing file, a line that is not a JSON object, a CSV row with the wrong number of
// cells, an unterminated quote) name the file and line.
std::vector<nlohmann::json> read_records(const std::string& path, const std::string& split = "train");

// A record and the line of its file it starts on (1-based), for errors about its values.
struct NumberedRecord {
  nlohmann::json value;
  size_t line = 0;
};

// read_records with each record's line number.
std::vector<NumberedRecord> read_numbered_records(const std::string& path, const std::string& split = "train");

// The file read_records would read for (path, split).
std::string resolve_records_file(const std::string& path, const std::string& split);

}  // namespace replica::data
