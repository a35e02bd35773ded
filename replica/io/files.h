// Writing files so that a crash never leaves a half-written one in place.
#pragma once

#include <string>

namespace replica::io {

// Writes `text` to PATH.tmp.<pid>, fsyncs it and renames it over `path`: readers see the old
// file or the new one, never a mix. replica::Error naming the path on failure (disk full...).
void write_file_atomically(const std::string& path, const std::string& text);

// SHA-256 of a file's bytes as 64 lowercase hex digits; replica::Error naming the path when
// it cannot be read.
std::string sha256_file(const std::string& path);

// Writes DIR/checksums.sha256 (`sha256sum -c` format: "<hex>  <name>" per line) over every
// regular file directly in `dir`, atomically. Why: a checkpoint corrupted after it was
// written (a flipped bit, a truncated copy) must be noticed before training resumes from it.
void write_checksum_manifest(const std::string& dir);

// Checks every file that DIR/checksums.sha256 lists. replica::Error naming the file that is
// missing or whose bytes differ. Returns false (nothing checked) when there is no manifest.
bool verify_checksum_manifest(const std::string& dir);

inline constexpr const char* kChecksumManifest = "checksums.sha256";

// fsync of a file or directory (after a rename, the directory entry too); errors ignored.
void fsync_path(const std::string& path);

}  // namespace replica::io
