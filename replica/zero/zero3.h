// replica::zero::Zero3: DeepSpeed ZeRO stage 3 for any torch::nn::Module: parameters,
// gradients and optimizer state sharded across the workers.
//
// How, and why:
// - Groups. A model that implements models::HookedLayers (MLP, Llama) gives one parameter
//   group per layer (trainable and frozen parameters in separate groups: LoRA keeps its base
//   frozen and sharded, its adapters trainable); parameters outside every layer form a last
//   group, as does the whole model when it has no layers. Each group's parameters live in one
//   flat buffer of N * S elements (N workers, S = ceil(numel / N), zero padding at the end);
//   worker r owns elements [r*S, (r+1)*S): its fp32 master shard, the optimizer runs on it.
//   A parameter shared by two layers (tied embeddings) belongs to the first; the other layer
//   gathers that group too.
// - Gather on demand. Before a layer's forward its groups are all-gathered into the flat
//   buffer (the parameters are views into it) and freed right after (the buffer's storage is
//   resized to zero bytes, so autograd's saved references stay valid). An autograd node on
//   the layer's output gathers them again when the backward reaches the layer (unless the
//   layer is kept gathered for that reuse: stage3_max_reuse_distance). With
//   overlap_comm the next layer's groups are gathered on a helper thread while the current
//   layer computes (stage3_prefetch_bucket_size bounds the elements prefetched,
//   stage3_max_live_parameters the elements gathered at once).
// - Groups below stage3_param_persistence_threshold elements are persistent: gathered once
//   and after every optimizer step, never freed (their gradient and optimizer state are still
//   sharded).
// - Gradients. A post-hook on each parameter's gradient accumulator counts the group's
//   gradients in; when the last arrives the group's gradients are flattened, averaged across
//   workers and this worker's slice added to its master shard's .grad; the full gradients
//   and (all parameters being trainable) the gathered parameters are freed. Groups that got
//   no gradient are reduced with zeros when the backward ends. Gradient accumulation is the
//   sum of these per-micro-batch reductions.
// - Collectives: with the shared-memory transport (the workers of one host) the all-gather
//   and the reduce-scatter are both the transport's all-reduce: an all-gather is the sum of
//   buffers that are zero except for each worker's own slice, a reduce-scatter an all-reduce
//   of which each worker keeps its slice (the shared-memory all-reduce moves ~20 GB/s against
//   Gloo's ~1 GB/s over loopback; bench/README.md, ZeRO-3 section). Without it (across hosts,
//   REPLICA_TRANSPORT=gloo, NCCL) the backend's own all-gather and reduce-scatter over the
//   group's N x S layout (ProcessGroup::*_chunks), half an all-reduce's traffic each.
// - Devices: see Note [ZeRO-3 on the device] below.
// - All workers issue the same collectives in the same order because they run the same graph.
//   Evaluation runs with every group gathered (gather_all), so workers may run different
//   numbers of forwards.
//
// Note [ZeRO-3 on the device]
// Each group's flat buffer lives where its parameters are (the engine moves the model to the
// worker's device once, before wrapping it): on a GPU the buffer is the CUDA caching
// allocator's, "freed" by resizing its storage to zero bytes as on the host, so the memory goes
// back to the allocator's pool for the next layer's gather (the peaks the memory report shows
// are the allocator's, engine.cpp). The masters live with the buffer, so the optimizer steps on
// the device, unless master_on_host (offload_param_device cpu or nvme): then they are pinned
// host memory (or files), gathers copy each shard up, and the reductions copy this worker's
// slice of the averaged gradient down. Collectives: under NCCL the backend's all-gather and
// reduce-scatter (ProcessGroup::native_chunks); NCCL runs them on its own stream, and Work::wait
// makes the computing stream wait for them without blocking the host, so a prefetched gather
// overlaps the layer in flight. Releasing a buffer after wait() is safe without recordStream:
// the free is ordered on the computing stream after the collective. Under Gloo with CUDA tensors
// (several workers on one GPU, where NCCL refuses) both go through Gloo's all-reduce.
//
// Usage:
//   Zero3 zero(model, process_group, options);
//   auto optimizer = make_optimizer(spec, zero.shard_parameters());
//   loss = ...; loss.backward();          // gathers, reduce-scatters
//   zero.clip_grad_norm(1.0);             // global norm across shards
//   optimizer->step();
//   zero.after_step();                    // persistent groups take the new values
#pragma once

#include "replica/distributed/process_group.h"
#include "replica/io/safetensors.h"
#include "replica/models/layer_hooks.h"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace replica::zero {

