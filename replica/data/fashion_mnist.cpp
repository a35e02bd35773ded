// Fashion-MNIST idx reader. Files are read with zlib's gz* API, which also reads
// uncompressed files transparently, so DIR/name.gz and DIR/name share one code path.
#include "replica/data/fashion_mnist.h"

#include "replica/core/error.h"
#include "replica/core/files.h"

#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace replica::data {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // unsigned byte, 3 dimensions
constexpr uint32_t kLabelsMagic = 0x00000801;  // unsigned byte, 1 dimension
constexpr int64_t kNumClasses = 10;
// A corrupt header must not make us reserve absurd amounts of memory before the
// truncation check can catch it; real idx data sets are far below this.
constexpr uint64_t kMaxPayloadBytes = uint64_t{8} << 30;

const char* const kImagesSuffix = "-images-idx3-ubyte";
const char* const kLabelsSuffix = "-labels-idx1-ubyte";

// Owns a gzFile so every error path closes it.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    // Opened as a RegularFile (core/files.h): a FIFO or a device is refused, never waited on.
    // zlib reads a duplicate of its descriptor and closes that.
    const RegularFile file(path);
    const int fd = ::dup(file.fd());
    if (fd >= 0) file_ = gzdopen(fd, "rb");
    if (file_ == nullptr) {
      if (fd >= 0) ::close(fd);
      fail("fashion-mnist: cannot open {}", path);
    }
    // The default 8 KiB buffer makes inflate noticeably slower on 26 MB inputs.
    gzbuffer(file_, 1 << 20);
  }
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to `size` bytes; returns how many were read (fewer only at end of data).
  // Corrupt compressed data is an error; a cut-off gzip stream just ends early, and the
  // caller reports it as truncated with the byte counts.
  uint64_t read(void* buffer, uint64_t size) {
    auto* out = static_cast<unsigned char*>(buffer);
    uint64_t done = 0;
    while (done < size) {
      // gzread takes an unsigned int and returns int: read in chunks well below INT_MAX.
      const unsigned chunk = static_cast<unsigned>(std::min<uint64_t>(size - done, 1u << 26));
      const int got = gzread(file_, out + done, chunk);
      if (got <= 0) break;
      done += static_cast<uint64_t>(got);
    }
    if (done < size) {
      // A gzip stream cut off mid-way reports Z_BUF_ERROR; anything else is corruption.
      int code = Z_OK;
      const std::string message = zlib_message(&code);
      if (code != Z_OK && code != Z_BUF_ERROR) {
        fail("fashion-mnist: {} is corrupt ({})", path_, message);
      }
    }
    return done;
  }

  // True when nothing follows the bytes read so far. Reading to the end also makes zlib
  // verify the gzip trailer (CRC-32 and length), so a damaged file is caught here.
  bool at_end() {
    unsigned char byte;
    const int got = gzread(file_, &byte, 1);
    if (got > 0) return false;
    int code = Z_OK;
    const std::string message = zlib_message(&code);
    if (code != Z_OK) {
      // A stream cut off right after the payload (no trailer) is truncation, not corruption.
      fail("fashion-mnist: {} is {} ({})", path_,
           code == Z_BUF_ERROR ? "truncated" : "corrupt", message);
    }
    return true;
  }

 private:
  // zlib's last error, without the "PATH: " prefix gzerror puts in front of it.
  std::string zlib_message(int* code) {
    const char* raw = gzerror(file_, code);
    std::string message = raw != nullptr ? raw : "";
    const std::string prefix = path_ + ": ";
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    return message.empty() ? "zlib error" : message;
  }

  std::string path_;
  gzFile file_ = nullptr;
};

uint32_t read_big_endian_u32(const unsigned char* bytes) {
  return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
         uint32_t{bytes[3]};
}

// Splits present in `dir`: names X with an X-images-idx3-ubyte[.gz] file.
std::string list_splits(const std::string& dir) {
  std::set<std::string> splits;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    if (name.size() > 3 && name.compare(name.size() - 3, 3, ".gz") == 0) {
      name.resize(name.size() - 3);
    }
    const std::string suffix = kImagesSuffix;
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      splits.insert(name.substr(0, name.size() - suffix.size()));
    }
  }
  if (splits.empty()) return "none";
  std::string joined;
  for (const auto& split : splits) joined += (joined.empty() ? "" : ", ") + split;
  return joined;
}

// DIR/BASE.gz if present, else DIR/BASE; an error naming both spellings otherwise.
std::string find_file(const std::string& dir, const std::string& split, const std::string& base) {
  const std::string plain = (fs::path(dir) / base).string();
  std::error_code error;
  // Whatever exists under the name is the file: the reader refuses a FIFO or a device naming
  // what it is, rather than this reporting it missing.
  for (const std::string& candidate : {plain + ".gz", plain}) {
    if (fs::exists(fs::symlink_status(candidate, error)) && !fs::is_directory(candidate, error)) return candidate;
  }
  fail("fashion-mnist: no file {}[.gz] (split '{}'; splits in {}: {})", plain, split, dir,
       list_splits(dir));
}

