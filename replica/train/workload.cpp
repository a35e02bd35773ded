// The task -> workload table, and what every workload does unless it says otherwise.
#include "replica/train/workload.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/train/task.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>

namespace replica::train {

namespace fs = std::filesystem;

io::NamedTensors Workload::state_tensors() {
  io::NamedTensors out;
  auto m = model();
  for (auto& item : m->named_parameters()) out.emplace_back(item.key(), item.value().detach());
  for (auto& item : m->named_buffers()) out.emplace_back(item.key(), item.value().detach());
  return out;
}

void Workload::load_state_tensors(const io::NamedTensors& tensors, const std::string& where) {
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  torch::NoGradGuard no_grad;
  auto m = model();
  auto assign = [&](const std::string& name, torch::Tensor& target) {
    auto it = by_name.find(name);
    if (it == by_name.end()) fail("{}: tensor '{}' is missing", where, name);
    if (it->second.sizes() != target.sizes()) {
      fail("{}: tensor '{}' has shape {} but the model expects {}", where, name,
           c10::str(it->second.sizes()), c10::str(target.sizes()));
    }
    target.copy_(it->second);
  };
  for (auto& item : m->named_parameters()) assign(item.key(), item.value());
  for (auto& item : m->named_buffers()) assign(item.key(), item.value());
}

torch::Tensor Workload::train_loss_sum(const std::vector<int64_t>& indices) {
  fail("this workload counts loss items but has no summed training loss");
}

void Workload::save_final(const std::string& final_dir) {
  fs::create_directories(final_dir);
  io::save_safetensors((fs::path(final_dir) / "model.safetensors").string(), state_tensors(), {{"format", "pt"}});
  write_file_atomically((fs::path(final_dir) / "config.json").string(), model_config().dump(2) + "\n");
}


std::unique_ptr<Workload> make_workload(const RunConfig& config, const WorkloadContext& context) {
  return task_spec(config.task).make(config, context);
}

void check_workload_config(const RunConfig& config) {
  if (const auto check = task_spec(config.task).check) check(config);
}

}  // namespace replica::train
