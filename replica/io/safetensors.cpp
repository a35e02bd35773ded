#include "replica/io/safetensors.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/json.h"
#include "replica/core/suggest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

// The format stores little-endian data and we copy it byte for byte into tensors.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace replica::io {
namespace {

// The reference implementation refuses headers above 100 MB; so do we, which also keeps a
// lying length field from making us allocate the whole file for the JSON parser.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeInfo {
  const char* name;
  torch::ScalarType type;
  uint64_t bytes;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", torch::kFloat64, 8},   {"F32", torch::kFloat32, 4}, {"F16", torch::kFloat16, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kInt64, 8},   {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},     {"I8", torch::kInt8, 1},     {"U8", torch::kUInt8, 1},
    {"BOOL", torch::kBool, 1},
};

const DtypeInfo* dtype_by_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

const DtypeInfo* dtype_by_type(torch::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (type == d.type) return &d;
  }
  return nullptr;
}

std::string supported_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) {
    if (!out.empty()) out += ' ';
    out += d.name;
  }
  return out;
}

// A name or key from the file as a message shows it: the header may hold a 100 MB name.
std::string shown(const std::string& text) {
  constexpr size_t kMaxShown = 120;
  return text.size() <= kMaxShown ? text : text.substr(0, kMaxShown) + "...";
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Closes the descriptor on every path out, including exceptions.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { close(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int close() {
    int rc = 0;
    if (fd_ >= 0) rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path, std::strerror(errno));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

// Reads exactly `size` bytes at `offset`; a short read means the file changed under us.
void read_all(int fd, void* data, size_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: read failed: {}", path, std::strerror(errno));
    }
    if (n == 0) fail("{}: unexpected end of file at byte {}", path, offset);
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// One header entry after validation.
struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

// Parses and checks one tensor entry of the header against the data section size.
Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& value,
                  uint64_t data_size) {
  auto bad = [&](const std::string& what) -> Error {
    return Error(fmt::format("{}: tensor '{}': {}", path, shown(name), what));
  };
  if (!value.is_object()) throw bad("header entry is not a JSON object");

  Entry e{name, nullptr, {}, 0, 0};
  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end() || !dtype_it->is_string()) throw bad("missing string field 'dtype'");
  const auto dtype_name = dtype_it->get<std::string>();
  e.dtype = dtype_by_name(dtype_name);
  if (e.dtype == nullptr) {
    throw bad(fmt::format("unsupported dtype '{}' (supported: {})", shown(dtype_name), supported_dtypes()));
  }

  auto shape_it = value.find("shape");
  if (shape_it == value.end() || !shape_it->is_array()) throw bad("missing list field 'shape'");
  std::vector<uint64_t> dims;
  for (const auto& dim : *shape_it) {
    if (dim.is_number_integer() && !dim.is_number_unsigned()) {
      throw bad(fmt::format("negative dimension {} in shape", dim.get<int64_t>()));
    }
    if (!dim.is_number_unsigned()) throw bad(fmt::format("shape entry {} is not an integer", json_excerpt(dim)));
    dims.push_back(dim.get<uint64_t>());
  }
  // The product of max(dim, 1) must fit int64, or LibTorch's stride arithmetic overflows even
  // for tensors with a zero dimension.
  uint64_t extent = 1;
  uint64_t numel = 1;
  for (uint64_t d : dims) {
    if (__builtin_mul_overflow(extent, std::max<uint64_t>(d, 1), &extent) ||
        extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw bad(fmt::format("shape {} is too large", json_excerpt(*shape_it)));
    }
    numel *= d;  // cannot overflow: numel <= extent
    e.shape.push_back(static_cast<int64_t>(d));
  }
  uint64_t expected_bytes = 0;
  if (__builtin_mul_overflow(numel, e.dtype->bytes, &expected_bytes)) {
    throw bad(fmt::format("shape {} is too large", shape_text(e.shape)));
  }

  auto off_it = value.find("data_offsets");
  if (off_it == value.end() || !off_it->is_array() || off_it->size() != 2 ||
      !(*off_it)[0].is_number_unsigned() || !(*off_it)[1].is_number_unsigned()) {
    throw bad("'data_offsets' must be a list of two non-negative integers");
  }
  e.begin = (*off_it)[0].get<uint64_t>();
  e.end = (*off_it)[1].get<uint64_t>();
  if (e.end < e.begin) {
    throw bad(fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));
  }
  if (e.end > data_size) {
    throw bad(fmt::format("data_offsets [{}, {}] reach past the end of the data ({} bytes)", e.begin, e.end,
                          data_size));
  }
  if (e.end - e.begin != expected_bytes) {
    throw bad(fmt::format("data_offsets [{}, {}] do not match shape {} of {} ({} bytes)", e.begin, e.end,
                          shape_text(e.shape), e.dtype->name, expected_bytes));
  }
  return e;
}

}  // namespace

