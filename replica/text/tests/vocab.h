// Test support: the real tokenizer vocabularies kept in the repository,
// replica/text/tests/conformance/vocab/<name>/{tokenizer.json,tokenizer_config.json}.zst
// (Llama 2 / Mistral, Llama 3, Qwen 3; see conformance/README.md). Each file is decompressed
// with libzstd and its sha256 checked against vocab/SHA256SUMS, so that a test never runs on
// a vocabulary other than the one its references were written from. Header-only, for test
// programs that link libzstd and OpenSSL's libcrypto (replica_conformance_tests does, through
// replica_data and replica_io).
#pragma once

#include <openssl/evp.h>
#include "replica/testing/paths.h"
#include <unistd.h>
#include <zstd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

namespace replica::testing::vocab {

namespace fs = std::filesystem;

inline fs::path conformance_dir() {
  return fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "conformance";
}

inline fs::path vocab_root() { return conformance_dir() / "vocab"; }

inline std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string sha256_hex(const std::string& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("EVP_Digest(sha256) failed");
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += hex[md[i] >> 4];
    out += hex[md[i] & 15];
  }
  return out;
}

// The one zstd frame of `path`, decompressed (zstd -19 writes the content size in the frame).
inline std::string zstd_decompress_file(const fs::path& path) {
  const std::string packed = read_bytes(path);
  const unsigned long long size = ZSTD_getFrameContentSize(packed.data(), packed.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) throw std::runtime_error(path.string() + " is not a zstd frame");
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
    throw std::runtime_error(path.string() + ": the zstd frame does not record its size (compress with the zstd command)");
  }
  std::string out(static_cast<size_t>(size), '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), packed.data(), packed.size());
  if (ZSTD_isError(n)) throw std::runtime_error(path.string() + ": " + ZSTD_getErrorName(n));
  if (n != out.size()) throw std::runtime_error(path.string() + ": decompressed to fewer bytes than its frame says");
  return out;
}

// vocab/SHA256SUMS: "llama3/tokenizer.json" -> hex digest.
inline const std::map<std::string, std::string>& checksums() {
  static const std::map<std::string, std::string> sums = [] {
    std::map<std::string, std::string> m;
    std::istringstream in(read_bytes(vocab_root() / "SHA256SUMS"));
    std::string digest, name;
    while (in >> digest >> name) {
      if (!name.empty() && name[0] == '*') name.erase(0, 1);
      m[name] = digest;
    }
    return m;
  }();
  return sums;
}

// The bytes of vocabulary `name`'s `file` ("tokenizer.json" or "tokenizer_config.json"),
// decompressed and checked; cached for the process. Throws std::runtime_error naming the
// file when it is missing, corrupt or not the one SHA256SUMS names.
inline const std::string& file(const std::string& name, const std::string& file) {
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  const std::string rel = name + "/" + file;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(rel); it != cache.end()) return it->second;
  const fs::path packed = vocab_root() / (rel + ".zst");
  std::string data = zstd_decompress_file(packed);
  const auto want = checksums().find(rel);
  if (want == checksums().end()) throw std::runtime_error("vocab/SHA256SUMS has no line for " + rel);
  const std::string got = sha256_hex(data);
  if (got != want->second) {
    throw std::runtime_error(packed.string() + " decompresses to sha256 " + got + ", but vocab/SHA256SUMS says " +
                             want->second);
  }
  return cache.emplace(rel, std::move(data)).first->second;
}

inline const std::string& tokenizer_json(const std::string& name) { return file(name, "tokenizer.json"); }

// A directory holding vocabulary `name`'s tokenizer.json and tokenizer_config.json, as a
// model directory has them (for Tokenizer::from_dir, chat_template_for, ...). Written once
// per process under the temporary directory and removed at exit.
inline fs::path dir(const std::string& name) {
  struct Dirs {
    std::mutex mu;
    fs::path root;
    std::map<std::string, fs::path> made;
    ~Dirs() {
      std::error_code ec;
      if (!root.empty()) fs::remove_all(root, ec);
    }
  };
  static Dirs dirs;
  std::lock_guard<std::mutex> lock(dirs.mu);
  if (auto it = dirs.made.find(name); it != dirs.made.end()) return it->second;
  if (dirs.root.empty()) {
    std::string pattern = (fs::temp_directory_path() / "replica_vocab_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    dirs.root = pattern;
  }
  const fs::path d = dirs.root / name;
  fs::create_directories(d);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    std::ofstream out(d / f, std::ios::binary);
    const std::string& data = file(name, f);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!out) throw std::runtime_error("cannot write " + (d / f).string());
  }
  return dirs.made.emplace(name, d).first->second;
}

}  // namespace replica::testing::vocab
