// Internal: the shared-memory all-reduce as a process-group transport.
//
// ShmAllreduce is synchronous and single-threaded; DDP needs asynchronous all-reduces that
// overlap backward. This runs them, in issue order, on one communication thread. With several
// nodes it is hierarchical: sum inside the node through shared memory, then the node leaders
// (local rank 0) all-reduce across nodes over Gloo, then the node shares the leader's result
// (the other ranks contribute zeros to a second shared-memory sum, which adds nothing).
#pragma once

#include "replica/distributed/process_group.h"
#include "replica/distributed/shm_allreduce.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace replica::distributed {

class ShmTransport {
 public:
  // `leaders`: the group of node leaders when there are several nodes and this rank leads its
  // node; null otherwise. `multi_node`: whether there are several nodes.
  ShmTransport(std::unique_ptr<ShmAllreduce> local, std::shared_ptr<ProcessGroup> leaders, bool multi_node);
  ~ShmTransport();

  // What a submitted collective does (ShmAllreduce's; all but the all-reduce only on one node).
  // `divisor`: reduce-scatter only (ShmAllreduce::reduce_scatter_sum).
  enum class Op { kAllreduce, kReduceScatter, kAllGather, kBarrier };
  Work submit(torch::Tensor tensor, Op op = Op::kAllreduce, float divisor = 1.0f);
  bool multi_node() const { return multi_node_; }
  torch::Tensor alloc(int64_t numel, torch::ScalarType dtype);
  torch::Tensor alloc_shared(int64_t numel, torch::ScalarType dtype);

  static bool supports(const torch::Tensor& t);

 private:
  struct Task;
  void loop();
  void run(torch::Tensor& tensor, Op op, float divisor);

  std::unique_ptr<ShmAllreduce> local_;
  std::shared_ptr<ProcessGroup> leaders_;
  bool multi_node_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace replica::distributed