const torch::Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  std::vector<std::string> names;
  for (const auto& entry : tensors) names.push_back(entry.first);
  auto suggestion = did_you_mean(name, names);
  fail("{}: no tensor named '{}'{}", path, name,
       suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion));
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const auto& e) { return e.first == name; });
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Resolve every tensor to contiguous CPU memory first, so that a bad tensor fails before
  // anything touches the disk. CUDA tensors are copied to the host like the reference does.
  std::vector<torch::Tensor> data;
  data.reserve(tensors.size());
  std::set<std::string> seen;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") fail("{}: '__metadata__' is reserved and cannot name a tensor", path);
    if (!seen.insert(name).second) fail("{}: tensor '{}' is given twice", path, name);
    if (!tensor.defined()) fail("{}: tensor '{}' is undefined", path, name);
    if (tensor.layout() != torch::kStrided) fail("{}: tensor '{}' is not a dense tensor", path, name);
    if (tensor.device().is_meta()) fail("{}: tensor '{}' is a meta tensor and has no data", path, name);
    const DtypeInfo* dtype = dtype_by_type(tensor.scalar_type());
    if (dtype == nullptr) {
      fail("{}: tensor '{}' has dtype {}, which safetensors I/O does not support (supported: {})", path, name,
           c10::toString(tensor.scalar_type()), supported_dtypes());
    }
    torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype->bytes;
    header[name] = {
        {"dtype", dtype->name}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(t));
  }
  std::string header_text = header.dump();
  // Spaces after the JSON keep the data section 8-byte aligned, as the reference writer does.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_len = header_text.size();

  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail("{}: cannot create {}: {}", path, tmp, std::strerror(errno));
  try {
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(header_len >> (8 * i));
    write_all(fd.get(), len_bytes, sizeof(len_bytes), tmp);
    write_all(fd.get(), header_text.data(), header_text.size(), tmp);
    for (const auto& t : data) {
      write_all(fd.get(), t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size(), tmp);
    }
    if (::fsync(fd.get()) != 0) fail("{}: fsync failed: {}", tmp, std::strerror(errno));
    if (fd.close() != 0) fail("{}: close failed: {}", tmp, std::strerror(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      fail("{}: cannot rename {} into place: {}", path, tmp, std::strerror(errno));
    }
  } catch (...) {
    fd.close();
    ::unlink(tmp.c_str());
    throw;
  }
  // The rename is only durable once the directory entry is on disk.
  const std::string dir = parent_dir(path);
  Fd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || ::fsync(dir_fd.get()) != 0) {
    fail("{}: cannot sync directory {}: {}", path, dir, std::strerror(errno));
  }
}

namespace {

// A file's header, checked: entries sorted by offset, covering the data section exactly.
struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
};

// Thrown from the parser's callback: stops the parse before a deeper level is built.
struct HeaderTooDeep {};

