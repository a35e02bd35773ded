#include "replica/train/run_state.h"

#include "replica/core/error.h"
#include "replica/distributed/process_group.h"
#include "replica/train/engine.h"
#include "replica/train/nonfinite.h"
#include "replica/train/project_dir.h"
#include "replica/train/workload.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <mutex>

namespace fs = std::filesystem;

namespace replica::train {

int64_t decide_start(const RunConfig& config, distributed::ProcessGroup& pg, int restart_count) {
  int64_t decision = -1;  // -1: fresh start; >= 0: the checkpoint step
  std::string error;
  if (pg.rank() == 0) {
    const fs::path project(config.project_name);
    // What a killed save left (project_dir.h says which, and why it is safe now).
    for (const auto& what : clean_stale_staging(project)) {
      spdlog::info("{}: {} (left by a killed save)", config.project_name, what);
    }
    for (const auto& other : lookalikes(project)) {
      spdlog::warn("{}: {}, not written by replica; resume, checkpoint rotation and --overwrite leave it alone",
                   other.path.string(), other.why);
    }
    if (config.params.overwrite && restart_count == 0) {
      // Only what a run wrote: a user's own files in the directory stay (project_dir.h).
      const size_t removed = remove_run_outputs(project);
      if (removed > 0) spdlog::info("--overwrite: removed {} entr{} of an earlier run from '{}'", removed,
                                    removed == 1 ? "y" : "ies", config.project_name);
    }
    // errors/ alone (a run that failed before it wrote anything else, e.g. on a busy port)
    // holds nothing a new run would replace or lose: it does not block a fresh start.
    const auto outputs = run_outputs(project);
    const bool only_errors = outputs.size() == 1 && outputs[0].filename() == "errors";
    // After a restart (max_restarts) the run continues from its own newest checkpoint whatever
    // resume_from_checkpoint said for its first start.
    const std::string resume_from = restart_count == 0 ? config.params.resume_from_checkpoint : "";
    if (!resume_from.empty() && resume_from != "false") {
      // A checkpoint named (run_config.cpp checked it is one of this project's): the newest, or
      // an older one only when none is newer (rotation would delete the newer ones' successors).
      const auto all = list_checkpoints(config.project_name);
      const fs::path named = fs::weakly_canonical(fs::absolute(resume_from));
      const auto it = std::find_if(all.begin(), all.end(),
                                   [&](const std::string& d) { return fs::weakly_canonical(fs::absolute(d)) == named; });
      if (it == all.end()) {
        error = fmt::format("resume_from_checkpoint '{}' is not a complete checkpoint of project '{}' (its "
                            "checkpoints: {})",
                            resume_from, config.project_name, all.empty() ? "none" : fmt::format("{}", fmt::join(all, ", ")));
      } else if (it != all.begin()) {
        error = fmt::format("resume_from_checkpoint '{}' is older than {}: continuing from it would mix two "
                            "histories in one project; resume from the newest (resume_from_checkpoint auto) or "
                            "use a new project_name",
                            resume_from, all.front());
      } else {
        decision = load_checkpoint(*it).state.global_step;
      }
    } else if (!outputs.empty() && !only_errors && resume_from == "false" && !list_checkpoints(config.project_name).empty()) {
      error = fmt::format("project '{}' holds checkpoints of an earlier run and resume_from_checkpoint is false; "
                          "use a new project_name, or --overwrite to remove them and start over",
                          config.project_name);
    } else if (!outputs.empty() && !only_errors) {
      std::vector<std::string> skipped;
      auto latest = latest_checkpoint(config.project_name, &skipped);
      if (latest) {
        decision = latest->state.global_step;
      } else if (!skipped.empty()) {
        error = fmt::format("project '{}' has no usable checkpoint to resume from (unreadable: {}); "
                            "use a new project_name or --overwrite for a fresh start",
                            config.project_name, fmt::join(skipped, ", "));
      } else if (restart_count == 0) {
        // An earlier run's outputs but nothing to resume: starting over would replace its
        // metrics.jsonl and config.yaml (PRODUCT.md: stop with an error naming them).
        std::vector<std::string> names;
        for (const auto& o : outputs) names.push_back(o.filename().string() + (fs::is_directory(o) ? "/" : ""));
        error = fmt::format("project '{}' holds the outputs of an earlier run ({}) and no checkpoint to "
                            "resume from; use a new project_name, or --overwrite to remove them and start over",
                            config.project_name, fmt::join(names, ", "));
      }
    }
  }
  torch::Tensor t = torch::tensor({decision, static_cast<int64_t>(error.empty() ? 0 : 1)}, torch::kLong);
  std::vector<torch::Tensor> msg{t};
  pg.broadcast(msg, 0);
  if (msg[0][1].item<int64_t>() != 0) {
    if (pg.rank() == 0) fail("{}", error);
    fail("rank {}: stopping: rank 0 found no usable checkpoint in '{}'", pg.rank(), config.project_name);
  }
  return msg[0][0].item<int64_t>();
}

TrainerState resume(const RunConfig& config, int64_t step, ParallelEngine& engine, Workload& workload,
                    torch::optim::Optimizer& optimizer, distributed::ProcessGroup& pg, int restart_count) {
  const auto& p = config.params;
  const std::string dir = (fs::path(config.project_name) / fmt::format("checkpoint-{}", step)).string();
  Checkpoint ckpt = load_checkpoint(dir);
  engine.load_checkpoint(dir, ckpt, workload, optimizer, p.optimizer);
  TrainerState state = ckpt.state;
  state.batch_size = p.batch_size;
  const int64_t saved_batch = ckpt.state.batch_size > 0 ? ckpt.state.batch_size : p.batch_size;
  if (state.world_size != pg.size() || saved_batch != p.batch_size) {
    // The sampler's slices depend on the world size and batch: the position in the epoch is
    // kept as a count of global samples, so a different world continues from the same place.
    const int64_t samples_done = state.micro_step * saved_batch * state.world_size;
    state.micro_step = samples_done / (static_cast<int64_t>(p.batch_size) * pg.size());
    state.world_size = pg.size();
  }
  // The global generators: the CPU's, and the GPU's where the engine computes (dropout there).
  // Each rank takes its own ("cpu.rank1", ...: Note [every rank's generator]) when the world is
  // the one that saved them, else rank 0's.
  const bool same_world = ckpt.state.world_size == pg.size();
  auto find = [&](const std::string& name) -> const torch::Tensor* {
    for (const auto& [n, t] : ckpt.rng) {
      if (n == name) return &t;
    }
    return nullptr;
  };
  for (const char* name : {"cpu", "cuda"}) {
    if (std::string(name) == "cuda" && !engine.device().is_cuda()) continue;  // resumed on the CPU: its own draws
    const torch::Tensor* state_tensor = find(name);
    if (const torch::Tensor* own = find(fmt::format("{}.rank{}", name, pg.rank())); own && same_world && pg.rank() > 0) {
      state_tensor = own;
    }
    if (!state_tensor) continue;
    at::Generator gen = std::string(name) == "cpu" ? at::detail::getDefaultCPUGenerator()
                                                   : at::globalContext().defaultGenerator(engine.device());
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state_tensor);
  }
  workload.load_rng_state(ckpt.rng, dir + "/rng_state.safetensors");
  if (pg.rank() == 0) {
    spdlog::info("resuming from {} (step {}, epoch {}, micro-batch {}; REPLICA_RESTART_COUNT {})", dir,
                 state.global_step, state.epoch, state.micro_step, restart_count);
  }
  return state;
}

