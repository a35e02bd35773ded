// MDS (Mosaic Streaming format v2) writer and reader; the layout is documented in mds.h.
#include "replica/data/mds.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/data/records.h"

#include <fcntl.h>
#include <unistd.h>
#include <zstd.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace replica::data {
namespace {

// Note [MDS sizes are checked before they are used]
// Every count and size an index.json or a shard announces (samples, raw_data.bytes,
// zip_data.bytes, column sizes, a sample's offsets, an ndarray's shape, a zstd frame's content
// size) is checked against the length of the file it describes and against the format's own
// bounds before anything is allocated for it, so a few hostile bytes cannot claim gigabytes.
// The format's bound: a shard's offsets are uint32, so no shard (decompressed) is longer than
// this, and no column value either.
constexpr uint64_t kMaxShardBytes = 0xffffffffull;
// index.json holds ~500 bytes per shard: 256 MiB is half a million shards, petabytes of data.
constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;

struct ScalarSpec {
  const char* name;
  int bytes;
  bool is_float;
  bool is_signed;
};

const ScalarSpec kScalars[] = {
    {"int8", 1, false, true},    {"int16", 2, false, true},   {"int32", 4, false, true},
    {"int64", 8, false, true},   {"int", 8, false, true},     {"uint8", 1, false, false},
    {"uint16", 2, false, false}, {"uint32", 4, false, false}, {"uint64", 8, false, false},
    {"float32", 4, true, true},  {"float64", 8, true, true},
};

const ScalarSpec* find_scalar(const std::string& encoding) {
  for (const auto& s : kScalars) {
    if (encoding == s.name) return &s;
  }
  return nullptr;
}

// mosaicml-streaming's NDArray dtype codes, and the torch dtypes that hold them (LibTorch has
// had uint16, uint32 and uint64 since 2.3: storage, copies and conversions, few kernels).
struct DtypeCode {
  const char* name;
  uint8_t code;
  std::optional<torch::ScalarType> torch_type;
};
const DtypeCode kDtypes[] = {
    {"uint8", 8, torch::kUInt8},      {"int8", 9, torch::kInt8},      {"uint16", 16, torch::kUInt16},
    {"int16", 17, torch::kInt16},     {"float16", 18, torch::kHalf},  {"uint32", 32, torch::kUInt32},
    {"int32", 33, torch::kInt32},     {"float32", 34, torch::kFloat}, {"uint64", 64, torch::kUInt64},
    {"int64", 65, torch::kLong},      {"float64", 66, torch::kDouble},
};

struct NdarraySpec {
  std::optional<std::string> dtype;
  std::optional<std::vector<int64_t>> shape;
};

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!text.empty() && text.back() == sep) parts.push_back("");
  return parts;
}

std::optional<NdarraySpec> parse_ndarray(const std::string& encoding) {
  if (encoding.rfind("ndarray", 0) != 0) return std::nullopt;
  if (encoding == "ndarray") return NdarraySpec{};
  if (encoding[7] != ':') return std::nullopt;
  auto args = split(encoding.substr(8), ':');
  if (args.empty() || args.size() > 2) return std::nullopt;
  NdarraySpec spec;
  bool known = false;
  for (const auto& d : kDtypes) known = known || args[0] == d.name;
  if (!known) return std::nullopt;
  spec.dtype = args[0];
  if (args.size() == 2) {
    std::vector<int64_t> shape;
    // A fixed shape of more elements than a shard has bytes is no encoding a shard can store
    // (and its product could overflow): refused here, so fixed_size() is always bounded.
    uint64_t elements = 1;
    for (const auto& dim : split(args[1], ',')) {
      try {
        size_t used = 0;
        const long long v = std::stoll(dim, &used);
        if (used != dim.size() || v < 1 || static_cast<uint64_t>(v) > kMaxShardBytes) return std::nullopt;
        elements *= static_cast<uint64_t>(v);  // both factors < 2^32: no overflow
        if (elements > kMaxShardBytes) return std::nullopt;
        shape.push_back(v);
      } catch (...) {
        return std::nullopt;
      }
    }
    spec.shape = shape;
  }
  return spec;
}

const DtypeCode* dtype_by_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

const DtypeCode* dtype_by_code(uint8_t code) {
  for (const auto& d : kDtypes) {
    if (code == d.code) return &d;
  }
  return nullptr;
}

const DtypeCode* dtype_by_torch(torch::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.torch_type && *d.torch_type == type) return &d;
  }
  return nullptr;
}

int64_t element_bytes(const std::string& dtype) {
  const auto* d = dtype_by_name(dtype);
  return d->code == 8 || d->code == 9 ? 1 : d->code < 32 ? 2 : d->code < 64 ? 4 : 8;
}

// Bytes of a fixed-size encoding; nullopt for a variable-size one.
std::optional<int64_t> fixed_size(const std::string& encoding) {
  if (const auto* s = find_scalar(encoding)) return s->bytes;
  if (auto nd = parse_ndarray(encoding); nd && nd->dtype && nd->shape) {
    int64_t n = 1;
    for (int64_t dim : *nd->shape) n *= dim;
    return n * element_bytes(*nd->dtype);
  }
  return std::nullopt;
}

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

