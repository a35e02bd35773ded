// replica::ddp::DistributedDataParallel: PyTorch's DDP for any torch::nn::Module.
//
// What it does, and why:
// - On construction, rank 0's parameters and buffers are broadcast so every replica starts
//   identical.
// - Gradients are averaged across ranks with all-reduce on flat buckets (bucket_cap_mb,
//   25 MiB; the first bucket 1 MiB) filled in reverse parameter order. A post-hook on each
//   parameter's gradient accumulator marks it ready; the moment a bucket's last gradient is
//   in, its all-reduce is launched asynchronously, so communication overlaps the rest of the
//   backward pass. Buckets launch strictly in bucket order, because every rank must issue
//   collectives in the same order. After the first step the buckets are rebuilt once in the
//   order gradients actually arrived (rank 0's order, so all ranks agree).
// - Each parameter's .grad is a view into its bucket (gradient_as_bucket_view), so there is
//   no copy in or out; an optimizer that resets grads to undefined only costs one copy, and
//   not even that for layers that write their weight gradient into the bucket themselves
//   (models::FusedLinear, through replica/core/gradient_home.h).
// - At the end of backward (an autograd engine callback) the step waits only for the
//   buckets still in flight. A parameter that got no gradient is an error naming it, unless
//   find_unused_parameters is on. Frozen parameters (requires_grad false) are never synced.
// - no_sync() suspends communication: gradients accumulate locally until a backward
//   outside the scope syncs the sum.
// - World size 1 installs no hooks: it costs nothing over plain training.
//
// Usage:
//   auto ddp = replica::ddp::DistributedDataParallel(model.ptr(), process_group);
//   auto loss = loss_fn(model->forward(x), y);
//   loss.backward();                 // all-reduce overlaps this
//   optimizer.step();                // gradients are already averaged
//
// Sharded optimizer step (DDPOptions::shard_optimizer; ZeRO stage 2 inside DDP, like PyTorch's
// ZeroRedundancyOptimizer with DDP): with N workers each worker updates only 1/N of the
// parameters. Every bucket's parameters also live in one flat buffer (from the process group:
// shared memory on one host), the gradient buckets are reduce-scattered instead of all-reduced
// (each worker gets the average of its own shard only), the optimizer steps shard_parameters()
// (1-D views of this worker's shard of every parameter, .grad the averaged gradient shard),
// and after_step() all-gathers the updated shards. The optimizer state is 1/N per worker and
// the optimizer's memory traffic per worker falls by N, which is what limits the step on a
// memory-bound host; the result equals unsharded DDP up to float rounding (bit for bit with
// two workers and SGD). Buckets are not rebuilt in this mode (the shards must stay put).
//   auto optimizer = make_optimizer(spec, ddp.shard_parameters());
//   loss.backward();                 // reduce-scatter overlaps this
//   ddp.clip_grad_norm(max_norm);    // global norm over the shards (optional)
//   optimizer->step();
//   ddp.after_step();                // all-gather; resets the model's gradients
//
// Thread-safety: one training thread per instance; hooks may run on autograd threads.
#pragma once

#include "replica/distributed/process_group.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace replica::ddp {

struct DDPOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;  // pre_forward() re-broadcasts rank 0's buffers
  // The set of parameters that get gradients is the same every step (PyTorch's static_graph):
  // the first step learns which are unused; later steps mark those ready as soon as backward
  // starts, so their buckets do not wait for the end of backward. Implies that unused
  // parameters are allowed.
  bool static_graph = false;
  // Each worker steps only its shard of the parameters (see the top of this file). nullopt =
  // auto: on when the workers share one host's memory and every parameter is on the CPU (then
  // they step one shared copy; the faster step there, bench/README.md), off otherwise.
  std::optional<bool> shard_optimizer = false;
  // Sharded: the gradient buckets reduce-scattered (ZeRO stage 2: each worker receives the
  // average of its own shard only, half an all-reduce's traffic) or all-reduced (stage 1:
  // every worker receives the whole average; only the optimizer state and step are sharded).
  bool reduce_scatter_gradients = true;
};

// One bucket as a communication hook sees it.
struct GradBucket {
  size_t index = 0;
  torch::Tensor buffer;                 // flat, all gradients of the bucket
  std::vector<size_t> parameter_indices;
  bool is_last = false;
};

// A communication hook starts the reduction of bucket.buffer and returns a function that
// completes it: when that function returns, bucket.buffer holds the averaged gradients.
// The default hook divides by the world size and all-reduces (PyTorch's allreduce_hook).
using CommHook = std::function<std::function<void()>(distributed::ProcessGroup&, GradBucket&)>;
CommHook allreduce_average_hook();
// Opt-in compression (PyTorch's bf16_compress_hook / fp16_compress_hook): the bucket is cast
// to bf16/fp16, averaged in that precision, and cast back; half the bytes on the wire, at
// the cost of rounding. Buckets already in a 16-bit type are reduced as they are.
CommHook bf16_compress_hook();
CommHook fp16_compress_hook();

class DistributedDataParallel {
 public:
  // Broadcasts rank 0's parameters and buffers, registers the gradient hooks, and makes the
  // process keep freed memory for reuse (keep_freed_memory_in_process, replica/core/system.h).
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          std::shared_ptr<distributed::ProcessGroup> process_group,
                          DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  std::shared_ptr<torch::nn::Module> module_ptr() { return module_; }
  distributed::ProcessGroup& process_group() { return *pg_; }

