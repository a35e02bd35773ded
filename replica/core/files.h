// Reading and writing whole files, the one way every concern does it. A write never leaves a
// half-written file in place: readers see the old file or the new one (checkpoints, configs,
// model directories, MDS shards, adapters all go through write_file_atomically).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace replica {

// Note [only regular files are read]
// A path a user hands replica may name a FIFO (open() blocks until a writer comes: a hang), a
// device (/dev/zero: endless bytes), a directory or a socket, directly or through a symlink.
// Every file replica reads is opened with O_NONBLOCK (a FIFO's open returns at once), checked
// with fstat on the opened descriptor (no race with a rename), and refused unless it is a
// regular file; its size is checked against the caller's bound before anything is allocated.

// The most bytes read_file reads unless told otherwise (the largest tokenizer.json files are
// ~35 MB, MDS shards 64 MiB by default).
inline constexpr std::uint64_t kMaxReadFileBytes = std::uint64_t{1} << 30;

// An open regular file: its descriptor (blocking, close-on-exec) and size. Closes on destruction.
class RegularFile {
 public:
  // replica::Error naming the path when it cannot be opened, is not a regular file (saying
  // what it is), or is larger than max_bytes.
  explicit RegularFile(const std::string& path, std::uint64_t max_bytes = UINT64_MAX);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// replica::Error unless PATH (after symlinks) is a regular file: for readers that open the
// path themselves (std::ifstream line readers). Does not open it, so never blocks.
void require_regular_file(const std::string& path);

// The bytes of PATH, a regular file of at most max_bytes. replica::Error naming the path when
// it cannot be read, is not a regular file or is larger.
std::string read_file(const std::string& path, std::uint64_t max_bytes = kMaxReadFileBytes);

// Writes `bytes` to PATH.tmp.<pid>, fsyncs it, renames it over `path` and fsyncs the
// directory. replica::Error naming the path on failure (disk full, no permission...); the
// temporary file is removed then.
void write_file_atomically(const std::string& path, std::string_view bytes);

// write_file_atomically of `from`'s bytes.
void copy_file_atomically(const std::string& from, const std::string& to);

// fsync of a file or directory (after a rename, the directory entry too); errors ignored.
void fsync_path(const std::string& path);

inline bool starts_with(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}
inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace replica
