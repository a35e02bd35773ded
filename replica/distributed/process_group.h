// The process group: rendezvous plus collectives, over LibTorch's c10d.
//
// Rendezvous is env:// style: rank 0 hosts the locked store (store.h) on MASTER_ADDR:MASTER_PORT,
// listening there only; every rank proves the job's token and checks in, and only when all have joined is the Gloo process group built on it. A rank
// that never arrives is named in the error rank 0 raises after the rendezvous timeout; a port
// already in use is named as such. Every c10d call that differs between LibTorch 1.13 and
// 2.x lives in c10d_compat.cpp.
#pragma once

#include "replica/distributed/world.h"

#include <torch/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace replica::distributed {

struct ProcessGroupOptions {
  std::chrono::milliseconds rdzv_timeout{300'000};
  std::chrono::milliseconds collective_timeout{600'000};
  std::string backend = "gloo";  // gloo (CPU); nccl where LibTorch has CUDA
  // nccl: this rank's GPU. Collectives of CPU tensors (loss sums, counts, strings: the control
  // messages) are staged through it, and the shared-memory transport is not used.
  int cuda_device = -1;
  // All-reduce transport: "auto" (shared memory when every rank is on this host, else the
  // backend), "shm" (error unless all ranks share the host) or "gloo". Env REPLICA_TRANSPORT.
  std::string transport = "auto";
  // The job's shared secret, proven by every rank before the rendezvous admits it (store.h).
  // Empty: env REPLICA_TOKEN; neither set: an empty secret, and rank 0 warns that the
  // rendezvous is then open to any local or remote process that speaks its protocol.
  std::string token;
  // Desync debug mode: check every collective's kind, shapes, dtypes and order across ranks
  // (also on with REPLICA_DISTRIBUTED_DEBUG=DETAIL). See collective_monitor.h.
  bool desync_check = false;
};

// An asynchronous collective in flight. wait() blocks until it is done and rethrows a
// failure (a dead peer, a timeout) as replica::Error.
class Work {
 public:
  // What a transport returns for a collective in flight.
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual bool done() const = 0;
  };
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  void wait();
  bool done() const;
  bool valid() const { return impl_ != nullptr; }

 private:
  std::shared_ptr<Impl> impl_;
};

class ShmTransport;
class CollectiveMonitor;

class ProcessGroup {
 public:
  struct Impl;
  explicit ProcessGroup(WorldInfo world);  // world size 1: collectives are no-ops
  ProcessGroup(WorldInfo world, std::unique_ptr<Impl> impl);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return world_.rank; }
  int size() const { return world_.world_size; }
  const WorldInfo& world() const { return world_; }
  // The transport all-reduces take: "shm", "gloo", or "none" for a world of one.
  std::string transport() const;
  // Switch all-reduces to "shm" or "gloo" (for benchmarks and tests); replica::Error when the
  // transport is not available in this group. Collective: every rank switches together.
  void set_transport(const std::string& transport);

  // A buffer for repeated all-reduces (DDP buckets): with the shared-memory transport it lives
  // in shared memory, so reducing it needs no copy in or out. Collective: every rank calls it
  // in the same order with the same sizes.
  torch::Tensor alloc_buffer(int64_t numel, torch::ScalarType dtype);