template <typename T>
T get_le(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

std::string encode_value(const MdsColumn& column, const MdsValue& value) {
  const std::string& enc = column.encoding;
  auto wrong = [&](const char* expected) -> std::string {
    fail("MDS column '{}' ({}) needs {}", column.name, enc, expected);
  };
  std::string out;
  if (const auto* s = find_scalar(enc)) {
    if (s->is_float) {
      double v = 0;
      if (const auto* d = std::get_if<double>(&value)) {
        v = *d;
      } else if (const auto* i = std::get_if<int64_t>(&value)) {
        v = static_cast<double>(*i);
      } else {
        wrong("a number");
      }
      if (s->bytes == 4) put(out, static_cast<float>(v)); else put(out, v);
      return out;
    }
    const auto* i = std::get_if<int64_t>(&value);
    if (i == nullptr) wrong("an integer");
    const int64_t v = *i;
    const int bits = s->bytes * 8;
    const bool fits = s->is_signed ? (bits == 64 || (v >= -(int64_t{1} << (bits - 1)) && v < (int64_t{1} << (bits - 1))))
                                   : (v >= 0 && (bits == 64 || v < (int64_t{1} << bits)));
    if (!fits) fail("MDS column '{}' ({}): value {} does not fit", column.name, enc, v);
    out.append(reinterpret_cast<const char*>(&v), s->bytes);  // little-endian: the low bytes first
    return out;
  }
  if (enc == "str" || enc == "bytes" || enc == "json") {
    const auto* text = std::get_if<std::string>(&value);
    if (text == nullptr) wrong(enc == "bytes" ? "bytes (a string)" : "a string");
    if (enc == "json") (void)parse_json(*text, fmt::format("MDS column '{}' (json)", column.name));
    return *text;
  }
  auto nd = parse_ndarray(enc);
  if (!nd) fail("MDS column '{}': unknown encoding '{}'", column.name, enc);
  const auto* tensor = std::get_if<torch::Tensor>(&value);
  if (tensor == nullptr || !tensor->defined()) wrong("a tensor");
  torch::Tensor t = tensor->contiguous().cpu();
  const DtypeCode* code = dtype_by_torch(t.scalar_type());
  if (code == nullptr) fail("MDS column '{}': tensor dtype {} has no MDS code", column.name, c10::toString(t.scalar_type()));
  if (nd->dtype) {
    if (*nd->dtype != code->name) fail("MDS column '{}' ({}): tensor is {}", column.name, enc, code->name);
  } else {
    out.push_back(static_cast<char>(code->code));
  }
  if (nd->shape) {
    if (t.sizes().vec() != *nd->shape) {
      fail("MDS column '{}' ({}): tensor has shape {}", column.name, enc, c10::str(t.sizes()));
    }
  } else {
    if (t.dim() >= 64) fail("MDS column '{}': a tensor of {} dimensions (63 at most)", column.name, t.dim());
    int64_t max_dim = 1;
    for (int64_t d : t.sizes()) {
      if (d <= 0) fail("MDS column '{}': tensor shape {} has an empty dimension", column.name, c10::str(t.sizes()));
      max_dim = std::max(max_dim, d);
    }
    const int width_code = max_dim < (1 << 8) ? 0 : max_dim < (1 << 16) ? 1 : max_dim < (int64_t{1} << 32) ? 2 : 3;
    out.push_back(static_cast<char>((t.dim() << 2) | width_code));
    for (int64_t d : t.sizes()) out.append(reinterpret_cast<const char*>(&d), size_t{1} << width_code);
  }
  out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  return out;
}

MdsValue decode_value(const MdsColumn& column, const char* p, size_t n, const std::string& where) {
  const std::string& enc = column.encoding;
  if (const auto* s = find_scalar(enc)) {
    if (n != static_cast<size_t>(s->bytes)) fail("{}: column '{}' has {} bytes, {} needs {}", where, column.name, n, enc, s->bytes);
    if (s->is_float) return s->bytes == 4 ? static_cast<double>(get_le<float>(p)) : get_le<double>(p);
    switch (s->bytes) {
      case 1: return s->is_signed ? int64_t{get_le<int8_t>(p)} : int64_t{get_le<uint8_t>(p)};
      case 2: return s->is_signed ? int64_t{get_le<int16_t>(p)} : int64_t{get_le<uint16_t>(p)};
      case 4: return s->is_signed ? int64_t{get_le<int32_t>(p)} : int64_t{get_le<uint32_t>(p)};
      default: return get_le<int64_t>(p);  // uint64 above 2^63 wraps: int64 is the only integer kind
    }
  }
  if (enc == "str" || enc == "bytes" || enc == "json") return std::string(p, n);
  auto nd = parse_ndarray(enc);
  if (!nd) fail("{}: column '{}' has unknown encoding '{}'", where, column.name, enc);
  size_t pos = 0;
  auto need = [&](size_t k) {
    if (pos + k > n) fail("{}: column '{}' ({}) is truncated", where, column.name, enc);
  };
  const DtypeCode* code = nullptr;
  if (nd->dtype) {
    code = dtype_by_name(*nd->dtype);
  } else {
    need(1);
    code = dtype_by_code(static_cast<uint8_t>(p[pos++]));
    if (code == nullptr) fail("{}: column '{}' has an unknown ndarray dtype code {}", where, column.name, static_cast<int>(static_cast<uint8_t>(p[pos - 1])));
  }
  if (!code->torch_type) fail("{}: column '{}' holds {} values, which torch has no type for", where, column.name, code->name);
  std::vector<int64_t> shape;
  if (nd->shape) {
    shape = *nd->shape;
  } else {
    need(1);
    const uint8_t byte = static_cast<uint8_t>(p[pos++]);
    const int ndim = byte >> 2, width = 1 << (byte & 3);
    need(static_cast<size_t>(ndim) * width);
    for (int d = 0; d < ndim; ++d) {
      uint64_t dim = 0;
      std::memcpy(&dim, p + pos, width);
      pos += width;
      // Each dimension is bounded (it is checked against the value bytes below), so the shape
      // handed to torch::empty is never negative nor a product that wraps.
      if (dim > kMaxShardBytes) fail("{}: column '{}' ({}) has a dimension of {}", where, column.name, enc, dim);
      shape.push_back(static_cast<int64_t>(dim));
    }
  }
  const auto esize = static_cast<uint64_t>(c10::elementSize(*code->torch_type));
  uint64_t value_bytes = esize;
  bool overflow = false;
  for (int64_t d : shape) overflow = overflow || __builtin_mul_overflow(value_bytes, static_cast<uint64_t>(d), &value_bytes);
  if (overflow || n - pos != value_bytes) {
    fail("{}: column '{}' ({}) has {} value bytes for shape {}", where, column.name, enc, n - pos, c10::str(shape));
  }
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(*code->torch_type));
  std::memcpy(t.data_ptr(), p + pos, n - pos);
  return t;
}

