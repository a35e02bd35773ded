// A workload: the task-specific half of training (model, data, loss, evaluation). The
// trainer owns everything generic (distribution, loop, schedule, checkpoints, metrics) and
// talks to a task only through this interface, so new tasks (LLM SFT, two-tower) plug in
// without touching the loop.
#pragma once

#include "replica/io/config.h"
#include "replica/io/safetensors.h"

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace replica::train {

struct EvalSums {
  double loss_sum = 0;   // summed over samples
  double correct = 0;    // for accuracy; 0 where not meaningful
  double count = 0;      // samples
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
  // Tokens in the given training samples (0 when the task has no tokens): tokens_per_s.
  virtual int64_t tokens_in(const std::vector<int64_t>& indices) const { return 0; }
};

// The workload `config.task` names; replica::Error for a task this build cannot run.
std::unique_ptr<Workload> make_workload(const io::RunConfig& config);

}  // namespace replica::train
