// See cuda.h. Compiled with REPLICA_WITH_CUDA where LibTorch has CUDA (CMakeLists.txt); the CPU
// build answers "no GPU" from every function.
#include "replica/core/cuda.h"

#include "replica/core/error.h"

#include <fmt/format.h>

#ifdef REPLICA_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace replica {

#ifdef REPLICA_WITH_CUDA

namespace {
std::string version_text(int v) { return v <= 0 ? "" : fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }
}  // namespace

int visible_gpu_count() {
  // cudaGetDeviceCount initialises the runtime but creates no context; an error (no driver,
  // no device) is "no GPU".
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: a later CUDA call must not see it
    return 0;
  }
  return count;
}

void set_current_gpu(int index) {
  const int count = visible_gpu_count();
  if (index < 0 || index >= count) fail("cuda:{} does not exist: {} GPU{} visible", index, count, count == 1 ? " is" : "s are");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
}

std::vector<GpuInfo> visible_gpus() {
  std::vector<GpuInfo> out;
  const int count = visible_gpu_count();
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    out.push_back({i, p.name, static_cast<int64_t>(p.totalGlobalMem), p.major, p.minor});
  }
  return out;
}

std::string cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return version_text(v);
}

std::string cuda_driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return version_text(v);
}

GpuMemory gpu_memory(int index) {
  if (index < 0 || index >= visible_gpu_count()) return {};
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  using Stat = c10::CachingAllocator::StatType;
  const auto all = static_cast<size_t>(Stat::AGGREGATE);
  return {stats.allocated_bytes[all].peak, stats.reserved_bytes[all].peak};
}

void* managed_zeros(std::size_t bytes) {
  void* ptr = nullptr;
  if (cudaMallocManaged(&ptr, bytes == 0 ? 1 : bytes, cudaMemAttachGlobal) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    fail("cudaMallocManaged of {} bytes failed: {}", bytes, cudaGetErrorString(e));
  }
  if (cudaMemset(ptr, 0, bytes) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    cudaFree(ptr);
    fail("cudaMemset of managed memory failed: {}", cudaGetErrorString(e));
  }
  return ptr;
}

void managed_free(void* ptr) {
  // The stream may still read it: LibTorch's kernels on it finish first.
  cudaDeviceSynchronize();
  cudaFree(ptr);
}

bool is_managed_memory(const void* ptr) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeManaged;
}

#else  // a LibTorch without CUDA

int visible_gpu_count() { return 0; }
void set_current_gpu(int index) { fail("cuda:{} asked for, but this replica was built against a LibTorch without CUDA", index); }
std::vector<GpuInfo> visible_gpus() { return {}; }
std::string cuda_runtime_version() { return ""; }
std::string cuda_driver_version() { return ""; }
GpuMemory gpu_memory(int) { return {}; }
void* managed_zeros(std::size_t) { fail("paged optimizer state needs CUDA; this replica was built against a LibTorch without it"); }
void managed_free(void*) {}
bool is_managed_memory(const void*) { return false; }

#endif

}  // namespace replica
