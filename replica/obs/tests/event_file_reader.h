// Reads TensorBoard event files back the way TensorBoard does, for tests: TFRecord framing
// (every length and CRC checked with gtest expectations) and the Event/Summary protos.
#pragma once

#include "replica/obs/tensorboard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace replica::testing {

using replica::obs::masked_crc32c;


// A minimal protobuf reader: the fields of one message by number.
struct Field {
  uint32_t number, wire_type;
  uint64_t varint = 0;
  std::string bytes;  // length-delimited, fixed32 and fixed64 payloads
};

inline uint64_t read_varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    if (pos >= s.size()) throw std::runtime_error("truncated varint");
    const auto b = static_cast<unsigned char>(s[pos++]);
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

inline std::vector<Field> parse_message(const std::string& s) {
  std::vector<Field> fields;
  size_t pos = 0;
  while (pos < s.size()) {
    const uint64_t key = read_varint(s, pos);
    Field f{static_cast<uint32_t>(key >> 3), static_cast<uint32_t>(key & 7)};
    switch (f.wire_type) {
      case 0: f.varint = read_varint(s, pos); break;
      case 1: f.bytes = s.substr(pos, 8); pos += 8; break;
      case 5: f.bytes = s.substr(pos, 4); pos += 4; break;
      case 2: {
        const uint64_t n = read_varint(s, pos);
        f.bytes = s.substr(pos, n);
        pos += n;
        break;
      }
      default: throw std::runtime_error("unexpected wire type");
    }
    if (pos > s.size()) throw std::runtime_error("truncated field");
    fields.push_back(f);
  }
  return fields;
}

template <typename T>
T as(const std::string& bytes) {
  EXPECT_EQ(bytes.size(), sizeof(T));
  T v;
  std::memcpy(&v, bytes.data(), sizeof(T));
  return v;
}

// The records of a TFRecord file, every length and CRC checked.
inline std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < data.size()) {
    EXPECT_LE(pos + 12, data.size()) << "truncated header at " << pos;
    const auto length = as<uint64_t>(data.substr(pos, 8));
    EXPECT_EQ(as<uint32_t>(data.substr(pos + 8, 4)), masked_crc32c(data.data() + pos, 8)) << "length CRC at " << pos;
    pos += 12;
    EXPECT_LE(pos + length + 4, data.size()) << "truncated record at " << pos;
    const std::string payload = data.substr(pos, length);
    EXPECT_EQ(as<uint32_t>(data.substr(pos + length, 4)), masked_crc32c(payload.data(), payload.size()))
        << "payload CRC at " << pos;
    pos += length + 4;
    records.push_back(payload);
  }
  return records;
}

struct Scalar {
  double wall_time;
  int64_t step;
  std::string tag;
  float value;
};

inline Scalar decode_scalar(const std::string& event) {
  Scalar out{0, 0, "", 0};
  int summaries = 0;
  for (const auto& f : parse_message(event)) {
    if (f.number == 1) { EXPECT_EQ(f.wire_type, 1u); out.wall_time = as<double>(f.bytes); }
    if (f.number == 2) { EXPECT_EQ(f.wire_type, 0u); out.step = static_cast<int64_t>(f.varint); }
    if (f.number == 5) {
      ++summaries;
      auto values = parse_message(f.bytes);
      EXPECT_EQ(values.size(), 1u);
      EXPECT_EQ(values[0].number, 1u);
      for (const auto& v : parse_message(values[0].bytes)) {
        if (v.number == 1) out.tag = v.bytes;
        if (v.number == 2) { EXPECT_EQ(v.wire_type, 5u); out.value = as<float>(v.bytes); }
      }
    }
  }
  EXPECT_EQ(summaries, 1);
  return out;
}


}  // namespace replica::testing
