// The seam between the trainer and how a model is made data-parallel. An engine is applied
// once, to the model (like torchtitan's parallelize step); after that the training loop asks
// it for what to step and hands it each backward and each step, and never asks which engine
// it is. Three engines sit behind it:
//   ddp                      DistributedDataParallel: the model replicated, gradients
//                            all-reduced in buckets during backward;
//   ddp, sharded optimizer   the same, with each worker stepping 1/N of the parameters
//                            (shard_optimizer, the default on one host), then an all-gather;
//   zero3                    ZeRO-3: parameters, gradients and optimizer state sharded,
//                            layers gathered around their forward and backward.
// make_engine() is the one place that reads params.distributed_backend (with the key table,
// which writes ZeRO-3's keys to training_params.json only for zero3 runs).
#pragma once

#include "replica/io/safetensors.h"
#include "replica/train/run_config.h"

#include "replica/distributed/world.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace replica::distributed {
class ProcessGroup;
}

namespace replica::train {

class Workload;
struct Checkpoint;

class ParallelEngine {
 public:
  explicit ParallelEngine(torch::Device device) : device_(device) {}
  virtual ~ParallelEngine() = default;

  // Where the model lives and computes (worker_device): autocast, batches and memory follow it.
  torch::Device device() const { return device_; }

  // What the optimizer steps (the trainable parameters, or this worker's shards of them) and
  // their names (for the optimizer state in checkpoints).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }

  // loss.backward(); sync = false on the micro-steps before the last of a gradient
  // accumulation group (gradients stay local where the engine can defer communication).
  virtual void backward(const torch::Tensor& loss, bool sync) = 0;
  // Seconds backward passes spent blocked on communication since the engine was made.
  virtual double comm_wait_seconds() const { return 0; }
  // The global gradient norm over every worker's gradients, clipped to max_norm (infinity:
  // the norm only). Collective. The norm is a 0-dim float64 tensor on the gradients' device, not
  // read: on a GPU the step goes on without waiting for it (Note [the gradient norm stays on the
  // GPU] in distributed/grad_norm.cpp).
  virtual torch::Tensor clip_grad_norm(double max_norm) = 0;
  // After optimizer.step(): shards back into the model. Collective where sharded.
  virtual void after_step() {}
  // Around an evaluation, whose workers may run different numbers of forwards.
  virtual void eval_begin() {}
  virtual void eval_end() {}
  // Before final/ is written: the whole model in place on every worker. Collective.
  virtual void gather_full_model() {}

  // A checkpoint's engine part. Collective: every worker calls it. `staging` is a directory
  // (in the project) the engine may write this worker's shards into; on rank 0 `checkpoint`
  // receives the model tensors, the optimizer state and the files to move into place.
  virtual void save_checkpoint(Workload& workload, torch::optim::Optimizer& optimizer, OptimizerKind kind,
                               const std::filesystem::path& staging, Checkpoint& checkpoint) = 0;
  // Restores what save_checkpoint wrote into `dir` (the model through the workload, the
  // optimizer state). replica::Error when `dir` was written by another kind of engine.
  virtual void load_checkpoint(const std::string& dir, const Checkpoint& checkpoint, Workload& workload,
                               torch::optim::Optimizer& optimizer, OptimizerKind kind) = 0;

  // "rank R: backend ...: per-worker model state ...; peak RSS ..." for the end of a run.
  virtual std::string memory_report(int64_t optimizer_bytes) = 0;

 protected:
  // "; peak RSS ... MiB", and on a GPU its caching allocator's peaks.
  std::string memory_peaks() const;

  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  torch::Device device_;
};

// The engine `params.distributed_backend` (and shard_optimizer, the ZeRO-3 knobs) asks for,
// applied to `model` over `pg`.
// Moves `model` to `device` once, before the engine wraps it.
std::unique_ptr<ParallelEngine> make_engine(const RunParams& params, std::shared_ptr<torch::nn::Module> model,
                                            std::shared_ptr<distributed::ProcessGroup> pg,
                                            torch::Device device = torch::kCPU);

// The GPUs a job on `kind` computes on: 0 for cpu (and for auto without a GPU), else the
// visible ones; cuda without a GPU is an error (`who` starts the message: "rank 1: ").
int gpus_for(DeviceKind kind, const std::string& who = "");

// The device this worker computes on (Note [worker device] in engine.cpp), made the current
// one; called before the first allocation and before the process group. `gpus_shared`
// (ddp_backend gloo): workers past the GPU count share them, cuda:(LOCAL_RANK % GPUs).
torch::Device worker_device(DeviceKind kind, const distributed::WorldInfo& world, bool gpus_shared = false);

// params.ddp_backend resolved for a worker on `device`: "nccl" or "gloo"; nccl for a CPU
// worker is an error naming the key.
std::string process_group_backend(const std::string& ddp_backend, torch::Device device);

}  // namespace replica::train
