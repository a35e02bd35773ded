#include "replica/core/file_tensor.h"

#include "replica/core/error.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>

namespace replica {
namespace {

// The mappings made here, for is_file_backed (the deleter removes its entry).
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::set<void*>& registry() {
  static std::set<void*> s;
  return s;
}

}  // namespace

torch::Tensor file_backed_zeros(const std::string& dir, at::IntArrayRef shape, torch::ScalarType dtype) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("nvme_path {}: cannot create the directory: {}", dir, ec.message());
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  std::string name = (std::filesystem::path(dir) / "replica-swap-XXXXXX").string();
  const int fd = mkstemp(name.data());
  if (fd < 0) fail("nvme_path {}: cannot create a swap file: {}", dir, std::strerror(errno));
  unlink(name.c_str());  // gone with the process, whatever way it ends
  const size_t mapped = std::max<size_t>(bytes, 1);
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(mapped)); err != 0) {
    close(fd);
    fail("nvme_path {}: cannot reserve {} bytes for optimizer/parameter state: {}", dir, mapped, std::strerror(err));
  }
  void* data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    close(fd);
    fail("nvme_path {}: cannot map a {}-byte swap file: {}", dir, mapped, std::strerror(err));
  }
  // The state is read front to back once per step: let the kernel read ahead.
  madvise(data, mapped, MADV_SEQUENTIAL);
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().insert(data);
  }
  // A fresh file reads as zeros.
  return torch::from_blob(
      data, shape,
      [fd, mapped](void* p) {
        {
          std::lock_guard<std::mutex> lock(registry_mutex());
          registry().erase(p);
        }
        munmap(p, mapped);
        close(fd);
      },
      torch::TensorOptions().dtype(dtype));
}

bool is_file_backed(const torch::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu()) return false;
  void* base = t.storage().data_ptr().get();
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().count(base) > 0;
}

}  // namespace replica