// Reads the idx header: magic then `num_dims` big-endian uint32 sizes.
std::vector<uint32_t> read_header(GzReader& reader, const std::string& path, uint32_t magic,
                                  int num_dims) {
  std::array<unsigned char, 4 * 4> header{};
  const uint64_t header_bytes = 4 * (1 + static_cast<uint64_t>(num_dims));
  const uint64_t got = reader.read(header.data(), header_bytes);
  if (got < header_bytes) {
    fail("fashion-mnist: {} is truncated: {} of the {} header bytes", path, got, header_bytes);
  }
  const uint32_t found_magic = read_big_endian_u32(header.data());
  if (found_magic != magic) {
    fail("fashion-mnist: {} has magic number 0x{:08x}, expected 0x{:08x}", path, found_magic,
         magic);
  }
  std::vector<uint32_t> dims;
  for (int i = 0; i < num_dims; ++i) dims.push_back(read_big_endian_u32(header.data() + 4 * (i + 1)));
  return dims;
}

// Reads exactly `bytes` payload bytes into `out` and checks nothing follows.
void read_payload(GzReader& reader, const std::string& path, void* out, uint64_t bytes) {
  const uint64_t got = reader.read(out, bytes);
  if (got < bytes) {
    fail("fashion-mnist: {} is truncated: {} of the {} data bytes its header announces", path,
         got, bytes);
  }
  if (!reader.at_end()) {
    fail("fashion-mnist: {} has data after the {} bytes its header announces", path, bytes);
  }
}

// A header may announce far more data than the file holds; allocating for it first would let
// a few bytes of input claim gigabytes. Deflate expands at most 1032:1, so no file (plain or
// gzip) of N bytes can supply more than 1032 * N payload bytes.
void check_announced(const std::string& path, uint64_t bytes) {
  std::error_code error;
  const uint64_t size = fs::file_size(path, error);
  if (!error && bytes > size * 1032) {
    fail("fashion-mnist: {} is truncated: its header announces {} data bytes, more than a {} byte file can hold",
         path, bytes, size);
  }
}

torch::Tensor read_images(const std::string& path) {
  GzReader reader(path);
  const std::vector<uint32_t> dims = read_header(reader, path, kImagesMagic, 3);
  const uint64_t count = dims[0], rows = dims[1], cols = dims[2];
  if (rows == 0 || cols == 0) {
    fail("fashion-mnist: {} has images of {}x{} pixels", path, rows, cols);
  }
  // rows * cols < 2^64 since both are < 2^32; dividing avoids overflow in the full product.
  const uint64_t pixels = rows * cols;
  if (pixels > kMaxPayloadBytes || count > kMaxPayloadBytes / pixels) {
    fail("fashion-mnist: {} announces {} images of {}x{} pixels, more than this reader accepts",
         path, count, rows, cols);
  }
  const uint64_t bytes = count * pixels;
  check_announced(path, bytes);
  auto images = torch::empty({static_cast<int64_t>(count), static_cast<int64_t>(rows),
                              static_cast<int64_t>(cols)},
                             torch::kUInt8);
  read_payload(reader, path, images.data_ptr<uint8_t>(), bytes);
  return images;
}

torch::Tensor read_labels(const std::string& path) {
  GzReader reader(path);
  const uint64_t count = read_header(reader, path, kLabelsMagic, 1)[0];
  check_announced(path, count);
  auto raw = torch::empty({static_cast<int64_t>(count)}, torch::kUInt8);
  const uint8_t* data = raw.data_ptr<uint8_t>();
  read_payload(reader, path, raw.data_ptr<uint8_t>(), count);
  for (uint64_t i = 0; i < count; ++i) {
    if (data[i] >= kNumClasses) {
      fail("fashion-mnist: {} has label {} at index {}, expected 0..{}", path, data[i], i,
           kNumClasses - 1);
    }
  }
  return raw.to(torch::kInt64);
}

}  // namespace

ImageDataset load_fashion_mnist(const std::string& dir, const std::string& split) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    fail("fashion-mnist: no directory {} (install dataset-fashion-mnist or set data.path)", dir);
  }
  const std::string images_path = find_file(dir, split, split + kImagesSuffix);
  const std::string labels_path = find_file(dir, split, split + kLabelsSuffix);

  ImageDataset dataset;
  dataset.images = read_images(images_path);
  dataset.labels = read_labels(labels_path);
  if (dataset.images.size(0) != dataset.labels.size(0)) {
    fail("fashion-mnist: {} holds {} images but {} holds {} labels", images_path,
         dataset.images.size(0), labels_path, dataset.labels.size(0));
  }
  return dataset;
}

std::pair<torch::Tensor, torch::Tensor> make_batch(const ImageDataset& dataset,
                                                   const torch::Tensor& indices) {
  if (!indices.defined() || indices.dim() != 1 ||
      !at::isIntegralType(indices.scalar_type(), /*includeBool=*/false)) {
    fail("make_batch: indices must be a 1-D integer tensor, got {}",
         indices.defined() ? indices.toString() + " of shape " + c10::str(indices.sizes())
                           : std::string("an undefined tensor"));
  }
  const torch::Tensor rows = indices.to(torch::kCPU, torch::kInt64);
  if (rows.numel() > 0) {
    const int64_t low = rows.min().item<int64_t>();
    const int64_t high = rows.max().item<int64_t>();
    if (low < 0 || high >= dataset.size()) {
      fail("make_batch: index {} is outside the data set of {} samples",
           low < 0 ? low : high, dataset.size());
    }
  }
  // Convert only the selected rows: the full train set as float would be 188 MB.
  torch::Tensor images =
      dataset.images.index_select(0, rows).unsqueeze(1).to(torch::kFloat32).div_(255.0);
  torch::Tensor labels = dataset.labels.index_select(0, rows);
  return {std::move(images), std::move(labels)};
}

}  // namespace replica::data
