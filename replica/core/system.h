// Small facts about the host and the process environment, shared by every concern.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace replica {

// Cores this process may run on (sched_getaffinity), at least 1.
int usable_cores();

// The environment variable, or nullopt when unset. Empty strings count as set.
std::optional<std::string> env(const char* name);

// Integer environment variable; nullopt when unset; replica::Error naming the variable when
// it is set but not an integer.
std::optional<int64_t> env_int(const char* name);

// Intra-op threads for this process: LibTorch's pool and, because LibTorch on Debian calls
// into OpenBLAS's own thread pool (sized from OMP_NUM_THREADS at load time), OpenBLAS's too.
void set_compute_threads(int threads);

// Makes the C allocator keep memory that tensors free inside the process for the next
// allocation, as PyTorch's CUDA caching allocator does on GPUs. By default glibc serves every
// block over 128 KiB-32 MiB (weights, gradients, activations) with a fresh mmap and unmaps it
// on free, so a training step pays a page fault and a kernel zero-fill per 4 KiB of every
// large tensor it creates: measured here, 44% of the CPU time of a world-1 step of MLP-54M and
// 8% of MLP-1.8M. Training reuses the same sizes every step, so the retained memory is the
// step's own peak, not growth. Blocks of 32 MiB and more are kept only where the model has a
// trainable parameter of half that size or more (`largest_parameter_bytes`): Note [which freed
// blocks the process keeps] in system.cpp. Idempotent for one size; a no-op outside glibc.
void keep_freed_memory_in_process(int64_t largest_parameter_bytes);
// The same for a model: the largest of `parameters` that requires a gradient, in bytes.
void keep_freed_memory_for(const std::vector<at::Tensor>& parameters);

// "SIGKILL", "SIGSEGV", ... for a signal number ("signal 42" when unnamed).
std::string signal_name(int signo);

}  // namespace replica

namespace replica {

// The error that ends a worker, as a JSON file at $REPLICA_ERROR_FILE (set per worker by
// `replica launch`): {"message", "rank", "pid", "restart", "time"}. The launcher reports it
// when the worker exits non-zero. Does nothing when the variable is unset; never throws
// (it runs on the way out of a failing process). Also writes the file to the path given to
// keep_worker_error_file_at, if any.
void write_worker_error_file(const std::string& message);

// A second place for this worker's error file: the project's errors/ directory, so that a run
// started under a launcher that keeps its error files elsewhere (`replica launch -- replica
// --config ...`, mpirun, Slurm) still leaves its record in the project.
void keep_worker_error_file_at(const std::string& path);

}  // namespace replica
