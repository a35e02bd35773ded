// A workload: the task-specific half of training (model, data, loss, evaluation). The
// trainer owns everything generic (distribution, loop, schedule, checkpoints, metrics) and
// talks to a task only through this interface, so new tasks (LLM SFT, two-tower) plug in
// without touching the loop.
#pragma once

#include "replica/distributed/process_group.h"
#include "replica/distributed/world.h"
#include "replica/train/run_config.h"
#include "replica/io/safetensors.h"

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace replica::train {

// What a workload is handed about the worker it runs in, instead of reading the environment.
struct WorkloadContext {
  // Null in a world of one; for workloads whose forward pass communicates (SyncBatchNorm,
  // in-batch negatives across ranks).
  std::shared_ptr<distributed::ProcessGroup> pg;
  distributed::WorldInfo world;  // rank, world size, this host's workers
  int threads = 1;               // intra-op threads of this worker
  torch::Device device = torch::kCPU;
  bool is_main() const { return world.rank == 0; }  // reports on the data, writes final/
  // A batch tensor (built on the CPU) where the model is: on CUDA copied from pinned memory
  // without blocking the host (the copy is ordered before the kernels that read it).
  torch::Tensor on_device(const torch::Tensor& t) const {
    if (!t.defined() || !device.is_cuda()) return t;
    return t.pin_memory().to(device, /*non_blocking=*/true);
  }
};

struct EvalSums {
  double loss_sum = 0;   // summed over samples (or over tokens when `tokens` > 0)
  double correct = 0;    // for accuracy; 0 where not meaningful
  double count = 0;      // samples
  double tokens = 0;     // LLMs: loss_sum and correct are per predicted token, this many
  // Further sums, written as eval_<name> = sum / count (e.g. recall_at_10). Every rank must
  // return the same names.
  std::map<std::string, double> extra;
};

// What a task adds to the run's model card (model_card.h): the Hub's library_name and tags, and
// how to load final/ (markdown).
struct ModelCardInfo {
  std::string library_name;
  std::vector<std::string> tags;
  std::string usage;
};

class Workload {
 public:
  virtual ~Workload() = default;
  virtual std::shared_ptr<torch::nn::Module> model() = 0;
  virtual int64_t train_size() const = 0;
  virtual int64_t valid_size() const = 0;  // 0: no evaluation
  // Mean loss over the given training samples (graph attached for backward).
  virtual torch::Tensor train_loss(const std::vector<int64_t>& indices) = 0;
  // Summed loss and correct predictions over the given validation samples.
  virtual EvalSums evaluate(const std::vector<int64_t>& indices) = 0;
  // What final/config.json says about the model.
  virtual nlohmann::json model_config() const = 0;

  // Checkpoint contents. Default: every parameter and buffer of model() in
  // checkpoint-STEP/model.safetensors. A PEFT run keeps only the adapter
  // (adapter_model.safetensors + adapter_config.json, PEFT's names).
  virtual std::string checkpoint_model_file() const { return "model.safetensors"; }
  virtual io::NamedTensors state_tensors();
  virtual void load_state_tensors(const io::NamedTensors& tensors, const std::string& where);
  // Extra files a checkpoint directory needs besides the tensors (adapter_config.json).
  virtual void write_checkpoint_extras(const std::string& dir) const {}
  // Writes project/final/: default model.safetensors + config.json.
  virtual void save_final(const std::string& final_dir);
  // The task's part of README.md (model_card.h); default: none.
  virtual ModelCardInfo model_card() const { return {}; }
  // Tokens in the given training samples (0 when the task has no tokens): tokens_per_s.
  virtual int64_t tokens_in(const std::vector<int64_t>& indices) const { return 0; }

  // Token-weighted losses (LLMs). loss_items: the number of loss terms (predicted tokens) in
  // the given training samples, or -1 (the default) when train_loss is already the right
  // mean for a micro-batch. When it is >= 0, the trainer adds it up over one optimizer
  // step's micro-batches on every rank and calls train_loss_sum instead of train_loss,
  // scaling it so that the step's gradient is the mean over every counted token of the
  // global batch, whatever the world size, batch split and accumulation (Hugging Face
  // Trainer's num_items_in_batch): rows holding more tokens weigh more.
  virtual int64_t loss_items(const std::vector<int64_t>& indices) const { return -1; }
  // Summed (not averaged) loss over the given training samples (graph attached).
  virtual torch::Tensor train_loss_sum(const std::vector<int64_t>& indices);
  // The per-forward term of the last train_loss_sum (a mixture-of-experts router's
  // load-balancing loss, already times its coefficient), handed over once; undefined where
  // there is none. A mean per forward, not a sum over items: the trainer adds it averaged over
  // the step's micro-batches and (through the gradient average) the ranks.
  virtual torch::Tensor train_aux_loss() { return {}; }
  // Further training metrics of the last train_loss / train_loss_sum (DPO's rewards/chosen,
  // ...), each a mean over its micro-batch, handed over once; the step log writes their mean
  // over the logging window's micro-batches and the ranks. Every rank must return the same names.
  virtual std::map<std::string, double> train_metrics() { return {}; }
  // A hint: train_loss will be asked for these samples next. A workload may prepare the batch
  // (decode, augment) on a background thread meanwhile, so the workers never wait on data.
  virtual void prefetch(const std::vector<int64_t>& indices) {}

  // The state of the workload's own random draws (augmentation), written to the checkpoint's
  // rng_state.safetensors beside the global generator's and handed back on resume, so that a
  // resumed run draws what the uninterrupted run draws. Only rank 0's is saved, so it must
  // be the same on every rank. Names must not clash with "cpu" and "cuda" (the global generators).
  virtual io::NamedTensors rng_state() const { return {}; }
  virtual void load_rng_state(const io::NamedTensors& tensors, const std::string& where) {}
};

// The workload of `config.task` (its TaskSpec's factory, task.h).
std::unique_ptr<Workload> make_workload(const RunConfig& config, const WorkloadContext& context);

// The task's checks that need no worker (files, unsupported features such as quantization),
// made before any worker starts; replica::Error naming the key.
void check_workload_config(const RunConfig& config);

}  // namespace replica::train
