// Checksums of the files a checkpoint holds (the atomic write itself is core/files.h).
#pragma once

#include "replica/core/files.h"

#include <string>

namespace replica::io {

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

}  // namespace replica::io
