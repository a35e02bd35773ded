#include "replica/io/files.h"

#include "replica/core/error.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <memory>
#include <sstream>
#include <vector>

namespace replica::io {

std::string sha256_file(const std::string& path) {
  const RegularFile file(path);  // regular files only: a FIFO or /dev/zero would never end
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    fail("{}: OpenSSL SHA-256 is unavailable", path);
  }
  std::vector<unsigned char> buf(1 << 20);
  for (;;) {
    const ssize_t n = ::read(file.fd(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("{}: read failed while checksumming: {}", path, std::strerror(errno));
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &len);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

void write_checksum_manifest(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name != kChecksumManifest) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  std::string text;
  for (const auto& name : names) text += sha256_file(dir + "/" + name) + "  " + name + "\n";
  write_file_atomically(dir + "/" + kChecksumManifest, text);
}

bool verify_checksum_manifest(const std::string& dir) {
  const std::string manifest = dir + "/" + kChecksumManifest;
  std::error_code ec;
  if (!std::filesystem::exists(manifest, ec)) return false;
  // One line per file of the checkpoint: 16 MiB is far more than any holds.
  std::istringstream in(read_file(manifest, std::uint64_t{16} << 20));
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    // "<64 hex>  <name>"; a name is a plain file in this directory, never a path.
    const bool hex = line.size() > 66 && line.compare(64, 2, "  ") == 0 &&
                     std::all_of(line.begin(), line.begin() + 64, [](char c) {
                       return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                     });
    const std::string name = hex ? line.substr(66) : "";
    if (!hex || name.find('/') != std::string::npos || name == "." || name == "..") {
      fail("{}:{}: not a '<sha256>  <file name>' line", manifest, line_no);
    }
    const std::string path = dir + "/" + name;
    if (!std::filesystem::is_regular_file(path)) fail("{}: missing (listed in {})", path, kChecksumManifest);
    if (sha256_file(path) != line.substr(0, 64)) {
      fail("{}: SHA-256 does not match {} (the file is corrupt or was changed after it was saved)", path,
           kChecksumManifest);
    }
  }
  return true;
}

}  // namespace replica::io
