#include "replica/obs/tensorboard.h"

#include "replica/core/error.h"

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <unistd.h>

namespace replica::obs {
namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected 0x1EDC6F41
    table[i] = c;
  }
  return table;
}

// Protobuf wire format: the handful of encodings Event and Summary need.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }
template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian on every platform LibTorch supports
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// tensorflow.Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary). Summary: value = 1 (repeated Value). Value: tag = 1 (string),
// simple_value = 2 (float).
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_tag(e, 1, 1);
  put_fixed<double>(e, wall_time);
  if (step != 0) {
    put_tag(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  std::string out;
  std::string length;
  put_fixed<uint64_t>(length, payload.size());
  out += length;
  put_fixed<uint32_t>(out, masked_crc32c(length.data(), length.size()));
  out += payload;
  put_fixed<uint32_t>(out, masked_crc32c(payload.data(), payload.size()));
  return out;
}

std::string event_file_version(double wall_time) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalar(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_tag(v, 2, 5);
  put_fixed<float>(v, value);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = now_seconds();
  // TensorBoard orders a directory's event files by name: time first, like TensorFlow's.
  path_ = (std::filesystem::path(dir) /
           fmt::format("events.out.tfevents.{}.{}.{}", static_cast<int64_t>(now), host, getpid()))
              .string();
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) fail("cannot write the TensorBoard event file '{}': {}", path_, std::strerror(errno));
  write_record(event_file_version(now));
  flush();
}

void EventFileWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  write_record(event_scalar(now_seconds(), step, tag, static_cast<float>(value)));
}

void EventFileWriter::flush() {
  out_.flush();
  if (!out_) fail("cannot write the TensorBoard event file '{}'", path_);
}

void EventFileWriter::write_record(const std::string& payload) { out_ << tfrecord(payload); }

}  // namespace replica::obs
