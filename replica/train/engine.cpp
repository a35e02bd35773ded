#include "replica/train/engine.h"

#include "replica/core/cuda.h"
#include "replica/core/error.h"
#include "replica/core/system.h"
#include "replica/ddp/ddp.h"
#include "replica/distributed/process_group.h"
#include "replica/train/checkpoint.h"
#include "replica/train/optim.h"
#include "replica/train/workload.h"
#include "replica/zero/checkpoint.h"
#include "replica/zero/zero3.h"

#include <sys/resource.h>
#include <torch/torch.h>

#include <limits>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

bool is_zero3_checkpoint(const std::string& dir) { return fs::exists(fs::path(dir) / "zero" / "metadata.json"); }

// The L2 norm over every gradient (DDP's gradients are already the global average), clipped
// to max_norm by torch::nn::utils::clip_grad_norm_'s formula (the referees' clipping), without
// its read of the norm at the end; max_norm infinity measures in float64 only.
torch::Tensor whole_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads, norms;
  for (const auto& param : params) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  if (grads.empty()) return torch::zeros({}, torch::kDouble);
  const bool measure_only = std::isinf(max_norm);
  for (const auto& g : grads) norms.push_back(measure_only ? g.norm(2.0).to(torch::kDouble) : g.norm(2.0));
  const torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2.0);
  if (!measure_only) {
    const torch::Tensor coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
    for (auto& g : grads) g.mul_(coef);
  }
  return total.to(torch::kDouble);
}

}  // namespace

std::string ParallelEngine::memory_peaks() const {
  std::string out = fmt::format("; peak RSS {:.1f} MiB", peak_rss_mib());
  if (device_.is_cuda()) {
    const GpuMemory m = gpu_memory(device_.index());
    out += fmt::format("; {} peak allocated {:.1f} MiB, reserved {:.1f} MiB", device_.str(), m.peak_allocated / kMiB,
                       m.peak_reserved / kMiB);
  }
  return out;
}

namespace {

class DdpEngine final : public ParallelEngine {
 public:
  DdpEngine(const RunParams& p, std::shared_ptr<torch::nn::Module> model, std::shared_ptr<distributed::ProcessGroup> pg,
            torch::Device device)
      : ParallelEngine(device), model_(std::move(model)), pg_(std::move(pg)) {
    ddp::DDPOptions options;
    // Note [ZeRO stages]: stage 0 (or auto) keeps shard_optimizer's choice (nullopt: auto,
    // decided by DDP); stages 1 and 2 shard the step, 2 also reduce-scatters the gradients.
    stage_ = p.zero_stage;
    options.shard_optimizer = stage_ == 1 || stage_ == 2 ? std::optional<bool>(true) : p.shard_optimizer;
    if (stage_ == 0) options.shard_optimizer = false;
    // Adafactor steps whole parameters (Note [Adafactor needs whole parameters] in adafactor.h):
    // auto does not shard for it (the config refuses an explicit sharding).
    if (p.optimizer == OptimizerKind::Adafactor && !options.shard_optimizer) options.shard_optimizer = false;
    options.reduce_scatter_gradients = stage_ != 1;
    ddp_ = std::make_unique<ddp::DistributedDataParallel>(model_, pg_, options);
    if (ddp_->sharded()) {
      // The optimizer steps this worker's shards instead of the parameters.
      params_ = ddp_->shard_parameters();
      names_ = ddp_->shard_names();
    } else {
      for (auto& item : model_->named_parameters()) {
        if (!item.value().requires_grad()) continue;
        params_.push_back(item.value());
        names_.push_back(item.key());
      }
    }
  }

  void backward(const torch::Tensor& loss, bool sync) override {
    if (sync) {
      loss.backward();
    } else {
      auto no_sync = ddp_->no_sync();
      loss.backward();
    }
  }
  double comm_wait_seconds() const override { return ddp_->comm_wait_seconds(); }

  torch::Tensor clip_grad_norm(double max_norm) override {
    if (ddp_->sharded()) return ddp_->clip_grad_norm(max_norm);
    return whole_grad_norm(params_, max_norm);
  }

