#include "replica/io/files.h"

#include "replica/core/error.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

namespace replica::io {

std::string sha256_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open for its checksum: {}", path, std::strerror(errno));
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    ::close(fd);
    fail("{}: OpenSSL SHA-256 is unavailable", path);
  }
  std::vector<unsigned char> buf(1 << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("{}: read failed while checksumming: {}", path, std::strerror(err));
    }
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
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
  std::ifstream in(manifest);
  if (!in) return false;
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
