#include "replica/data/records.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fs = std::filesystem;

namespace replica::data {
namespace {

// A records file read in 1 MiB chunks. Why not std::ifstream + std::getline: getline grows its
// string to the whole line before anyone can look at its length (a 100 MB line, or a file with
// no newline, is buffered whole), and ifstream's open blocks on a FIFO. The file is a
// RegularFile (core/files.h: regular files only, opened without blocking).
class ChunkedInput {
 public:
  explicit ChunkedInput(const std::string& path) : path_(path), file_(path), buffer_(std::size_t{1} << 20, '\0') {}

  // The next byte, or -1 at the end of the file.
  int next() {
    if (pos_ == end_ && !refill()) return -1;
    return static_cast<unsigned char>(buffer_[pos_++]);
  }
  int peek() {
    if (pos_ == end_ && !refill()) return -1;
    return static_cast<unsigned char>(buffer_[pos_]);
  }

  // Reads the next line (without its '\n') into `line`; false at the end of the file. A line
  // longer than kMaxRecordBytes is an error naming FILE:LINE, raised before more than
  // kMaxRecordBytes + one chunk has been held.
  bool read_line(std::string& line, std::size_t number) {
    line.clear();
    bool any = false;
    while (pos_ < end_ || refill()) {
      any = true;
      const char* begin = buffer_.data() + pos_;
      const auto* newline = static_cast<const char*>(std::memchr(begin, '\n', end_ - pos_));
      const std::size_t take = newline != nullptr ? static_cast<std::size_t>(newline - begin) : end_ - pos_;
      if (line.size() + take > kMaxRecordBytes) {
        fail("{}:{}: the line is longer than {} MiB, the most replica reads in one record", path_, number,
             kMaxRecordBytes >> 20);
      }
      line.append(begin, take);
      pos_ += take;
      if (newline != nullptr) {
        ++pos_;
        return true;
      }
    }
    return any;
  }

 private:
  bool refill() {
    pos_ = end_ = 0;
    for (;;) {
      const ssize_t n = ::read(file_.fd(), buffer_.data(), buffer_.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read '{}': {}", path_, std::strerror(errno));
      end_ = static_cast<std::size_t>(n);
      return n > 0;
    }
  }

  std::string path_;
  RegularFile file_;
  std::string buffer_;
  std::size_t pos_ = 0, end_ = 0;
};

std::vector<NumberedRecord> read_jsonl(const std::string& file) {
  ChunkedInput in(file);
  std::vector<NumberedRecord> out;
  std::string line;
  size_t number = 0;
  while (in.read_line(line, number + 1)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    // parse_json bounds nesting while parsing (a row nested 10^6 deep is refused here, before
    // any recursive walk of it) and names FILE:LINE in every error.
    nlohmann::json j = parse_json(line, fmt::format("{}:{}", file, number));
    if (!j.is_object()) fail("{}:{}: each line must be a JSON object, got {}", file, number, j.type_name());
    out.push_back({std::move(j), number});
  }
  return out;
}

// A CSV cell that holds a JSON list or object (a messages column written by pandas' to_csv
// with json.dumps) is that JSON value; any other cell is its text. nlohmann's accept() checks
// the text without building a value (and without recursion), so text that merely starts with
// '[' stays text, while JSON nested too deep is refused by parse_json naming FILE:LINE.
nlohmann::json csv_cell_value(const std::string& cell, const std::string& file, size_t line,
                              const std::string& column) {
  if (!cell.empty() && (cell.front() == '[' || cell.front() == '{') && nlohmann::json::accept(cell)) {
    return parse_json(cell, fmt::format("{}:{}: column '{}'", file, line, column));
  }
  return cell;
}

// RFC 4180: fields separated by commas, quoted with double quotes, "" inside quotes is a quote,
// quoted fields may hold newlines. Read as a stream of bytes, each row at most kMaxRecordBytes.
std::vector<NumberedRecord> read_csv(const std::string& file) {
  ChunkedInput in(file);
  std::vector<std::string> header;
  bool have_header = false;
  std::vector<NumberedRecord> out;
  std::vector<std::string> row;
  std::string cell;
  bool quoted = false, cell_started = false;
  size_t line = 1, row_line = 1, row_bytes = 0;
  auto end_cell = [&] {
    row.push_back(std::move(cell));
    cell.clear();
    cell_started = false;
  };
  auto end_row = [&] {
    end_cell();
    if (!(row.size() == 1 && row[0].empty())) {
      if (!have_header) {
        header = std::move(row);
        have_header = true;
      } else {
        if (row.size() != header.size()) {
          fail("{}:{}: row has {} cells but the header has {}", file, row_line, row.size(), header.size());
        }
        nlohmann::json j = nlohmann::json::object();
        for (size_t k = 0; k < header.size(); ++k) j[header[k]] = csv_cell_value(row[k], file, row_line, header[k]);
        out.push_back({std::move(j), row_line});
      }
    }
    row.clear();
    row_bytes = 0;
  };
  for (int c = in.next(); c >= 0; c = in.next()) {
    if (++row_bytes > kMaxRecordBytes) {
      fail("{}:{}: the row is longer than {} MiB, the most replica reads in one record", file, row_line,
           kMaxRecordBytes >> 20);
    }
    if (quoted) {
      if (c == '"') {
        if (in.peek() == '"') {
          cell += '"';
          in.next();
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        cell += static_cast<char>(c);
      }
      continue;
    }
    if (c == '"' && !cell_started) {
      quoted = true;
      cell_started = true;
    } else if (c == ',') {
      end_cell();
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && in.peek() == '\n') in.next();
      end_row();
      ++line;
      row_line = line;
    } else {
      cell += static_cast<char>(c);
      cell_started = true;
    }
  }
  if (quoted) fail("{}:{}: unterminated quoted field", file, row_line);
  if (!cell.empty() || !row.empty()) end_row();
  if (!have_header) fail("{}: empty CSV file (no header row)", file);
  return out;
}

}  // namespace

std::string resolve_records_file(const std::string& path, const std::string& split) {
  std::error_code ec;
  // Anything that exists and is not a directory is the file itself: a FIFO or a device is then
  // refused by the reader naming what it is, instead of being reported as missing.
  if (fs::is_directory(path, ec)) {
    for (const char* ext : {".jsonl", ".json", ".csv"}) {
      fs::path candidate = fs::path(path) / (split + ext);
      if (fs::exists(fs::symlink_status(candidate, ec)) && !fs::is_directory(candidate, ec)) return candidate.string();
    }
  } else if (fs::exists(fs::symlink_status(path, ec))) {
    return path;
  } else {
    fail("data path '{}' does not exist", path);
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

std::string columns_of(const nlohmann::json& record) {
  std::string out;
  for (const auto& item : record.items()) out += (out.empty() ? "" : ", ") + item.key();
  return out.empty() ? "none" : out;
}

std::string mapped_column(const std::map<std::string, std::string>& mapping, const std::string& key,
                          const std::string& fallback) {
  auto it = mapping.find(key);
  return it == mapping.end() ? fallback : it->second;
}

}  // namespace replica::data