// DeepSpeed's names and defaults (zero_optimization in a DeepSpeed config).
struct Zero3Options {
  double stage3_prefetch_bucket_size = 5e7;        // elements gathered ahead of use
  double stage3_param_persistence_threshold = 1e5;  // groups smaller stay gathered
  double stage3_max_live_parameters = 1e9;          // elements gathered at once (prefetch stops)
  // A layer whose backward comes within this many gathered elements of its forward (the
  // layers after it) stays gathered from its forward to its backward, within
  // stage3_max_live_parameters. Engine option only (not a params key yet).
  double stage3_max_reuse_distance = 1e9;
  double reduce_bucket_size = 5e8;                  // accepted; every group is reduced whole
  bool overlap_comm = true;                         // prefetch the next layer's gather
  // offload_param_device nvme: the fp32 master shards live in files in this directory
  // (replica/core/file_tensor.h); empty: in RAM.
  std::string param_swap_dir;
  // offload_param_device cpu for parameters on a GPU: the fp32 master shards in pinned host
  // memory, not on the device (Note [ZeRO-3 on the device]). No effect on CPU parameters, nor
  // with param_swap_dir (the masters are files then, on the host either way).
  bool master_on_host = false;
};

// What the engine measured, in bytes per worker.
struct MemoryStats {
  int64_t master_bytes = 0;          // fp32 master shards
  int64_t master_grad_bytes = 0;     // their gradients
  int64_t peak_gathered_bytes = 0;   // full parameters gathered at once, at most
  int64_t peak_transient_grad_bytes = 0;  // full gradients of one group while it is reduced
};

class Zero3 : private models::LayerHooks {
 public:
  Zero3(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<distributed::ProcessGroup> process_group,
        Zero3Options options = {});
  ~Zero3() override;
  Zero3(const Zero3&) = delete;
  Zero3& operator=(const Zero3&) = delete;

  // The fp32 master shards of the trainable groups (leaves; .grad holds the reduced shard
  // gradient after backward): what the optimizer steps. shard_names() names them.
  std::vector<torch::Tensor> shard_parameters() const;
  std::vector<std::string> shard_names() const;

  // Global-norm clipping across all shards (torch::nn::utils::clip_grad_norm_'s formula);
  // returns the norm before clipping, a 0-dim float64 tensor not yet read. Collective.
  torch::Tensor clip_grad_norm(double max_norm);
  // After optimizer.step(): persistent groups are gathered again from the new shards.
  void after_step();

  // Gathers every group and keeps it gathered until release_all(): evaluation, saving.
  // Collective.
  void gather_all();
  void release_all();

  // Master shards by group name (for checkpoints), and their restore; load_shards copies
  // `shards` (name -> this worker's [S] slice, any float dtype) into the masters and
  // re-gathers persistent groups. replica::Error names a missing or misshapen shard.
  io::NamedTensors master_shards() const;
  void load_shards(const io::NamedTensors& shards, const std::string& where);

  // What the shards hold: one entry per group (for checkpoints and consolidation).
  struct ParamSlot {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset = 0;  // in the group's flat buffer
  };
  struct GroupInfo {
    std::string name;     // "group.K"
    int64_t numel = 0;    // unpadded
    int64_t shard = 0;    // S
    bool trainable = false;
    bool persistent = false;
    torch::ScalarType dtype = torch::kFloat32;  // of the model's parameters
    std::vector<ParamSlot> params;
  };
  std::vector<GroupInfo> groups() const;

  MemoryStats memory() const;
  distributed::ProcessGroup& process_group() { return *pg_; }
  torch::nn::Module& module() { return *model_; }

 private:
  struct Group;
  void before(torch::nn::Module& layer) override;
  torch::Tensor after(torch::nn::Module& layer, torch::Tensor output) override;
  friend struct PreBackward;
  void pre_backward(int64_t layer);

  void gather(Group& g);
  void release(Group& g);
  void reduce(Group& g);
  bool reduce_native(Group& g, torch::Tensor& master_grad);
  void reduce_all(Group& g, torch::Tensor& master_grad);
  void on_grad_ready(size_t group);
  void finalize_backward();
  void queue_finalize();
  void note_gathered(int64_t delta);

  std::shared_ptr<torch::nn::Module> model_;
  models::HookedLayers* hooked_ = nullptr;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  Zero3Options options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<torch::nn::Module*> layers_;             // hooked layers, forward order
  std::map<const torch::nn::Module*, size_t> layer_index_;
  std::vector<std::vector<size_t>> layer_groups_;      // groups each layer uses
  std::vector<int64_t> reuse_distance_;                // elements of the later layers' groups
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;
  std::mutex mutex_;
  bool hold_all_ = false;
  bool finalize_queued_ = false;
  int64_t gathered_bytes_ = 0;
  MemoryStats stats_;
};

}  // namespace replica::zero