int zstd_level(const std::string& compression) {
  if (compression == "zstd") return 3;
  if (compression.rfind("zstd:", 0) == 0) {
    try {
      size_t used = 0;
      const int level = std::stoi(compression.substr(5), &used);
      if (used == compression.size() - 5 && level >= 1 && level <= ZSTD_maxCLevel()) return level;
    } catch (...) {
    }
  }
  fail("MDS compression '{}' is not supported (none, zstd or zstd:LEVEL with LEVEL 1..{})", compression,
       ZSTD_maxCLevel());
}

// json.dumps' default text (", " and ": " separators), so that the config bytes inside a
// shard are the ones mosaicml-streaming writes.
std::string python_json_text(const nlohmann::json& j) {
  if (j.is_object()) {
    std::string out = "{";
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it != j.begin()) out += ", ";
      out += nlohmann::json(it.key()).dump() + ": " + python_json_text(it.value());
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json_text(j[i]);
    return out + "]";
  }
  return j.dump(-1, ' ', false);  // ensure_ascii is the default in Python; configs are ASCII
}

}  // namespace

bool is_mds_encoding(const std::string& encoding) {
  return find_scalar(encoding) != nullptr || encoding == "str" || encoding == "bytes" || encoding == "json" ||
         parse_ndarray(encoding).has_value();
}

// ---------------------------------------------------------------------------------------
// Writer