  void after_step() override {
    if (ddp_->sharded()) ddp_->after_step();  // all-gather the updated shards
  }

  void save_checkpoint(Workload& workload, torch::optim::Optimizer& optimizer, OptimizerKind kind,
                       const fs::path&, Checkpoint& c) override {
    auto state = optimizer_state(optimizer, kind, params_, names_);
    // Sharded: the full optimizer state, gathered from every worker's shards (collective).
    if (ddp_->sharded()) state = ddp_->full_optimizer_state(state);
    if (pg_->rank() != 0) return;
    c.model = workload.state_tensors();
    c.optimizer = std::move(state);
  }

  void load_checkpoint(const std::string& dir, const Checkpoint& c, Workload& workload,
                       torch::optim::Optimizer& optimizer, OptimizerKind kind) override {
    if (is_zero3_checkpoint(dir)) {
      fail("{} was written with distributed_backend zero3; resume with the same backend (or `replica "
           "consolidate` it into a full model)",
           dir);
    }
    workload.load_state_tensors(c.model, dir + "/" + workload.checkpoint_model_file());
    // Checkpoints hold the full optimizer state; a sharded DDP takes its shards of it.
    load_optimizer_state(optimizer, kind, params_, names_, ddp_->shard_optimizer_state(c.optimizer));
    // Parameters shared by the workers of a host were loaded by each of them: all done
    // before anyone steps.
    if (ddp_->parameters_shared()) pg_->shared_barrier().wait();
  }

  std::string memory_report(int64_t optimizer_bytes) override {
    int64_t param_bytes = 0, grad_bytes = 0;
    for (auto& t : model_->parameters()) {
      param_bytes += t.numel() * static_cast<int64_t>(t.element_size());
      if (t.requires_grad()) grad_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    }
    // Sharded without zero_stage 1 is stage 2 (the buckets are reduce-scattered).
    const std::string kind = !ddp_->sharded() ? std::string(",")
                             : fmt::format(" (sharded optimizer),{} ZeRO stage {},",
                                           ddp_->parameters_shared() ? " parameters shared by the host's workers," : "",
                                           stage_ == 1 ? 1 : 2);
    return fmt::format("rank {}: backend ddp{} per-worker model state: {:.1f} MiB parameters + {:.1f} MiB gradients + "
                       "{:.1f} MiB optimizer = {:.1f} MiB{}",
                       pg_->rank(), kind, param_bytes / kMiB, grad_bytes / kMiB, optimizer_bytes / kMiB,
                       (param_bytes + grad_bytes + optimizer_bytes) / kMiB, memory_peaks());
  }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  std::unique_ptr<ddp::DistributedDataParallel> ddp_;
  int stage_ = -1;  // params.zero_stage (-1: auto)
};

class Zero3Engine final : public ParallelEngine {
 public:
  Zero3Engine(const RunParams& p, std::shared_ptr<torch::nn::Module> model, std::shared_ptr<distributed::ProcessGroup> pg,
              torch::Device device)
      : ParallelEngine(device), model_(std::move(model)), pg_(std::move(pg)) {
    zero::Zero3Options options;
    options.stage3_prefetch_bucket_size = p.stage3_prefetch_bucket_size;
    options.stage3_param_persistence_threshold = p.stage3_param_persistence_threshold;
    options.stage3_max_live_parameters = p.stage3_max_live_parameters;
    options.stage3_max_reuse_distance = p.stage3_max_reuse_distance;
    if (p.offload_param_device == OffloadDevice::Nvme) options.param_swap_dir = p.nvme_path;
    options.master_on_host = p.offload_param_device == OffloadDevice::Cpu;  // nvme: files, on the host too
    options.reduce_bucket_size = p.reduce_bucket_size;
    options.overlap_comm = p.overlap_comm;
    zero_ = std::make_unique<zero::Zero3>(model_, pg_, options);
    params_ = zero_->shard_parameters();
    names_ = zero_->shard_names();
  }