  // Call before each forward when the model has buffers (BatchNorm running stats):
  // broadcasts rank 0's buffers, as PyTorch DDP does at every forward.
  void pre_forward();

  // While the returned guard lives, backward passes do not communicate.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(&ddp) { ddp_->sync_enabled_ = false; }
    NoSync(NoSync&& other) noexcept : ddp_(other.ddp_) { other.ddp_ = nullptr; }
    ~NoSync() {
      if (ddp_) ddp_->sync_enabled_ = true;
    }

   private:
    DistributedDataParallel* ddp_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Replaces the default averaging hook (not with shard_optimizer: its buckets are reduce-
  // scattered, not all-reduced).
  void register_comm_hook(CommHook hook);

  // What the optimizer steps: with shard_optimizer at world size > 1, this worker's shards
  // (1-D tensors over the parameters' memory, named "<parameter>[begin:end]" over its flat
  // elements); otherwise the trainable parameters themselves, by name.
  std::vector<torch::Tensor> shard_parameters() const;
  std::vector<std::string> shard_names() const;
  bool sharded() const { return sharded_; }
  // Sharded on one host: every worker's parameters are the same shared memory, so after_step()
  // is a barrier instead of an all-gather.
  bool parameters_shared() const { return shared_params_; }
  // Global-norm clipping over shard_parameters()' gradients (torch::nn::utils::clip_grad_norm_'s
  // formula; max_norm infinity only measures); returns the norm before clipping, a 0-dim
  // float64 tensor not yet read (distributed/grad_norm.h). Collective when sharded.
  torch::Tensor clip_grad_norm(double max_norm);
  // After optimizer.step() when sharded: every worker's updated shards are all-gathered into
  // every parameter, and the model's gradients reset to undefined (the step consumed them).
  // A no-op when not sharded. Collective.
  void after_step();
  // Optimizer state of shard_parameters() ("<shard name>.<field>") to and from the full
  // state of the parameters ("<parameter>.<field>"), for checkpoints that any world size can
  // load. Per-element fields (shaped like the shard) are gathered; 0-dim fields (AdamW's step)
  // are taken from the worker owning the parameter's first element. Both collective when
  // sharded, identity otherwise.
  std::vector<std::pair<std::string, torch::Tensor>> full_optimizer_state(
      const std::vector<std::pair<std::string, torch::Tensor>>& shard_state);
  std::vector<std::pair<std::string, torch::Tensor>> shard_optimizer_state(
      const std::vector<std::pair<std::string, torch::Tensor>>& full_state) const;

  // Buckets as indices into trainable_parameters(), in launch order (for tests and logs).
  std::vector<std::vector<size_t>> bucket_assignment() const;
  const std::vector<std::string>& trainable_parameter_names() const { return names_; }
  bool buckets_rebuilt() const { return rebuilt_; }
  // Seconds backward passes have spent blocked on bucket all-reduces since construction:
  // the communication that backward did not hide (the trainer's comm-wait time split).
  double comm_wait_seconds() const { return comm_wait_seconds_; }

 private:
  struct Bucket {
    torch::Tensor buffer;
    std::vector<size_t> params;      // indices into params_
    std::vector<torch::Tensor> views;  // one per member, shaped like the parameter
    size_t pending = 0;
    std::function<void()> complete;  // set once launched
    int64_t launched_us = -1;        // timeline only: when the all-reduce was launched
    torch::Tensor params_flat;       // shard_optimizer: the parameters' memory
  };
  // shard_optimizer: this worker's part of one parameter.
  struct Shard {
    size_t param = 0;
    size_t bucket = 0;
    int64_t begin = 0, end = 0;      // within the parameter's flat elements
    torch::Tensor values, grad;      // 1-D views of the parameter and its bucket gradient
  };
  struct Slot {
    size_t bucket = 0;
    size_t position = 0;  // within the bucket
  };

  void build_buckets(const std::vector<std::vector<size_t>>& assignment);
  void mark_ready(size_t param);
  void launch_ready_buckets();
  void finalize_backward();
  void reset_iteration();
  void rebuild_buckets();
  void mark_unused_ready(size_t param);
  void build_shards();

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  DDPOptions options_;
  CommHook hook_;

  std::vector<torch::Tensor> params_;  // trainable (requires_grad) parameters
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;  // keep hooks alive
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;

  std::mutex mutex_;
  bool sync_enabled_ = true;
  bool callback_queued_ = false;
  std::vector<bool> ready_;
  size_t next_bucket_ = 0;
  bool rebuilt_ = false;
  std::vector<size_t> arrival_order_;
  std::vector<size_t> static_unused_;  // static_graph: parameters unused in the first step
  bool static_known_ = false;
  double comm_wait_seconds_ = 0;
  bool sharded_ = false;
  // On one host with every parameter on the CPU: one copy of the parameters can serve all workers.
  bool parameters_can_be_shared() const;
  bool shared_params_ = false;  // sharded, one node: the parameters are one copy every worker maps
  std::vector<Shard> shards_;
};

}  // namespace replica::ddp