MdsWriter::MdsWriter(std::string dir, std::vector<MdsColumn> columns, MdsWriterOptions options)
    : dir_(std::move(dir)), columns_(std::move(columns)), options_(std::move(options)) {
  if (columns_.empty()) fail("MDS writer for '{}': no columns", dir_);
  std::sort(columns_.begin(), columns_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (size_t i = 0; i < columns_.size(); ++i) {
    if (i > 0 && columns_[i].name == columns_[i - 1].name) fail("MDS writer: column '{}' is given twice", columns_[i].name);
    if (!is_mds_encoding(columns_[i].encoding)) {
      fail("MDS column '{}': unsupported encoding '{}' (int8..int64, uint8..uint64, int, float32, float64, "
           "str, bytes, json, ndarray[:DTYPE[:SHAPE]])",
           columns_[i].name, columns_[i].encoding);
    }
    sizes_.push_back(fixed_size(columns_[i].encoding));
  }
  if (!options_.compression.empty()) (void)zstd_level(options_.compression);
  if (options_.size_limit && *options_.size_limit <= 0) fail("MDS size_limit must be > 0");
  if (options_.size_limit && static_cast<uint64_t>(*options_.size_limit) > kMaxShardBytes) {
    fail("MDS size_limit {} is more than a shard can hold ({} bytes: its offsets are uint32)", *options_.size_limit,
         kMaxShardBytes);
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail("cannot create MDS directory '{}': {}", dir_, ec.message());
  if (fs::exists(fs::path(dir_) / "index.json")) fail("MDS directory '{}' already holds an index.json", dir_);
}

// No implicit finish: a writer dropped by an error leaves no index.json, so a half-written
// conversion is never mistaken for a complete data set.
MdsWriter::~MdsWriter() {
  if (!finished_ && (!pending_.empty() || !shard_entries_.empty())) {
    spdlog::warn("MDS writer for '{}' was not finished: no index.json written", dir_);
  }
}

std::string MdsWriter::shard_config_json() const {
  nlohmann::json names = nlohmann::json::array(), encodings = nlohmann::json::array(), sizes = nlohmann::json::array();
  for (size_t i = 0; i < columns_.size(); ++i) {
    names.push_back(columns_[i].name);
    encodings.push_back(columns_[i].encoding);
    sizes.push_back(sizes_[i] ? nlohmann::json(*sizes_[i]) : nlohmann::json());
  }
  // nlohmann's default object keeps keys sorted, as json.dumps(sort_keys=True) does.
  nlohmann::json config = {{"column_encodings", encodings},
                           {"column_names", names},
                           {"column_sizes", sizes},
                           {"compression", options_.compression.empty() ? nlohmann::json() : nlohmann::json(options_.compression)},
                           {"format", "mds"},
                           {"hashes", nlohmann::json::array()},
                           {"size_limit", options_.size_limit ? nlohmann::json(*options_.size_limit) : nlohmann::json()},
                           {"version", 2}};
  return python_json_text(config);
}

void MdsWriter::write(const MdsSample& sample) {
  if (finished_) fail("MDS writer for '{}': write after finish", dir_);
  std::string head, body;
  for (size_t i = 0; i < columns_.size(); ++i) {
    auto it = sample.find(columns_[i].name);
    if (it == sample.end()) fail("MDS sample {} lacks column '{}'", pending_.size(), columns_[i].name);
    std::string datum = encode_value(columns_[i], it->second);
    if (!sizes_[i]) put(head, static_cast<uint32_t>(datum.size()));
    body += datum;
  }
  for (const auto& [name, value] : sample) {
    // (a structured binding cannot be captured in C++17: clang refuses it)
    if (std::none_of(columns_.begin(), columns_.end(), [&column = name](const auto& c) { return c.name == column; })) {
      fail("MDS sample has a field '{}' that is no column of the dataset", name);
    }
  }
  std::string encoded = head + body;
  // As MDSWriter does: start a new shard when this sample would take the shard file past the
  // limit. The file with it would hold 4 (count) + 4 * (n + 2) (offsets) + the config + the
  // samples: MDSWriter counts 8 + config per shard and 4 + bytes per sample, and a shard may
  // reach the limit exactly.
  const int64_t header = 8 + static_cast<int64_t>(shard_config_json().size());
  if (options_.size_limit && !pending_.empty() &&
      header + pending_bytes_ + 4 * static_cast<int64_t>(pending_.size()) + static_cast<int64_t>(encoded.size()) + 4 >
          *options_.size_limit) {
    flush_shard();
  }
  pending_bytes_ += static_cast<int64_t>(encoded.size());
  pending_.push_back(std::move(encoded));
}

void MdsWriter::flush_shard() {
  if (pending_.empty()) return;
  const std::string config = shard_config_json();
  const auto n = static_cast<uint32_t>(pending_.size());
  const uint64_t start = 4 + 4 * (uint64_t{n} + 1) + config.size();
  if (start + static_cast<uint64_t>(pending_bytes_) > 0xffffffffull) {
    fail("MDS shard of '{}' would exceed 4 GiB (uint32 offsets); set a smaller size_limit", dir_);
  }
  std::string data;
  data.reserve(start + pending_bytes_);
  put(data, n);
  uint64_t offset = start;
  put(data, static_cast<uint32_t>(offset));
  for (const auto& s : pending_) {
    offset += s.size();
    put(data, static_cast<uint32_t>(offset));
  }
  data += config;
  for (const auto& s : pending_) data += s;

  const std::string basename = fmt::format("shard.{:05d}.mds", shard_entries_.size());
  nlohmann::json entry = nlohmann::json::parse(config);
  entry["samples"] = n;
  entry["raw_data"] = {{"basename", basename}, {"bytes", data.size()}, {"hashes", nlohmann::json::object()}};
  if (options_.compression.empty()) {
    write_file_atomically((fs::path(dir_) / basename).string(), data);
    entry["zip_data"] = nullptr;
  } else {
    std::string zipped(ZSTD_compressBound(data.size()), '\0');
    const size_t z = ZSTD_compress(zipped.data(), zipped.size(), data.data(), data.size(), zstd_level(options_.compression));
    if (ZSTD_isError(z)) fail("zstd compression of {} failed: {}", basename, ZSTD_getErrorName(z));
    zipped.resize(z);
    const std::string zip_name = basename + ".zstd";
    write_file_atomically((fs::path(dir_) / zip_name).string(), zipped);
    entry["zip_data"] = {{"basename", zip_name}, {"bytes", zipped.size()}, {"hashes", nlohmann::json::object()}};
  }
  shard_entries_.push_back(entry.dump());
  pending_.clear();
  pending_bytes_ = 0;
}

void MdsWriter::finish() {
  if (finished_) return;
  finished_ = true;
  flush_shard();
  nlohmann::json index = {{"version", 2}, {"shards", nlohmann::json::array()}};
  for (const auto& e : shard_entries_) index["shards"].push_back(nlohmann::json::parse(e));
  write_file_atomically((fs::path(dir_) / "index.json").string(), index.dump(4) + "\n");
}

// ---------------------------------------------------------------------------------------
// Reader

namespace {

// A string of index.json for a message: at most a few dozen characters of it, quoted.
std::string excerpt(const std::string& text) { return json_excerpt(nlohmann::json(text)); }

// The non-negative integer index.json holds at object[key] (`name`: the key as a message
// names it, e.g. raw_data.bytes). A missing key, a float, a negative number or one above `max`
// is an error naming the file, the shard and the key.
uint64_t index_count(const nlohmann::json& object, const char* key, const std::string& name, const std::string& where,
                     uint64_t max, const char* why_max) {
  const auto it = object.find(key);
  if (it == object.end()) fail("{}: '{}' is missing", where, name);
  if (!it->is_number_unsigned()) fail("{}: '{}' must be a non-negative integer, got {}", where, name, json_excerpt(*it));
  const uint64_t value = it->get<uint64_t>();
  if (value > max) fail("{}: '{}' is {}, more than {} ({})", where, name, value, max, why_max);
  return value;
}

// DIR/BASENAME for a shard's raw_data or zip_data basename, refused unless it stays inside DIR:
// a relative path without '..' whose real path (symlinks resolved) lies under DIR's real path.
// Without this a hostile index.json makes replica read any file of the machine as a shard.
// (Basenames may name subdirectories: streaming's merge_index writes "part0/shard.00000.mds".)
std::string shard_file(const std::string& dir, const nlohmann::json& entry, const char* key, const std::string& where) {
  const auto& data = entry.at(key);
  if (!data.is_object() || !data.contains("basename") || !data.at("basename").is_string()) {
    fail("{}: '{}' must be an object with a 'basename' string", where, key);
  }
  const std::string basename = data.at("basename").get<std::string>();
  const fs::path relative(basename);
  bool escapes = basename.empty() || relative.has_root_path();
  for (const auto& part : relative) escapes = escapes || part == "..";
  if (escapes) fail("{}: {}.basename {} is outside the data directory '{}'", where, key, excerpt(basename), dir);
  std::error_code ec_root, ec_file;
  const fs::path root = fs::weakly_canonical(dir, ec_root);
  const fs::path real = fs::weakly_canonical(fs::path(dir) / relative, ec_file);
  if (ec_root || ec_file) {
    fail("{}: cannot resolve {}.basename {}: {}", where, key, excerpt(basename), (ec_root ? ec_root : ec_file).message());
  }
  auto [in_root, in_real] = std::mismatch(root.begin(), root.end(), real.begin(), real.end());
  if (in_root != root.end() || in_real == real.end()) {
    fail("{}: {}.basename {} resolves to '{}', outside the data directory '{}'", where, key, excerpt(basename),
         real.string(), root.string());
  }
  return (fs::path(dir) / relative).string();
}

// The length of a shard file, which must be a regular file (core/files.h: a FIFO or a device is
// refused without being read, so it never blocks), for the checks against index.json.
uint64_t shard_file_length(const std::string& file, const std::string& where) {
  try {
    return RegularFile(file).size();
  } catch (const Error& e) {
    fail("{}: {}", where, e.what());
  }
}

// Decompresses a zstd shard into at most `raw_bytes` bytes (index.json's raw_data.bytes, itself
// at most kMaxShardBytes). A frame that declares its size must declare exactly that, checked
// before anything is allocated; a frame without a declared size (or several frames) is
// decompressed by streaming in 1 MiB steps and stopped as soon as it would pass the bound, so a
// shard that expands to 64 GiB costs at most raw_bytes of memory.
std::shared_ptr<std::string> decompress_shard(const std::string& zip_path, uint64_t zip_bytes, uint64_t raw_bytes) {
  const std::string zipped = read_file(zip_path, zip_bytes);
  const unsigned long long declared = ZSTD_getFrameContentSize(zipped.data(), zipped.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR) fail("MDS shard '{}' is not zstd data", zip_path);
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != raw_bytes) {
    fail("MDS shard '{}' declares {} decompressed bytes, but index.json's raw_data.bytes says {}", zip_path, declared,
         raw_bytes);
  }
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> context(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!context) fail("MDS shard '{}': cannot create a zstd decompression context", zip_path);
  auto out = std::make_shared<std::string>();
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN) out->reserve(raw_bytes);
  std::string step(std::size_t{1} << 20, '\0');
  ZSTD_inBuffer in{zipped.data(), zipped.size(), 0};
  for (;;) {
    ZSTD_outBuffer o{step.data(), step.size(), 0};
    const size_t left = ZSTD_decompressStream(context.get(), &o, &in);
    if (ZSTD_isError(left)) fail("MDS shard '{}': zstd decompression failed: {}", zip_path, ZSTD_getErrorName(left));
    if (out->size() + o.pos > raw_bytes) {
      fail("MDS shard '{}' decompresses to more than the {} bytes index.json's raw_data.bytes says", zip_path, raw_bytes);
    }
    out->append(step.data(), o.pos);
    if (left == 0 && in.pos == in.size) break;  // every frame decoded and flushed
    // All input consumed, yet the decoder neither finished nor filled the output: cut off.
    if (in.pos == in.size && o.pos < o.size) fail("MDS shard '{}': the zstd data is truncated", zip_path);
  }
  if (out->size() != raw_bytes) {
    fail("MDS shard '{}' decompresses to {} bytes, but index.json's raw_data.bytes says {}", zip_path, out->size(),
         raw_bytes);
  }
  return out;
}

}  // namespace