  // ZeRO-3 reduces each layer's gradients as backward leaves it; nothing to defer.
  void backward(const torch::Tensor& loss, bool) override { loss.backward(); }
  torch::Tensor clip_grad_norm(double max_norm) override { return zero_->clip_grad_norm(max_norm); }
  void after_step() override { zero_->after_step(); }
  // Workers may run different numbers of forwards in an evaluation, so nothing may be
  // gathered per layer: the whole model is gathered for it.
  void eval_begin() override { zero_->gather_all(); }
  void eval_end() override { zero_->release_all(); }
  void gather_full_model() override { zero_->gather_all(); }  // final/ is the full model

  void save_checkpoint(Workload& workload, torch::optim::Optimizer& optimizer, OptimizerKind kind,
                       const fs::path& staging, Checkpoint& c) override {
    // Every worker writes its shard; rank 0 moves them into the checkpoint it writes.
    zero::save_shards(staging.string(), *zero_, optimizer_state(optimizer, kind, params_, names_));
    pg_->barrier();
    if (pg_->rank() != 0) return;
    c.model.clear();
    c.optimizer.clear();
    auto extras = c.extras;
    c.extras = [extras, staging](const std::string& dir) {
      if (extras) extras(dir);
      fs::rename(staging, fs::path(dir) / "zero");
    };
  }

  void load_checkpoint(const std::string& dir, const Checkpoint&, Workload&, torch::optim::Optimizer& optimizer,
                       OptimizerKind kind) override {
    if (!is_zero3_checkpoint(dir)) {
      fail("{} was written with distributed_backend ddp; resume with the same backend", dir);
    }
    // Re-sharded when the checkpoint was written by another number of workers.
    auto slice = zero::load_shards((fs::path(dir) / "zero").string(), pg_->rank(), pg_->size());
    zero_->load_shards(slice.masters, dir + "/zero");
    load_optimizer_state(optimizer, kind, params_, names_, slice.optimizer);
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : slice.buffers) {
      if (auto* b = model_->named_buffers().find(name)) b->copy_(t);
    }
  }

  std::string memory_report(int64_t optimizer_bytes) override {
    zero_->release_all();
    const zero::MemoryStats m = zero_->memory();
    const int64_t total = m.master_bytes + m.master_grad_bytes + optimizer_bytes + m.peak_gathered_bytes +
                          m.peak_transient_grad_bytes;
    return fmt::format("rank {}: backend zero3, per-worker model state: {:.1f} MiB master shards + {:.1f} MiB gradient "
                       "shards + {:.1f} MiB optimizer shards + peak {:.1f} MiB gathered parameters + peak {:.1f} MiB "
                       "transient gradients = {:.1f} MiB at most{}",
                       pg_->rank(), m.master_bytes / kMiB, m.master_grad_bytes / kMiB, optimizer_bytes / kMiB,
                       m.peak_gathered_bytes / kMiB, m.peak_transient_grad_bytes / kMiB, total / kMiB,
                       memory_peaks());
  }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  std::unique_ptr<zero::Zero3> zero_;
};

}  // namespace

// Note [worker device]
// Where a worker computes is decided once, here, before anything is allocated: `device: cpu`
// is the CPU; `cuda` is cuda:LOCAL_RANK, or cuda:0 when this process sees a single GPU (each
// task its own, as Slurm's --gpus-per-task or a per-worker CUDA_VISIBLE_DEVICES arrange);
// `auto` is `cuda` when a GPU is visible, else the CPU. A LOCAL_RANK without a GPU of its own
// is an error naming the rank and the count. The device then picks the process group's
// backend (NCCL for CUDA, Gloo for the CPU; ddp_backend: gloo keeps Gloo on GPUs too, where
// NCCL cannot go: several workers on one GPU, which NCCL refuses, e.g. a world-2 check on a
// one-GPU machine; the workers past the GPU count then share them round robin), and the
// engine moves the model there once, before
// DDP or ZeRO-3 wraps it; the CPU-only fast paths (the shared-memory transport, FusedSGD's
// loop, FusedLinear's gradient homes) see CUDA tensors and step aside, each in its own place.
int gpus_for(DeviceKind kind, const std::string& who) {
  if (kind == DeviceKind::Cpu) return 0;
  const int gpus = visible_gpu_count();
  if (gpus == 0 && kind == DeviceKind::Cuda) {
    fail("{}device cuda asked for, but no GPU is visible (CUDA_VISIBLE_DEVICES={}); use device: cpu", who,
         env("CUDA_VISIBLE_DEVICES").value_or("unset"));
  }
  return gpus;
}

