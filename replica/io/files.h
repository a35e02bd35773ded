// Writing files so that a crash never leaves a half-written one in place.
#pragma once

#include <string>

namespace replica::io {

// Writes `text` to PATH.tmp.<pid>, fsyncs it and renames it over `path`: readers see the old
// file or the new one, never a mix. replica::Error naming the path on failure (disk full...).
void write_file_atomically(const std::string& path, const std::string& text);

// fsync of a file or directory (after a rename, the directory entry too); errors ignored.
void fsync_path(const std::string& path);

}  // namespace replica::io