MdsDataset::MdsDataset(const std::string& path) {
  fs::path index_path = path;
  if (fs::is_directory(index_path) || index_path.filename() != "index.json") index_path /= "index.json";
  dir_ = index_path.parent_path().empty() ? "." : index_path.parent_path().string();
  const std::string where = index_path.string();
  if (!fs::exists(index_path)) fail("MDS index '{}' does not exist", where);
  const nlohmann::json index = parse_json(read_file(where, kMaxIndexBytes), where);
  try {
    if (index.value("version", 0) != 2) fail("{}: index version {} (MDS index version 2 is supported)", where, index.value("version", 0));
    const auto& shards = index.at("shards");
    if (!shards.is_array() || shards.empty()) fail("{}: 'shards' must be a non-empty list", where);
    for (size_t s = 0; s < shards.size(); ++s) {
      const auto& e = shards[s];
      const std::string shard_where = fmt::format("{}: shard {}", where, s);
      if (!e.is_object()) fail("{}: must be an object, got {}", shard_where, json_excerpt(e));
      if (e.value("format", std::string()) != "mds") fail("{}: format {} (only mds is read)", shard_where, excerpt(e.value("format", std::string("?"))));
      std::vector<MdsColumn> cols;
      const auto names = e.at("column_names").get<std::vector<std::string>>();
      const auto encs = e.at("column_encodings").get<std::vector<std::string>>();
      if (names.size() != encs.size()) fail("{}: column_names and column_encodings differ in length", shard_where);
      for (size_t i = 0; i < names.size(); ++i) {
        if (!is_mds_encoding(encs[i])) fail("{}: column {} has unsupported encoding {}", shard_where, excerpt(names[i]), excerpt(encs[i]));
        cols.push_back({names[i], encs[i]});
      }
      if (s == 0) {
        columns_ = cols;
        for (const auto& c : columns_) sizes_.push_back(fixed_size(c.encoding));
      } else if (cols.size() != columns_.size() ||
                 !std::equal(cols.begin(), cols.end(), columns_.begin(),
                             [](const auto& a, const auto& b) { return a.name == b.name && a.encoding == b.encoding; })) {
        fail("{}: columns differ from shard 0's", shard_where);
      }
      // column_sizes is what the encodings imply (MDSWriter writes them from the encodings); the
      // reader uses the encodings' sizes, bounded by parse_ndarray, and refuses an index whose
      // column_sizes say otherwise rather than guess which is right.
      if (e.contains("column_sizes")) {
        const auto& sizes = e.at("column_sizes");
        if (!sizes.is_array() || sizes.size() != cols.size()) fail("{}: 'column_sizes' must list one size per column", shard_where);
        for (size_t i = 0; i < cols.size(); ++i) {
          const std::optional<int64_t> want = fixed_size(cols[i].encoding);
          const bool same = want ? sizes[i].is_number_unsigned() && sizes[i].get<uint64_t>() == static_cast<uint64_t>(*want)
                                 : sizes[i].is_null();
          if (!same) {
            fail("{}: 'column_sizes' gives column {} ({}) size {}, its encoding has {}", shard_where, excerpt(cols[i].name),
                 cols[i].encoding, json_excerpt(sizes[i]), want ? std::to_string(*want) : std::string("none (variable)"));
          }
        }
      }
      if (e.contains("size_limit") && !e.at("size_limit").is_null() &&
          !(e.at("size_limit").is_number_unsigned() && e.at("size_limit").get<uint64_t>() > 0)) {
        fail("{}: 'size_limit' must be a positive integer or null, got {}", shard_where, json_excerpt(e.at("size_limit")));
      }
      const auto compression = e.value("compression", nlohmann::json());
      if (!compression.is_null()) {
        if (!compression.is_string()) fail("{}: 'compression' must be a string or null", shard_where);
        const std::string c = compression.get<std::string>();
        if (c != "zstd" && c.rfind("zstd:", 0) != 0) fail("{}: compression {} (only zstd is read)", shard_where, excerpt(c));
      }

      Shard shard;
      shard.first = total_;
      shard.raw_path = shard_file(dir_, e, "raw_data", shard_where);
      const auto zip = e.value("zip_data", nlohmann::json());
      if (!zip.is_null()) shard.zip_path = shard_file(dir_, e, "zip_data", shard_where);
      // A raw shard on disk wins (streaming keeps both when keep_zip is set).
      std::error_code ec;
      shard.compressed = !fs::exists(shard.raw_path, ec) && !shard.zip_path.empty();
      if (!shard.compressed && !fs::exists(shard.raw_path, ec)) fail("{}: shard file '{}' does not exist", shard_where, shard.raw_path);
      if (shard.compressed && !fs::exists(shard.zip_path, ec)) fail("{}: shard file '{}' does not exist", shard_where, shard.zip_path);
      // Note [MDS sizes are checked before they are used]: the sizes index.json declares are
      // the files' lengths (MDSWriter writes len() of what it wrote).
      const auto& raw = e.at("raw_data");
      if (!shard.compressed) {
        const uint64_t length = shard_file_length(shard.raw_path, shard_where);
        const uint64_t declared = index_count(raw, "bytes", "raw_data.bytes", shard_where, kMaxShardBytes, "a shard's offsets are uint32");
        if (declared != length) {
          fail("{}: 'raw_data.bytes' is {}, but '{}' is {} bytes", shard_where, declared, shard.raw_path, length);
        }
        shard.raw_bytes = length;
      } else {
        const uint64_t length = shard_file_length(shard.zip_path, shard_where);
        const uint64_t declared = index_count(zip, "bytes", "zip_data.bytes", shard_where, UINT64_MAX, "");
        if (declared != length) {
          fail("{}: 'zip_data.bytes' is {}, but '{}' is {} bytes", shard_where, declared, shard.zip_path, length);
        }
        shard.zip_bytes = length;
        shard.raw_bytes = index_count(raw, "bytes", "raw_data.bytes", shard_where, kMaxShardBytes, "a shard's offsets are uint32");
      }
      // A shard of n samples starts with its count and n + 1 offsets: 4 * (n + 2) bytes.
      const uint64_t samples = index_count(e, "samples", "samples", shard_where, UINT64_MAX, "");
      const uint64_t header = samples > UINT64_MAX / 4 - 2 ? UINT64_MAX : 4 * (samples + 2);
      if (header > shard.raw_bytes) {
        fail("{}: 'samples' is {}, whose count and offsets take {} bytes, but the shard{} is {} bytes", shard_where,
             samples, header, shard.compressed ? " (raw_data.bytes, decompressed)" : fmt::format(" '{}'", shard.raw_path),
             shard.raw_bytes);
      }
      shard.samples = static_cast<int64_t>(samples);
      total_ += shard.samples;
      shards_.push_back(std::move(shard));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed MDS index: {}", where, e.what());
  }
}

bool MdsDataset::has_column(const std::string& name) const {
  return std::any_of(columns_.begin(), columns_.end(), [&](const auto& c) { return c.name == name; });
}

std::string MdsDataset::sample_bytes(int64_t index, const Shard** shard_out) const {
  if (index < 0 || index >= total_) fail("MDS '{}': sample {} is out of range (size {})", dir_, index, total_);
  auto it = std::upper_bound(shards_.begin(), shards_.end(), index, [](int64_t i, const Shard& s) { return i < s.first; });
  const Shard& shard = *(it - 1);
  *shard_out = &shard;
  const auto local = static_cast<uint64_t>(index - shard.first);
  const uint64_t header = 4 * (static_cast<uint64_t>(shard.samples) + 2);  // count and offsets
  if (shard.compressed) {
    std::shared_ptr<std::string> data;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!shard.decompressed) {
        auto d = decompress_shard(shard.zip_path, shard.zip_bytes, shard.raw_bytes);
        if (get_le<uint32_t>(d->data()) != static_cast<uint32_t>(shard.samples)) {
          fail("MDS shard '{}': header does not match index.json ({} samples)", shard.zip_path, shard.samples);
        }
        shard.decompressed = std::move(d);
      }
      data = shard.decompressed;
    }
    const std::string& d = *data;  // raw_bytes long, at least `header` (checked when opened)
    const size_t pos = 4 + 4 * static_cast<size_t>(local);
    const uint32_t begin = get_le<uint32_t>(d.data() + pos), end = get_le<uint32_t>(d.data() + pos + 4);
    if (begin < header || begin > end || end > d.size()) fail("'{}': sample {} has bad offsets {}..{}", shard.zip_path, local, begin, end);
    return d.substr(begin, end - begin);
  }
  // Opened per sample (a data set may have more shards than a process may hold files open),
  // as a RegularFile: a shard replaced by a FIFO since the index was read is refused, not waited on.
  const RegularFile file(shard.raw_path);
  auto read_at = [&](void* buf, size_t n, uint64_t at) {
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(file.fd(), static_cast<char*>(buf) + done, n - done, static_cast<off_t>(at + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      done += static_cast<size_t>(got);
    }
    return true;
  };
  uint32_t head[2];
  uint32_t count = 0;
  if (file.size() < header || !read_at(&count, 4, 0) || count != static_cast<uint32_t>(shard.samples) ||
      !read_at(head, 8, 4 + 4 * local)) {
    fail("MDS shard '{}': header does not match index.json ({} samples)", shard.raw_path, shard.samples);
  }
  // The offsets are checked against the file's length before the sample's bytes are allocated.
  if (head[0] < header || head[0] > head[1] || head[1] > file.size()) {
    fail("MDS shard '{}': sample {} (offsets {}..{}) lies outside the file's {} bytes", shard.raw_path, local, head[0],
         head[1], file.size());
  }
  std::string bytes(head[1] - head[0], '\0');
  if (!read_at(bytes.data(), bytes.size(), head[0])) {
    fail("MDS shard '{}': sample {} (offsets {}..{}) is truncated", shard.raw_path, local, head[0], head[1]);
  }
  return bytes;
}