torch::Device worker_device(DeviceKind kind, const distributed::WorldInfo& world, bool gpus_shared) {
  const int gpus = gpus_for(kind, fmt::format("rank {}: ", world.rank));
  if (gpus == 0) return torch::kCPU;
  const int index = gpus == 1 ? 0 : gpus_shared ? world.local_rank % gpus : world.local_rank;
  if (index >= gpus) {
    fail("rank {}: LOCAL_RANK {} has no GPU of its own: {} GPU{} visible on this node for {} workers; start "
         "at most {} workers per node (--nproc-per-node), or set device: cpu",
         world.rank, world.local_rank, gpus, gpus == 1 ? " is" : "s are", world.local_world_size, gpus);
  }
  set_current_gpu(index);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

std::string process_group_backend(const std::string& ddp_backend, torch::Device device) {
  if (ddp_backend == "nccl" && !device.is_cuda()) {
    fail("ddp_backend nccl needs workers on GPUs, but this worker computes on the CPU (device: {}); use "
         "ddp_backend auto or gloo, or device: cuda",
         device.str());
  }
  if (ddp_backend == "gloo") return "gloo";
  return device.is_cuda() ? "nccl" : "gloo";
}

// Note [ZeRO stages]
// DeepSpeed's zero_stage, by what each stage shards (zero_stage_of resolves "auto": 3 for
// distributed_backend deepspeed/zero3, AutoTrain's meaning; 0 for ddp):
//   0  plain DDP: every worker holds and steps everything (shard_optimizer may still shard
//      the step when left auto: on for CPU workers sharing one host, bench/README.md);
//   1  DDP with the optimizer state and step sharded: gradient buckets all-reduced, each
//      worker steps its 1/N of the parameters, the new values all-gathered;
//   2  as 1, with the buckets reduce-scattered: each worker receives the averaged gradient of
//      its own shard only (half the traffic). The buckets backward writes into stay whole on
//      every worker (they are reused step after step), so what stage 2 saves over stage 1 is
//      communication, not gradient memory;
//   3  ZeRO-3 (replica/zero/zero3.h): parameters sharded too, gathered per layer.
// Stages 1 and 2 write the checkpoints plain DDP writes (full optimizer state), stage 3 the
// shard checkpoints; the offload keys say where the optimizer state (Note [optimizer offload]
// in optim.cpp) and ZeRO-3's parameter shards (nvme: files under nvme_path) live.
std::unique_ptr<ParallelEngine> make_engine(const RunParams& params, std::shared_ptr<torch::nn::Module> model,
                                            std::shared_ptr<distributed::ProcessGroup> pg, torch::Device device) {
  if (params.deepspeed_train_batch_size > 0) {
    const int64_t global = static_cast<int64_t>(params.batch_size) * params.gradient_accumulation * pg->size();
    if (global != params.deepspeed_train_batch_size) {
      fail("{}: train_batch_size is {}, but train_micro_batch_size_per_gpu x gradient_accumulation_steps x workers "
           "is {} x {} x {} = {}; make them agree (or set train_batch_size to \"auto\")",
           params.deepspeed, params.deepspeed_train_batch_size, params.batch_size, params.gradient_accumulation,
           pg->size(), global);
    }
  }
  model->to(device);
  if (zero_stage_of(params) == 3) {
    return std::make_unique<Zero3Engine>(params, std::move(model), std::move(pg), device);
  }
  return std::make_unique<DdpEngine>(params, std::move(model), std::move(pg), device);
}

}  // namespace replica::train
