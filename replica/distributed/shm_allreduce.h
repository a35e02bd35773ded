// Intra-node all-reduce through POSIX shared memory: the ranks of one host sum their tensors
// by reading each other's memory directly instead of sending it over loopback sockets.
//
// Why: Gloo over loopback moves ~1 GB/s on this class of machine while memory moves ~20 GB/s.
// Every rank maps every other rank's segment; a collective is a few barriers on per-rank
// counters in a shared header, with the summing split between the ranks.
//
// Algorithm. Up to 1 MiB: every rank copies its tensor into its staging slice, one barrier,
// every rank sums all slices (in rank order 0..n-1) into its own tensor. Larger: reduce-scatter
// then all-gather: rank r sums chunk r of every rank's buffer (rank order again) into its own
// buffer's chunk r, barrier, every rank copies chunk p from rank p. Tensors from alloc() are
// reduced in place in shared memory (no copy in or out); others stream through two staging
// slices per rank, so any size works with a fixed amount of shared memory. Each output element
// is computed by one fixed sequence of float additions, so all ranks end bit-identical.
// bfloat16/float16 are accumulated in float32 and rounded once (round-to-nearest-even).
//
// Waiting spins briefly, then sleeps in futex(2) (a waiting rank leaves the core to the other
// ranks), waking every 20 ms to check the peers: a peer that died (its pid is gone), failed or
// closed its ShmAllreduce makes the wait throw replica::Error naming the local rank, its pid and
// the collective; so does a wait longer than `timeout`. After such a failure the object is
// unusable (every later call throws).
//
// One object is used by one thread at a time (like a communicator); its tensors from alloc()
// may be freed on any thread.
//
// No segment outlives the job: each is unlinked from /dev/shm as soon as every rank has mapped
// it (the mappings stay valid), and a failed setup unlinks every segment name it knows.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace replica::distributed {

class ProcessGroup;

class ShmAllreduce {
 public:
  // Publishes this rank's segment names to peers and reads theirs: set(key, value), and a
  // blocking get(key) (its own timeout applies). Only used by the constructor and alloc().
  struct Rendezvous {
    std::function<void(const std::string&, const std::string&)> set;
    std::function<std::string(const std::string&)> get;
  };

  // Two slices of this size per rank: small enough to stay in cache while a step goes
  // through copy-in, reduce-scatter and all-gather (1 MiB measured best; 32 MiB is ~2x slower).
  static constexpr std::size_t kDefaultSliceBytes = std::size_t{1} << 20;

  // Collective over the `local_size` ranks of this host (constructed by all of them; local_size
  // 1 allocates nothing and makes allreduce_sum a no-op). `job_id` must be unique per instance
  // among the users of the rendezvous store (it prefixes the keys and names the segments).
  // `timeout` bounds each wait for a peer (<= 0: no limit). `slice_bytes` is the size of each
  // of the two staging slices per rank (rounded up to 4 KiB).
  ShmAllreduce(int local_rank, int local_size, Rendezvous rendezvous,
               std::chrono::milliseconds timeout, std::string job_id,
               std::size_t slice_bytes = kDefaultSliceBytes);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  int local_rank() const;
  int local_size() const;
  // Number of allreduce_sum calls so far (the "#N" in error messages is this count).
  std::uint64_t collectives() const;

  // A zero-filled 1-D tensor in this rank's shared memory that peers read directly: all-reducing
  // it (or any contiguous view of it) needs no copy in or out. Collective: all ranks call alloc
  // in the same order with the same sizes. The memory lives as long as the tensor (it may
  // outlive this object). float32, bfloat16, float16 or float64.
  torch::Tensor alloc(std::int64_t numel, torch::ScalarType dtype);

  // In-place sum over the local ranks; returns when this rank's tensor holds the result.
  // Any contiguous CPU tensor of float32, bfloat16, float16 or float64, of any size; all ranks
  // pass the same numel and dtype (and, for alloc()'ed memory, the same place in the same allocation),
  // which is checked.
  void allreduce_sum(torch::Tensor& tensor);

  // The two halves of the large all-reduce, for callers that work on shards in between (DDP's
  // sharded optimizer step). Rank r owns elements shard_range(numel, local_size, r, element
  // size) of a tensor: contiguous chunks on cache-line boundaries (the last may be empty).
  // reduce_scatter_sum: afterwards this rank's shard holds the sum over the local ranks; the
  // rest of the tensor holds unspecified values. all_gather: afterwards the whole tensor holds
  // every rank's shard. Both work in place on alloc()'ed memory, touching only the bytes they
  // must; other tensors take the all-reduce (all_gather first zeroes what is not this rank's).
  // reduce_scatter_sum with a divisor leaves sum / divisor (DDP's average, divided before the
  // one rounding of the sum, so the division costs no extra pass over memory).
  void reduce_scatter_sum(torch::Tensor& tensor, float divisor = 1.0f);
  void all_gather(torch::Tensor& tensor);

  // Every local rank has arrived (checked against the peers' operations like a collective).
  void barrier();

  // One zero-filled 1-D tensor over memory that every local rank maps (local rank 0 creates
  // it): what one rank writes, all see. For data the ranks keep identical and update in
  // disjoint parts, such as DDP's parameters under the sharded optimizer step, where it
  // replaces the all-gather with a barrier. Collective, like alloc(); any dtype. Not for
  // collectives (every rank would pass the same memory).
  torch::Tensor alloc_shared(std::int64_t numel, torch::ScalarType dtype);
  static std::pair<std::int64_t, std::int64_t> shard_range(std::int64_t numel, int ranks, int rank,
                                                           std::size_t element_size);

 private:
  void run(torch::Tensor& tensor, int op, float divisor = 1.0f);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The rendezvous through a process group's key-value store. The group must outlive the
// ShmAllreduce's constructor and alloc() calls.
ShmAllreduce::Rendezvous store_rendezvous(ProcessGroup& group);

// The summing kernels' instruction set (Note [the reduction kernels' instruction sets] in
// shm_allreduce.cpp): the widest this CPU has, unless REPLICA_SHM_REDUCE=portable|avx2|avx512
// forces one. Decided once per process.
enum class ShmReduceKernels { kPortable, kAvx2, kAvx512 };
ShmReduceKernels shm_reduce_kernels();
const char* shm_reduce_kernels_name(ShmReduceKernels k);
// Every kernel set this CPU can execute (kPortable always).
std::vector<ShmReduceKernels> shm_reduce_kernels_this_cpu_runs();
// Forces a kernel set (tests); returns the previous one. replica::Error where the CPU cannot run it.
ShmReduceKernels set_shm_reduce_kernels(ShmReduceKernels k);
// out = (in[0] + ... + in[n-1]) / divisor with the current kernels: contiguous CPU tensors of
// out's dtype and size, n >= 2 (tests).
void shm_reduce_for_testing(const torch::Tensor& out, const std::vector<torch::Tensor>& in, float divisor = 1.0f);

}  // namespace replica::distributed