MdsSample MdsDataset::decode(const std::string& bytes, const Shard& shard, int64_t index) const {
  const std::string where = fmt::format("MDS shard '{}' sample {}", shard.compressed ? shard.zip_path : shard.raw_path,
                                        index - shard.first);
  size_t variable = 0;
  for (const auto& s : sizes_) variable += s ? 0 : 1;
  if (bytes.size() < 4 * variable) fail("{}: truncated", where);
  size_t head = 0, pos = 4 * variable;
  MdsSample sample;
  for (size_t i = 0; i < columns_.size(); ++i) {
    size_t n = 0;
    if (sizes_[i]) {
      n = static_cast<size_t>(*sizes_[i]);
    } else {
      n = get_le<uint32_t>(bytes.data() + 4 * head++);
    }
    if (pos + n > bytes.size()) fail("{}: column '{}' runs past the sample's end", where, columns_[i].name);
    sample.emplace(columns_[i].name, decode_value(columns_[i], bytes.data() + pos, n, where));
    pos += n;
  }
  if (pos != bytes.size()) fail("{}: {} bytes left over after the last column", where, bytes.size() - pos);
  return sample;
}

MdsSample MdsDataset::get(int64_t index) const {
  const Shard* shard = nullptr;
  const std::string bytes = sample_bytes(index, &shard);
  return decode(bytes, *shard, index);
}

