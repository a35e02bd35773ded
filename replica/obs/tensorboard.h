// TensorBoard event files written without TensorFlow or libprotobuf.
//
// What: EventFileWriter appends scalar summaries to project/events.out.tfevents.<time>.<host>,
// the file TensorBoard's `--logdir` scans. The file is a TFRecord stream (length, masked
// CRC32C of the length, payload, masked CRC32C of the payload) of serialized
// tensorflow.Event protos: a first record with file_version "brain.Event:2", then one Event
// per scalar with wall_time, step and a Summary holding {tag, simple_value}.
//
// Why by hand: the few protobuf fields are encoded directly, because linking libprotobuf
// clashes with the protobuf LibTorch bundles in the same process, and Debian has no CRC32C
// library for C++ (bookworm), so the 30-line table-driven CRC32C lives here.
//
// Thread-safety: an EventFileWriter is not synchronized; use it from one thread (the
// trainer's rank 0). The free functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

namespace replica::obs {

// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected), as in iSCSI and TFRecord.
uint32_t crc32c(const void* data, size_t size);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);
// One TFRecord: uint64 length (little-endian), masked CRC of those 8 bytes, payload, masked
// CRC of the payload.
std::string tfrecord(const std::string& payload);

// Serialized tensorflow.Event messages.
std::string event_file_version(double wall_time);  // file_version: "brain.Event:2"
std::string event_scalar(double wall_time, int64_t step, const std::string& tag, float value);

class EventFileWriter {
 public:
  // Creates `dir` if needed and a new events.out.tfevents.* file in it; replica::Error
  // naming the path when it cannot be written.
  explicit EventFileWriter(const std::string& dir);
  void add_scalar(const std::string& tag, double value, int64_t step);
  // Pushes what was written to the file (TensorBoard reads files while they grow).
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& payload);
  std::string path_;
  std::ofstream out_;
};

}  // namespace replica::obs
