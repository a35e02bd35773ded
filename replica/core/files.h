// Reading and writing whole files, the one way every concern does it. A write never leaves a
// half-written file in place: readers see the old file or the new one (checkpoints, configs,
// model directories, MDS shards, adapters all go through write_file_atomically).
#pragma once

#include <string>
#include <string_view>

namespace replica {

// The bytes of PATH. replica::Error naming the path when it cannot be read.
std::string read_file(const std::string& path);

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
