#include "replica/data/records.h"

#include "replica/core/error.h"
#include "replica/core/files.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace replica::data {
namespace {

std::vector<NumberedRecord> read_jsonl(const std::string& file) {
  std::ifstream in(file);
  if (!in) fail("cannot open {}", file);
  std::vector<NumberedRecord> out;
  std::string line;
  size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // parse_error, and out_of_range for a number too large for a double (1e999).
      fail("{}:{}: not valid JSON: {}", file, number, e.what());
    }
    if (!j.is_object()) fail("{}:{}: each line must be a JSON object, got {}", file, number, j.type_name());
    out.push_back({std::move(j), number});
  }
  return out;
}

// RFC 4180: fields separated by commas, quoted with double quotes, "" inside quotes is a quote,
// quoted fields may hold newlines.
std::vector<NumberedRecord> read_csv(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open {}", file);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<std::vector<std::string>> rows;
  std::vector<size_t> row_lines;
  std::vector<std::string> row;
  std::string cell;
  bool quoted = false, cell_started = false;
  size_t line = 1, row_line = 1;
  auto end_cell = [&] {
    row.push_back(cell);
    cell.clear();
    cell_started = false;
  };
  auto end_row = [&] {
    end_cell();
    if (!(row.size() == 1 && row[0].empty())) {
      rows.push_back(row);
      row_lines.push_back(row_line);
    }
    row.clear();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          cell += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        cell += c;
      }
      continue;
    }
    if (c == '"' && !cell_started) {
      quoted = true;
      cell_started = true;
    } else if (c == ',') {
      end_cell();
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      end_row();
      ++line;
      row_line = line;
    } else {
      cell += c;
      cell_started = true;
    }
  }
  if (quoted) fail("{}:{}: unterminated quoted field", file, row_line);
  if (!cell.empty() || !row.empty()) end_row();
  if (rows.empty()) fail("{}: empty CSV file (no header row)", file);
  const auto& header = rows[0];
  std::vector<NumberedRecord> out;
  for (size_t r = 1; r < rows.size(); ++r) {
    if (rows[r].size() != header.size()) {
      fail("{}:{}: row has {} cells but the header has {}", file, row_lines[r], rows[r].size(), header.size());
    }
    nlohmann::json j = nlohmann::json::object();
    for (size_t k = 0; k < header.size(); ++k) {
      const std::string& v = rows[r][k];
      if (!v.empty() && (v.front() == '[' || v.front() == '{')) {
        try {
          j[header[k]] = nlohmann::json::parse(v);
          continue;
        } catch (...) {
        }
      }
      j[header[k]] = v;
    }
    out.push_back({std::move(j), row_lines[r]});
  }
  return out;
}

}  // namespace

std::string resolve_records_file(const std::string& path, const std::string& split) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path;
  if (!fs::is_directory(path, ec)) fail("data path '{}' does not exist", path);
  for (const char* ext : {".jsonl", ".json", ".csv"}) {
    fs::path candidate = fs::path(path) / (split + ext);
    if (fs::is_regular_file(candidate, ec)) return candidate.string();
  }
  fail("data directory '{}' has no {}.jsonl or {}.csv", path, split, split);
}

std::vector<NumberedRecord> read_numbered_records(const std::string& path, const std::string& split) {
  const std::string file = resolve_records_file(path, split);
  if (ends_with(file, ".csv")) return read_csv(file);
  return read_jsonl(file);
}

std::vector<nlohmann::json> read_records(const std::string& path, const std::string& split) {
  std::vector<NumberedRecord> numbered = read_numbered_records(path, split);
  std::vector<nlohmann::json> out;
  out.reserve(numbered.size());
  for (auto& r : numbered) out.push_back(std::move(r.value));
  return out;
}

}  // namespace replica::data
