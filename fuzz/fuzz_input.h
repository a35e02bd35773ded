// Helpers shared by the fuzz targets: the parsers under test read files, so each input is
// written to a per-process scratch directory under /dev/shm first.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace replica::fuzz {

inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const std::string d = "/dev/shm/replica-fuzz-" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

}  // namespace replica::fuzz