Header read_header(const RegularFile& file, const std::string& path) {
  const uint64_t file_size = file.size();
  if (file_size < 8) {
    fail("{}: file is {} bytes, too short for a safetensors header (8 bytes)", path, file_size);
  }
  unsigned char len_bytes[8];
  read_all(file.fd(), len_bytes, sizeof(len_bytes), 0, path);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (header_len > file_size - 8) {
    fail("{}: header length {} is larger than the rest of the file ({} bytes)", path, header_len,
         file_size - 8);
  }
  if (header_len > kMaxHeaderBytes) {
    fail("{}: header length {} exceeds the {} byte limit", path, header_len, kMaxHeaderBytes);
  }
  Header out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = file_size - out.data_start;

  std::string header_text(header_len, '\0');
  read_all(file.fd(), header_text.data(), header_text.size(), 8, path);

  // nlohmann::json keeps the last of duplicate keys silently (the reference rejects them);
  // the callback sees every key as it is parsed, one set of keys per open object. It also
  // bounds the nesting as core/json.h's parse_json does (a header's shape nested 500,000 deep
  // would parse, then overflow the stack in whatever walks it).
  std::vector<std::set<std::string>> open_objects;
  std::string tensor;     // the top-level key being parsed
  std::string duplicate;  // the first duplicate, as a message
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if ((event == Event::object_start || event == Event::array_start) && depth >= kMaxJsonDepth) {
      throw HeaderTooDeep{};
    }
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end && !open_objects.empty()) open_objects.pop_back();
    if (event == Event::key && !open_objects.empty() && duplicate.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (open_objects.size() == 1) tensor = key;
      if (!open_objects.back().insert(key).second) {
        duplicate = open_objects.size() == 1
                        ? fmt::format("tensor '{}' appears twice in the header", shown(key))
                        : fmt::format("'{}': key '{}' appears twice", shown(tensor), shown(key));
      }
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text, on_event);
  } catch (const HeaderTooDeep&) {
    fail("{}: header JSON nested more than {} levels deep", path, kMaxJsonDepth);
  } catch (const nlohmann::json::exception& e) {
    std::string reason = e.what();
    if (reason.size() > 200) reason = reason.substr(0, 200) + "...";
    fail("{}: header is not valid JSON: {}", path, reason);
  }
  if (!header.is_object()) fail("{}: header is not a JSON object", path);
  if (!duplicate.empty()) fail("{}: {}", path, duplicate);

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail("{}: '__metadata__' is not a JSON object", path);
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) fail("{}: '__metadata__' value for '{}' is not a string", path, shown(key));
        out.metadata[key] = text.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(path, name, value, data_size));
  }

  // The data section must be exactly covered: no overlaps, no holes, nothing trailing.
  std::sort(out.entries.begin(), out.entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const auto& e : out.entries) {
    if (e.begin < covered) {
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path, shown(e.name), e.begin,
           e.end, shown(previous->name), previous->begin, previous->end);
    }
    if (e.begin > covered) {
      fail("{}: tensor '{}': data_offsets [{}, {}] leave a gap of {} unused bytes before it", path, shown(e.name),
           e.begin, e.end, e.begin - covered);
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size) {
    fail("{}: {} bytes after the last tensor's data are not covered by any tensor", path,
         data_size - covered);
  }
  return out;
}

// Note [finite weights]
// A NaN or an infinity in a weight, an adapter or an optimizer state read from a file is never
// what anyone trained: it turns every loss it touches into NaN, which is then noticed (if at
// all) steps later with no hint of its cause. Every load of a floating tensor goes through
// load_safetensors, so the check is made there, once, naming the file and the tensor. It reads
// the tensor in pieces, so the mask it builds stays small however large the tensor is.
void require_finite(const torch::Tensor& t, const std::string& path, const std::string& name) {
  if (!t.is_floating_point() || t.numel() == 0) return;
  constexpr int64_t kPiece = int64_t{1} << 22;
  const torch::Tensor flat = t.reshape({-1});
  for (int64_t begin = 0; begin < flat.numel(); begin += kPiece) {
    const torch::Tensor piece = flat.narrow(0, begin, std::min(kPiece, flat.numel() - begin));
    const torch::Tensor finite = torch::isfinite(piece);
    if (finite.all().item<bool>()) continue;
    const int64_t at = torch::logical_not(finite).nonzero()[0][0].item<int64_t>();
    const double value = piece[at].item<double>();
    fail("{}: tensor '{}' holds {} at element {} (of shape {}): replica refuses non-finite weights and state",
         path, shown(name), std::isnan(value) ? "NaN" : value > 0 ? "+inf" : "-inf", begin + at,
         shape_text(t.sizes().vec()));
  }
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path, NonFinite non_finite) {
  const RegularFile file(path);  // O_NONBLOCK open, regular files only: a FIFO never blocks
  const Header header = read_header(file, path);

  SafetensorsFile out;
  out.path = path;
  out.metadata = header.metadata;
  out.tensors.reserve(header.entries.size());
  for (const auto& e : header.entries) {
    torch::Tensor t;
    try {
      t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype->type));
    } catch (const c10::Error& err) {
      fail("{}: tensor '{}': cannot allocate shape {}: {}", path, shown(e.name), shape_text(e.shape),
           err.what_without_backtrace());
    }
    read_all(file.fd(), t.data_ptr(), e.end - e.begin, header.data_start + e.begin, path);
    if (e.dtype->type == torch::kBool) {
      // LibTorch assumes bool bytes are 0 or 1; anything else is undefined behaviour.
      const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
      for (uint64_t i = 0; i < e.end - e.begin; ++i) {
        if (bytes[i] > 1) fail("{}: tensor '{}': BOOL byte {} has value {}", path, shown(e.name), i, bytes[i]);
      }
    }
    if (non_finite == NonFinite::kRefuse) require_finite(t, path, e.name);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

std::vector<TensorHeader> read_safetensors_header(const std::string& path) {
  const RegularFile file(path);
  std::vector<TensorHeader> out;
  for (const auto& e : read_header(file, path).entries) out.push_back({e.name, e.dtype->type, e.shape});
  return out;
}

}  // namespace replica::io
