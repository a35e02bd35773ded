// The GPUs this process sees, and the one it computes on: the single place that talks to the
// CUDA runtime (everything else asks here or uses LibTorch's device-generic tensors), so that a
// CPU-only LibTorch builds the same code and simply sees no GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace replica {

// GPUs visible to this process (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA. Asks the CUDA
// runtime for the count only: no CUDA context is created, so a launcher may call it before it
// forks workers.
int visible_gpu_count();

// Makes cuda:`index` this thread's current device (before the first allocation and the NCCL
// process group, so that both land on it).
void set_current_gpu(int index);

struct GpuInfo {
  int index = 0;
  std::string name;
  int64_t total_memory = 0;  // bytes
  int major = 0, minor = 0;  // compute capability
};
// Each visible GPU (replica env); empty without CUDA.
std::vector<GpuInfo> visible_gpus();

// "13.0" (the CUDA runtime LibTorch was built with), the driver's CUDA version ("13.0"); "" without CUDA.
std::string cuda_runtime_version();
std::string cuda_driver_version();

// Peak bytes the caching allocator had allocated and reserved on cuda:`index` since the start
// (ZeRO-3's and DDP's memory reports on the device); zeros without CUDA.
struct GpuMemory {
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
};
GpuMemory gpu_memory(int index);

// `bytes` of zeroed CUDA managed memory (cudaMallocManaged: host-pageable, migrated to the GPU
// on access and evicted to host RAM under pressure, what bitsandbytes' paged optimizers keep their
// state in), and its release. replica::Error where there is no CUDA or the allocation fails.
void* managed_zeros(std::size_t bytes);
void managed_free(void* ptr);
// Whether `ptr` points into CUDA managed memory (false without CUDA).
bool is_managed_memory(const void* ptr);

}  // namespace replica