torch::Tensor MdsDataset::int_column(const std::string& column, const std::vector<int64_t>& indices) const {
  if (!has_column(column)) fail("MDS '{}' has no column '{}'", dir_, column);
  torch::Tensor out = torch::empty({static_cast<int64_t>(indices.size())}, torch::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < indices.size(); ++i) {
    const MdsSample s = get(indices[i]);
    const auto* v = std::get_if<int64_t>(&s.at(column));
    if (v == nullptr) fail("MDS '{}': column '{}' is not an integer column", dir_, column);
    p[i] = *v;
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// JSONL / CSV -> MDS

int64_t convert_records_to_mds(const std::string& input, const std::string& out_dir,
                               const std::vector<MdsColumn>& columns, const MdsWriterOptions& options) {
  const std::string file = fs::is_directory(input) ? resolve_records_file(input, "train") : input;
  const auto records = read_records(file);
  MdsWriter writer(out_dir, columns, options);
  for (size_t r = 0; r < records.size(); ++r) {
    const auto& rec = records[r];
    const std::string where = fmt::format("{}: record {}", file, r + 1);
    MdsSample sample;
    for (const auto& col : columns) {
      if (!rec.contains(col.name)) fail("{}: field '{}' is missing", where, col.name);
      const auto& v = rec.at(col.name);
      try {
        if (const auto* s = find_scalar(col.encoding)) {
          // CSV cells are strings: numbers are parsed from them.
          if (v.is_string()) {
            const std::string text = v.get<std::string>();
            size_t used = 0;
            if (s->is_float) {
              sample[col.name] = std::stod(text, &used);
            } else {
              sample[col.name] = static_cast<int64_t>(std::stoll(text, &used));
            }
            if (used != text.size()) throw std::invalid_argument(text);
          } else if (s->is_float && v.is_number()) {
            sample[col.name] = v.get<double>();
          } else if (v.is_number_integer()) {
            sample[col.name] = v.get<int64_t>();
          } else {
            throw std::invalid_argument("not a number");
          }
        } else if (col.encoding == "json") {
          sample[col.name] = v.is_string() ? v.get<std::string>() : v.dump();
        } else if (col.encoding == "str" || col.encoding == "bytes") {
          sample[col.name] = v.is_string() ? v.get<std::string>() : v.dump();
        } else {
          // ndarray: a JSON list of numbers (or its text in a CSV cell), stored as its dtype.
          auto nd = parse_ndarray(col.encoding);
          const nlohmann::json list =
              v.is_string() ? parse_json(v.get<std::string>(), fmt::format("{}: field '{}'", where, col.name)) : v;
          if (!list.is_array()) throw std::invalid_argument("not a list");
          const DtypeCode* code = dtype_by_name(nd->dtype.value_or("float32"));
          if (!code->torch_type) fail("{}: column '{}': dtype {} is not supported for conversion", where, col.name, code->name);
          torch::Tensor t = torch::tensor(list.get<std::vector<double>>(), torch::kDouble).to(*code->torch_type);
          if (nd->shape) t = t.reshape(*nd->shape);
          sample[col.name] = t;
        }
      } catch (const replica::Error&) {
        throw;
      } catch (const std::exception&) {
        fail("{}: field '{}' value {} does not fit encoding {}", where, col.name, json_excerpt(v), col.encoding);
      }
    }
    try {
      writer.write(sample);
    } catch (const replica::Error& e) {
      fail("{}: {}", where, e.what());
    }
  }
  writer.finish();
  return static_cast<int64_t>(records.size());
}

}  // namespace replica::data