void save_run_checkpoint(const RunConfig& config, const TrainerState& state, ParallelEngine& engine,
                         Workload& workload, torch::optim::Optimizer& optimizer, distributed::ProcessGroup& pg) {
  // Nothing non-finite is saved: a finite loss can still be followed by an update that overflows.
  const fs::path target = fs::path(config.project_name) / fmt::format("checkpoint-{}", state.global_step);
  require_finite_weights(engine.parameters(), engine.names(), pg, state.global_step, target.string());
  Checkpoint c;
  c.model_file = workload.checkpoint_model_file();
  c.extras = [&](const std::string& dir) { workload.write_checkpoint_extras(dir); };
  const fs::path staging = fs::path(config.project_name) / fmt::format(".zero-{}", state.global_step);
  engine.save_checkpoint(workload, optimizer, config.params.optimizer, staging, c);
  // Note [every rank's generator]: the ranks' generators start from one seed but part as soon as
  // their batches differ in length (dropout draws one number per element), so rank 0's state
  // alone would resume every other rank on rank 0's stream. Each rank's state reaches rank 0 as
  // its row of a sum (the states are bytes, exact in float64).
  std::vector<std::pair<std::string, torch::Tensor>> generators = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  if (engine.device().is_cuda()) {
    generators.emplace_back("cuda", at::globalContext().defaultGenerator(engine.device()).get_state());
  }
  std::vector<std::pair<std::string, torch::Tensor>> others;
  for (const auto& [name, mine] : generators) {
    auto rows = torch::zeros({pg.size(), mine.numel()}, torch::kDouble);
    rows[pg.rank()].copy_(mine.to(torch::kDouble));
    pg.allreduce_sum(rows).wait();
    for (int r = 1; r < pg.size(); ++r) others.emplace_back(fmt::format("{}.rank{}", name, r), rows[r].to(torch::kUInt8).contiguous());
  }
  if (pg.rank() != 0) return;
  c.state = state;
  if (c.state.log_history.size() > 20) {
    c.state.log_history.erase(c.state.log_history.begin(), c.state.log_history.end() - 20);
  }
  c.rng = generators;
  for (auto& t : others) c.rng.push_back(std::move(t));
  for (auto& t : workload.rng_state()) c.rng.push_back(std::move(t));
  save_checkpoint(config.project_name, c, config.params.save_total_limit);
}

}  // namespace replica::train