  // In-place sum across ranks. Asynchronous: the tensor must not be touched until wait().
  // float32/bfloat16/float16/float64 CPU tensors take the shared-memory transport when it is active
  // (issued in order on its own thread); everything else goes through the backend (Gloo).
  // `file`/`line` name the call site in collective timeout and desync reports.
  Work allreduce_sum(torch::Tensor& tensor, const char* file = __builtin_FILE(), int line = __builtin_LINE());
  // Shards of a flat tensor for the two calls below: rank r owns elements
  // [shard_range(numel, dtype, r)) (contiguous, cache-line aligned; the last may be empty).
  std::pair<int64_t, int64_t> shard_range(int64_t numel, torch::ScalarType dtype, int rank) const;
  // In-place reduce-scatter of a flat tensor: afterwards this rank's shard holds the sum across
  // ranks and the rest unspecified values. Asynchronous, like allreduce_sum. With the
  // shared-memory transport on one node and alloc_buffer() memory it reads the peers' shards
  // directly (half an all-reduce); otherwise it is an all-reduce.
  Work reduce_scatter_sum(torch::Tensor& tensor, const char* file = __builtin_FILE(), int line = __builtin_LINE());
  // reduce_scatter_sum, then this rank's shard divided by size() (DDP's average). With shared
  // memory the division happens inside the reduction, no extra pass; otherwise the whole tensor
  // is divided first, like the default DDP hook.
  Work reduce_scatter_average(torch::Tensor& tensor, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE());
  // In-place all-gather of a flat tensor: afterwards all of it holds each rank's own shard.
  // Shared memory as above copies the peers' shards; otherwise the shards are summed with
  // zeros elsewhere (exact).
  Work all_gather_shards(torch::Tensor& tensor, const char* file = __builtin_FILE(), int line = __builtin_LINE());
  // For layouts of their own (ZeRO-3's groups of size() * chunk elements): the backend's
  // reduce-scatter (this rank's chunk [rank * chunk, (rank + 1) * chunk) ends as the sum
  // divided by `divisor`) and all-gather (every chunk ends as its rank's), each moving 1/size of
  // an all-reduce's data. Only where native_chunks(tensor): not with the shared-memory
  // transport, whose all-reduce is the faster path on one host.
  bool native_chunks(const torch::Tensor& tensor) const { return !shares_memory() && backend_takes(tensor); }
  Work reduce_scatter_chunks(torch::Tensor& tensor, int64_t chunk, double divisor,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE());
  Work all_gather_chunks(torch::Tensor& tensor, int64_t chunk, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE());
  // In-place: every rank ends with root's values.
  void broadcast(std::vector<torch::Tensor>& tensors, int root = 0, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE());
  // out[r] = rank r's `in` (same shape on every rank).
  void allgather(std::vector<torch::Tensor>& out, const torch::Tensor& in, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE());
  // Every rank's string, by rank (small control messages: names, field lists, traces).
  std::vector<std::string> allgather_strings(const std::string& mine, const char* file = __builtin_FILE(),
                                             int line = __builtin_LINE());
  void barrier(const char* file = __builtin_FILE(), int line = __builtin_LINE());

  // Whether the whole group is one node on the shared-memory transport: then reduce_scatter_*
  // and all_gather_shards work in place on alloc_buffer() memory, and alloc_shared_buffer() and
  // shared_barrier() go through shared memory.
  bool shares_memory() const;
  // One buffer that every rank maps when shares_memory(), an undefined tensor otherwise. What
  // one rank writes, every rank sees (ranks that keep data identical and update disjoint parts
  // of it need no all-gather, only shared_barrier()). Zero-filled. Collective: every rank calls
  // it in the same order.
  torch::Tensor alloc_shared_buffer(int64_t numel, torch::ScalarType dtype);
  // Every rank has arrived; through shared memory, in order with the collectives issued before
  // it, when shares_memory(), else the backend's barrier. Asynchronous.
  Work shared_barrier(const char* file = __builtin_FILE(), int line = __builtin_LINE());

  // Key-value store of the rendezvous (small control messages, e.g. bucket orders).
  void store_set(const std::string& key, const std::string& value);
  std::string store_get(const std::string& key);
  bool store_check(const std::string& key);

 private:
  friend std::shared_ptr<ProcessGroup> init_process_group(const WorldInfo&, const ProcessGroupOptions&);
  Work backend_allreduce_sum(torch::Tensor& tensor);
  // The backend's own reduce-scatter / all-gather (NCCL's, Gloo's) of a flat tensor cut into
  // chunks of `chunk` elements (shard_range's; the tail padded for the call), so each moves
  // 1/size of an all-reduce's data per rank; the reduce-scatter divides this rank's shard by
  // `divisor`. backend_takes: whether the backend can: NCCL takes CUDA tensors (a CPU tensor
  // falls back to an all-reduce through the staging device), Gloo CPU tensors (its reduce-
  // scatter and all-gather into one tensor are host-only; CUDA tensors under Gloo, as with
  // several workers on one GPU, fall back to its all-reduce, which takes them).
  bool backend_takes(const torch::Tensor& tensor) const;
  Work backend_reduce_scatter_sum(torch::Tensor& tensor, int64_t chunk, double divisor);
  Work reduce_scatter(torch::Tensor& tensor, double divisor, const char* file, int line);
  Work backend_all_gather(torch::Tensor& tensor, int64_t chunk);

  WorldInfo world_;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<ShmTransport> shm_;  // set when every rank of a node shares memory
  bool use_shm_ = false;
  std::string backend_ = "gloo";  // gloo or nccl
  // Watchdog and desync checks (null for a world of one). Last member: destroyed first, so
  // its thread stops before the store it uses goes away.
  std::shared_ptr<CollectiveMonitor> monitor_;
};

// Rendezvous and build the group. world_size 1 gives a group whose collectives are no-ops
// and that opens no socket.
std::shared_ptr<ProcessGroup> init_process_group(const WorldInfo& world,
                                                 const ProcessGroupOptions& options = {});

// The NCCL version LibTorch's NCCL backend uses ("2.27.5"); "" without CUDA.
std::string nccl_version();

}  // namespace replica::distributed
