#include "replica/train/trainer.h"

#include "replica/core/error.h"
#include "replica/core/system.h"
#include "replica/ddp/ddp.h"
#include "replica/data/sampler.h"
#include "replica/dist/process_group.h"
#include "replica/io/files.h"
#include "replica/io/safetensors.h"
#include "replica/launch/launcher.h"
#include "replica/obs/plot.h"
#include "replica/obs/progress.h"
#include "replica/obs/tensorboard.h"
#include "replica/obs/timeline.h"
#include "replica/train/checkpoint.h"
#include "replica/train/project_dir.h"
#include "replica/train/optim.h"
#include "replica/train/schedule.h"
#include "replica/train/workload.h"
#include "replica/zero/checkpoint.h"
#include "replica/zero/zero3.h"

#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sys/resource.h>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

using Clock = std::chrono::steady_clock;

void write_file(const fs::path& path, const std::string& text) {
  io::write_file_atomically(path.string(), text);
}

nlohmann::json params_json(const io::RunConfig& c) {
  const auto& p = c.params;
  nlohmann::json j = {
      {"task", c.task},
      {"model", c.task == "llm-sft" ? c.base_model : c.model},
      {"project_name", c.project_name},
      {"data_path", c.data.path},
      {"train_split", c.data.train_split},
      {"valid_split", c.data.valid_split ? nlohmann::json(*c.data.valid_split) : nlohmann::json()},
      {"log", c.log},
      {"distributed_backend", p.distributed_backend},
      {"nproc_per_node", p.nproc_per_node == 0 ? nlohmann::json("auto") : nlohmann::json(p.nproc_per_node)},
      {"epochs", p.epochs},
      {"max_steps", p.max_steps},
      {"batch_size", p.batch_size},
      {"gradient_accumulation", p.gradient_accumulation},
      {"mixed_precision", p.mixed_precision},
      {"optimizer", p.optimizer},
      {"lr", p.lr},
      {"momentum", p.momentum},
      {"weight_decay", p.weight_decay},
      {"warmup_steps", p.warmup_steps},
      {"warmup_ratio", p.warmup_ratio},
      {"scheduler", p.scheduler},
      {"max_grad_norm", p.max_grad_norm},
      {"shuffle", p.shuffle},
      {"seed", p.seed},
      {"eval_every", p.eval_every},
      {"checkpoint_every", p.checkpoint_every},
      {"save_total_limit", p.save_total_limit},
      {"logging_steps", p.logging_steps},
      {"threads_per_worker", p.threads_per_worker},
      {"deterministic", p.deterministic},
      {"hidden_sizes", p.hidden_sizes},
      {"shard_optimizer", p.shard_optimizer ? nlohmann::json(*p.shard_optimizer) : nlohmann::json("auto")},
      {"sync_batchnorm", p.sync_batchnorm},
      {"augment", p.augment},
      {"resnet_stem", p.resnet_stem},
      {"embedding_dim", p.embedding_dim},
      {"temperature", p.temperature},
      {"top_k", p.top_k},
  };
  if (p.distributed_backend == "zero3") {
    j["stage3_prefetch_bucket_size"] = p.stage3_prefetch_bucket_size;
    j["stage3_param_persistence_threshold"] = p.stage3_param_persistence_threshold;
    j["stage3_max_live_parameters"] = p.stage3_max_live_parameters;
    j["reduce_bucket_size"] = p.reduce_bucket_size;
    j["overlap_comm"] = p.overlap_comm;
  }
  // The LLM keys are kept as normalised text; written typed, as AutoTrain writes them.
  for (const auto& [k, v] : p.extra) {
    if (v == "true" || v == "false") {
      j[k] = v == "true";
      continue;
    }
    try {
      size_t used = 0;
      const long long i = std::stoll(v, &used);
      if (used == v.size()) {
        j[k] = i;
        continue;
      }
      const double d = std::stod(v, &used);
      if (used == v.size()) {
        j[k] = d;
        continue;
      }
    } catch (const std::exception&) {
    }
    j[k] = v;
  }
  return j;
}

// Which checkpoint to start from, decided by rank 0 before anything is written and then
// shared, so every rank resumes from the same one. `restart_count` > 0: the launcher restarted
// this run after a failure, so outputs without a checkpoint are its own and it starts over.
int64_t decide_start(const io::RunConfig& config, dist::ProcessGroup& pg, int restart_count) {
  int64_t decision = -1;  // -1: fresh start; >= 0: the checkpoint step
  std::string error;
  if (pg.rank() == 0) {
    const fs::path project(config.project_name);
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
    if (!outputs.empty() && !only_errors) {
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

// Drops metrics of steps after the checkpoint we resume from (they will be redone).
void truncate_metrics(const fs::path& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) > last_step) continue;
    } catch (...) {
      continue;  // a torn last line from a crash
    }
    kept += line + "\n";
  }
  in.close();
  write_file(path, kept);
}

struct Metrics {
  std::ofstream out;
  void open(const fs::path& path) { out.open(path, std::ios::app); }
  void write(const nlohmann::json& j) {
    if (!out.is_open()) return;
    out << j.dump() << "\n";
    out.flush();
  }
};

// Seconds per optimizer step spent in each part of the loop, summed over a logging window
// (rank 0's own clock): the metrics' time split.
struct TimeSplit {
  double data = 0, forward = 0, backward = 0, comm_wait = 0, optimizer = 0;
};
// The L2 norm over every gradient (DDP's gradients are already the global average).
double global_grad_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> norms;
  for (const auto& param : params) {
    if (param.grad().defined()) norms.push_back(param.grad().detach().norm(2.0).to(torch::kDouble));
  }
  return norms.empty() ? 0.0 : torch::stack(norms).norm(2.0).item<double>();
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// --timeline FILE (REPLICA_TIMELINE): every rank's events reach rank 0 through the process
// group (so it works across hosts), which writes one Chrome trace.
void write_timeline(dist::ProcessGroup& pg, const std::string& file) {
  const std::string mine = obs::Timeline::instance().take_chrome_trace_events();
  obs::Timeline::instance().disable();
  std::vector<std::string> ranks = pg.allgather_strings(mine);
  if (pg.rank() != 0) return;
  const fs::path path(file);
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  write_file(path, obs::merge_chrome_trace(ranks));
  spdlog::info("timeline: {} (open in ui.perfetto.dev or chrome://tracing)", file);
}

}  // namespace

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
  write_file(fs::path(final_dir) / "config.json", model_config().dump(2) + "\n");
}

int run_worker(const io::RunConfig& config) {
  const auto& p = config.params;
  const dist::WorldInfo world = dist::world_from_env().value_or(dist::WorldInfo{});
  // A failure is recorded in the project, one file per rank, whoever started the workers
  // (replica's launcher may keep its own copy elsewhere; mpirun and Slurm keep none).
  if (world.is_distributed()) {
    keep_worker_error_file_at((fs::path(config.project_name) / "errors" /
                               fmt::format("rank-{}.restart-{}.json", world.rank, world.restart_count))
                                  .string());
  }

  // Threads: cores / workers unless the user said otherwise (PRODUCT.md).
  int threads = p.threads_per_worker;
  if (threads <= 0) {
    if (auto t = env_int("REPLICA_THREADS_PER_WORKER")) threads = static_cast<int>(*t);
  }
  if (threads <= 0) threads = std::max(1, usable_cores() / std::max(1, world.local_world_size));
  set_compute_threads(threads);
  keep_freed_memory_in_process();
  if (p.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);

  dist::ProcessGroupOptions pg_options;
  double rdzv_timeout = p.rdzv_timeout;
  // REPLICA_RDZV_TIMEOUT applies where the configuration left the default.
  if (auto t = env("REPLICA_RDZV_TIMEOUT"); t && p.rdzv_timeout == io::Params{}.rdzv_timeout) {
    try {
      rdzv_timeout = std::stod(*t);
    } catch (...) {
      fail("REPLICA_RDZV_TIMEOUT='{}' is not a number of seconds", *t);
    }
  }
  pg_options.rdzv_timeout = std::chrono::milliseconds(static_cast<int64_t>(rdzv_timeout * 1000));
  pg_options.collective_timeout = std::chrono::milliseconds(static_cast<int64_t>(p.collective_timeout * 1000));
  pg_options.token = p.token;  // empty: REPLICA_TOKEN from the launcher
  auto pg = dist::init_process_group(world, pg_options);
  const bool main = pg->rank() == 0;
  // params.timeline (--timeline FILE), or REPLICA_TIMELINE for programs that run the trainer
  // without a config of their own; relative to the directory the run was started in.
  std::optional<std::string> timeline_file = env("REPLICA_TIMELINE");
  if (!p.timeline.empty()) timeline_file = p.timeline;
  if (timeline_file) obs::Timeline::instance().enable(pg->rank());
  if (main) {
    spdlog::info("replica: task {} on {} worker{} ({} thread{} each), backend {}", config.task, pg->size(),
                 pg->size() == 1 ? "" : "s", threads, threads == 1 ? "" : "s", p.distributed_backend);
  }

  torch::manual_seed(static_cast<uint64_t>(p.seed));
  auto workload = make_workload(config, pg);
  auto model = workload->model();
  // ZeRO-3 (replica/zero) shards the model; the optimizer then steps this worker's shards.
  std::unique_ptr<ddp::DistributedDataParallel> ddp;
  std::unique_ptr<zero::Zero3> zero;
  if (p.distributed_backend == "zero3") {
    zero::Zero3Options zopt;
    zopt.stage3_prefetch_bucket_size = p.stage3_prefetch_bucket_size;
    zopt.stage3_param_persistence_threshold = p.stage3_param_persistence_threshold;
    zopt.stage3_max_live_parameters = p.stage3_max_live_parameters;
    zopt.reduce_bucket_size = p.reduce_bucket_size;
    zopt.overlap_comm = p.overlap_comm;
    zero = std::make_unique<zero::Zero3>(model, pg, zopt);
  } else {
    ddp::DDPOptions dopt;
    dopt.shard_optimizer = p.shard_optimizer;  // nullopt: auto, decided by DDP
    ddp = std::make_unique<ddp::DistributedDataParallel>(model, pg, dopt);
  }
  // shard_optimizer: DDP hands the optimizer this worker's shards instead of the parameters.
  const bool ddp_sharded = ddp && ddp->sharded();

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (auto& item : model->named_parameters()) {
    if (zero || !item.value().requires_grad()) continue;
    params.push_back(item.value());
    names.push_back(item.key());
  }
  if (zero) {
    params = zero->shard_parameters();
    names = zero->shard_names();
  } else if (ddp_sharded) {
    params = ddp->shard_parameters();
    names = ddp->shard_names();
  }
  OptimizerSpec spec{p.optimizer, p.lr, p.momentum, p.weight_decay};
  auto optimizer = make_optimizer(spec, params);

  TrainerState state;
  state.world_size = pg->size();
  state.batch_size = p.batch_size;
  state.seed = p.seed;
  const int64_t start = decide_start(config, *pg, world.restart_count);
  const fs::path project(config.project_name);
  if (start >= 0) {
    const std::string dir = (project / fmt::format("checkpoint-{}", start)).string();
    Checkpoint ckpt = load_checkpoint(dir);
    const bool sharded = fs::exists(fs::path(dir) / "zero" / "metadata.json");
    if (sharded != static_cast<bool>(zero)) {
      fail("{} was written with distributed_backend {}; resume with the same backend (or `replica consolidate` "
           "it into a full model)",
           dir, sharded ? "zero3" : "ddp");
    }
    if (zero) {
      // Re-sharded when the checkpoint was written by another number of workers.
      auto slice = zero::load_shards((fs::path(dir) / "zero").string(), pg->rank(), pg->size());
      zero->load_shards(slice.masters, dir + "/zero");
      load_optimizer_state(*optimizer, p.optimizer, params, names, slice.optimizer);
      torch::NoGradGuard no_grad;
      for (auto& [name, t] : slice.buffers) {
        if (auto* b = model->named_buffers().find(name)) b->copy_(t);
      }
    } else {
      workload->load_state_tensors(ckpt.model, dir + "/" + workload->checkpoint_model_file());
      // Checkpoints hold the full optimizer state; a sharded DDP takes its shards of it.
      load_optimizer_state(*optimizer, p.optimizer, params, names, ddp->shard_optimizer_state(ckpt.optimizer));
      // Parameters shared by the workers of a host were loaded by each of them: all done
      // before anyone steps.
      if (ddp->parameters_shared()) pg->shared_barrier().wait();
    }
    state = ckpt.state;
    state.batch_size = p.batch_size;
    const int64_t saved_batch = ckpt.state.batch_size > 0 ? ckpt.state.batch_size : p.batch_size;
    if (state.world_size != pg->size() || saved_batch != p.batch_size) {
      // The sampler's slices depend on the world size and batch: the position in the epoch is
      // kept as a count of global samples, so a different world continues from the same place.
      const int64_t samples_done = state.micro_step * saved_batch * state.world_size;
      state.micro_step = samples_done / (static_cast<int64_t>(p.batch_size) * pg->size());
      state.world_size = pg->size();
    }
    auto rng = std::find_if(ckpt.rng.begin(), ckpt.rng.end(), [](const auto& t) { return t.first == "cpu"; });
    if (rng != ckpt.rng.end()) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng->second);
    }
    workload->load_rng_state(ckpt.rng, dir + "/rng_state.safetensors");
    if (main) {
      spdlog::info("resuming from {} (step {}, epoch {}, micro-batch {}; REPLICA_RESTART_COUNT {})", dir,
                   state.global_step, state.epoch, state.micro_step, world.restart_count);
    }
  }

  Metrics metrics;
  std::unique_ptr<obs::EventFileWriter> tensorboard;
  if (main) {
    fs::create_directories(project);
    write_file(project / "config.yaml", io::to_yaml(config));
    write_file(project / "training_params.json", params_json(config).dump(2) + "\n");
    // Resuming: drop metrics of steps that will be redone. Fresh start: a dead run's metrics go.
    truncate_metrics(project / "metrics.jsonl", std::max<int64_t>(start, 0));
    metrics.open(project / "metrics.jsonl");
    if (config.log == "tensorboard") tensorboard = std::make_unique<obs::EventFileWriter>(project.string());
  }
  // TensorBoard's names for what metrics.jsonl logs ("train/loss", "eval/accuracy").
  auto to_tensorboard = [&](const nlohmann::json& j) {
    if (!tensorboard) return;
    const int64_t step = j["step"].get<int64_t>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || !value.is_number()) continue;
      if (key.rfind("eval_", 0) == 0) tensorboard->add_scalar("eval/" + key.substr(5), value.get<double>(), step);
      else tensorboard->add_scalar("train/" + key, value.get<double>(), step);
    }
    tensorboard->flush();
  };

  data::DistributedSampler sampler(workload->train_size(), pg->rank(), pg->size(), p.shuffle,
                                   static_cast<uint64_t>(p.seed), /*drop_last=*/false);
  const int64_t batch = p.batch_size;
  const int64_t micro_per_epoch = (sampler.num_samples() + batch - 1) / batch;
  const int64_t steps_per_epoch = (micro_per_epoch + p.gradient_accumulation - 1) / p.gradient_accumulation;
  const int64_t total_steps = p.max_steps > 0 ? p.max_steps : p.epochs * steps_per_epoch;
  const int64_t warmup = warmup_steps(p.warmup_steps, p.warmup_ratio, total_steps);
  if (micro_per_epoch == 0) fail("the training split '{}' is empty", config.data.train_split);

  const bool bf16 = p.mixed_precision == "bf16";
  // Rank 0's console: a live bar on a terminal, the periodic lines otherwise.
  std::optional<obs::Progress> progress;
  if (main) progress.emplace(2);
  // Epochs done, with the fraction of the current one: what every metrics line logs as "epoch".
  auto epoch_progress = [&] { return state.epoch + static_cast<double>(state.micro_step) / micro_per_epoch; };
  auto evaluate = [&](double epoch_for_log) {
    if (workload->valid_size() == 0) return;
    std::vector<int64_t> mine;
    for (int64_t i = pg->rank(); i < workload->valid_size(); i += pg->size()) mine.push_back(i);
    model->eval();
    // ZeRO-3: workers may run different numbers of forwards here, so nothing may be gathered
    // per layer: the whole model is gathered for the evaluation.
    if (zero) zero->gather_all();
    EvalSums s = workload->evaluate(mine);
    if (zero) zero->release_all();
    model->train();
    std::vector<double> sums = {s.loss_sum, s.correct, s.count, s.tokens};
    for (const auto& [name, value] : s.extra) sums.push_back(value);
    auto t = torch::tensor(sums, torch::kDouble);
    pg->allreduce_sum(t).wait();
    if (main) {
      const double count = t[2].item<double>();
      const double tokens = t[3].item<double>();
      const double per = tokens > 0 ? tokens : count;  // LLMs: means over predicted tokens
      nlohmann::json j = {{"step", state.global_step},
                          {"epoch", epoch_for_log},
                          {"eval_loss", t[0].item<double>() / per},
                          {"eval_accuracy", t[1].item<double>() / per},
                          {"eval_samples", static_cast<int64_t>(count)}};
      if (tokens > 0) j["eval_tokens"] = static_cast<int64_t>(tokens);
      int64_t extra_at = 4;
      for (const auto& [name, value] : s.extra) j["eval_" + name] = t[extra_at++].item<double>() / count;
      metrics.write(j);
      to_tensorboard(j);
      progress->line(fmt::format("eval step {}: eval_loss {:.4f} eval_accuracy {:.4f}", state.global_step,
                                 j["eval_loss"].get<double>(), j["eval_accuracy"].get<double>()));
      state.log_history.push_back(j);
    }
  };
  auto checkpoint = [&]() {
    // ZeRO-3: every worker writes its shard; rank 0 moves them into the checkpoint it writes.
    const fs::path staged = project / fmt::format(".zero-{}", state.global_step);
    if (zero) {
      zero::save_shards(staged.string(), *zero, optimizer_state(*optimizer, p.optimizer, params, names));
      pg->barrier();
    }
    // Sharded DDP: the full optimizer state, gathered from every worker's shards (collective).
    io::NamedTensors sharded_state;
    if (ddp_sharded) sharded_state = ddp->full_optimizer_state(optimizer_state(*optimizer, p.optimizer, params, names));
    if (!main) return;
    Checkpoint c;
    c.state = state;
    if (c.state.log_history.size() > 20) {
      c.state.log_history.erase(c.state.log_history.begin(), c.state.log_history.end() - 20);
    }
    if (!zero) c.model = workload->state_tensors();
    c.model_file = workload->checkpoint_model_file();
    c.extras = [&](const std::string& dir) { workload->write_checkpoint_extras(dir); };
    c.optimizer = ddp_sharded ? std::move(sharded_state) : optimizer_state(*optimizer, p.optimizer, params, names);
    if (zero) {
      c.model.clear();
      c.optimizer.clear();
      c.extras = [&](const std::string& dir) {
        workload->write_checkpoint_extras(dir);
        fs::rename(staged, fs::path(dir) / "zero");
      };
    }
    c.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
    for (auto& t : workload->rng_state()) c.rng.push_back(std::move(t));
    save_checkpoint(config.project_name, c, p.save_total_limit);
  };

  model->train();
  double window_loss = 0;
  int64_t window_steps = 0, window_samples = 0, window_tokens = 0;
  auto window_start = Clock::now();
  TimeSplit split;
  double grad_norm = 0;
  const auto run_start = Clock::now();
  int64_t last_checkpoint = start;

  while (state.global_step < total_steps) {
    sampler.set_epoch(state.epoch);
    const std::vector<int64_t> order = sampler.indices();
    while (state.micro_step < micro_per_epoch && state.global_step < total_steps) {
      const int64_t group = std::min<int64_t>(p.gradient_accumulation, micro_per_epoch - state.micro_step);
      set_learning_rate(*optimizer, learning_rate(p.scheduler, p.lr, state.global_step, total_steps, warmup));
      // Gradients to undefined rather than zero (PyTorch's zero_grad(set_to_none=True)): the
      // first backward then hands its gradient over instead of adding it to zeros, one pass
      // less over every gradient; DDP moves it into its bucket.
      for (auto& param : params) param.mutable_grad() = torch::Tensor();
      const auto data_start = Clock::now();
      std::optional<obs::Span> data_span(std::in_place, "data", "data");
      std::vector<std::vector<int64_t>> micro_batches;
      for (int64_t k = 0; k < group; ++k) {
        const int64_t begin = (state.micro_step + k) * batch;
        const int64_t end = std::min<int64_t>(begin + batch, static_cast<int64_t>(order.size()));
        micro_batches.emplace_back(order.begin() + begin, order.begin() + end);
      }
      // Token-weighted workloads: the loss terms of the whole global batch (every micro-batch
      // of this step on every rank), so that each rank's summed loss times world / items,
      // averaged by DDP, is the mean over all of them.
      int64_t local_items = 0;
      for (const auto& indices : micro_batches) {
        const int64_t n = workload->loss_items(indices);
        local_items = n < 0 ? -1 : local_items + n;
        if (n < 0) break;
      }
      const bool token_weighted = local_items >= 0;
      double item_scale = 1.0;
      if (token_weighted) {
        auto t = torch::tensor({static_cast<double>(local_items)}, torch::kDouble);
        pg->allreduce_sum(t).wait();
        item_scale = static_cast<double>(pg->size()) / std::max(1.0, t[0].item<double>());
      }
      data_span.reset();
      split.data += since(data_start);
      double step_loss = 0;
      for (int64_t k = 0; k < group; ++k) {
        const std::vector<int64_t>& indices = micro_batches[k];
        // The micro-batch after this one (within the epoch), for the workload to prepare meanwhile.
        if (const int64_t next = (state.micro_step + k + 1) * batch; next < static_cast<int64_t>(order.size())) {
          workload->prefetch(std::vector<int64_t>(
              order.begin() + next, order.begin() + std::min<int64_t>(next + batch, static_cast<int64_t>(order.size()))));
        }
        torch::Tensor loss;
        {
          const auto forward_start = Clock::now();
          obs::Span forward_span("forward", "compute");
          at::autocast::set_autocast_enabled(at::kCPU, bf16);
          if (bf16) at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
          if (token_weighted) {
            loss = workload->train_loss_sum(indices).to(torch::kFloat) * item_scale;
          } else {
            loss = workload->train_loss(indices).to(torch::kFloat) / static_cast<double>(group);
          }
          at::autocast::set_autocast_enabled(at::kCPU, false);
          if (bf16) at::autocast::clear_cache();
          split.forward += since(forward_start);
        }
        const auto backward_start = Clock::now();
        const double comm_wait_before = ddp ? ddp->comm_wait_seconds() : 0.0;
        {
          obs::Span backward_span("backward", "compute");
          if (k + 1 < group && ddp) {
            auto no_sync = ddp->no_sync();
            loss.backward();
          } else {
            loss.backward();
          }
        }
        split.backward += since(backward_start);
        if (ddp) split.comm_wait += ddp->comm_wait_seconds() - comm_wait_before;
        step_loss += loss.item<double>();
        window_samples += static_cast<int64_t>(indices.size());
        window_tokens += workload->tokens_in(indices);
      }
      const auto optimizer_start = Clock::now();
      {
        obs::Span optimizer_span("optimizer step", "compute");
        const bool log_step = (state.global_step + 1) % std::max<int64_t>(1, p.logging_steps) == 0 ||
                              state.global_step + 1 == total_steps;
        if (zero) {
          // The global norm over every worker's shard; clipping only when asked.
          if (p.max_grad_norm > 0 || log_step) {
            grad_norm = zero->clip_grad_norm(p.max_grad_norm > 0 ? p.max_grad_norm
                                                                 : std::numeric_limits<double>::infinity());
          }
        } else if (ddp_sharded) {
          if (p.max_grad_norm > 0 || log_step) {
            grad_norm = ddp->clip_grad_norm(p.max_grad_norm > 0 ? p.max_grad_norm
                                                                : std::numeric_limits<double>::infinity());
          }
        } else if (p.max_grad_norm > 0) {
          grad_norm = torch::nn::utils::clip_grad_norm_(params, p.max_grad_norm);
        } else if (log_step) {
          grad_norm = global_grad_norm(params);  // logged even when clipping is off
        }
        optimizer->step();
        if (zero) zero->after_step();
        if (ddp_sharded) ddp->after_step();  // all-gather the updated shards
      }
      split.optimizer += since(optimizer_start);
      state.micro_step += group;
      state.global_step += 1;
      window_loss += step_loss;
      window_steps += 1;

      if (state.global_step % std::max<int64_t>(1, p.logging_steps) == 0 || state.global_step == total_steps) {
        auto t = torch::tensor({window_loss, static_cast<double>(window_steps), static_cast<double>(window_samples),
                                static_cast<double>(window_tokens)},
                               torch::kDouble);
        pg->allreduce_sum(t).wait();
        const double seconds = std::chrono::duration<double>(Clock::now() - window_start).count();
        if (main) {
          const double loss = t[0].item<double>() / t[1].item<double>();
          const double sps = t[2].item<double>() / std::max(seconds, 1e-9);
          const double tps = t[3].item<double>() / std::max(seconds, 1e-9);
          const double epoch_f = epoch_progress();
          const double lr = learning_rate(p.scheduler, p.lr, state.global_step - 1, total_steps, warmup);
          // Time split: seconds per step on rank 0; compute is forward + backward minus the
          // part of backward spent blocked on communication.
          const double per_step = 1.0 / std::max<int64_t>(1, window_steps);
          nlohmann::json j = {{"step", state.global_step},
                              {"epoch", epoch_f},
                              {"loss", loss},
                              {"lr", lr},
                              {"grad_norm", grad_norm},
                              {"samples_per_s", sps},
                              {"tokens_per_s", tps},
                              {"time_compute_s", (split.forward + split.backward - split.comm_wait) * per_step},
                              {"time_comm_wait_s", split.comm_wait * per_step},
                              {"time_data_wait_s", split.data * per_step},
                              {"time_optimizer_s", split.optimizer * per_step}};
          metrics.write(j);
          to_tensorboard(j);
          obs::ProgressState ps{state.global_step, total_steps, epoch_f, loss, sps, t[3].item<double>() > 0 ? tps : 0};
          if (!progress->live()) {
            if (t[3].item<double>() > 0) {
              progress->line(fmt::format("step {}/{} epoch {:.2f} loss {:.4f} lr {:.3g} {:.1f} samples/s {:.0f} tokens/s",
                                         state.global_step, total_steps, epoch_f, loss, lr, sps, tps));
            } else {
              progress->line(fmt::format("step {}/{} epoch {:.2f} loss {:.4f} lr {:.3g} {:.0f} samples/s",
                                         state.global_step, total_steps, epoch_f, loss, lr, sps));
            }
          }
          progress->update(ps);
        }
        split = TimeSplit{};
        window_loss = 0;
        window_steps = window_samples = window_tokens = 0;
        window_start = Clock::now();
      }
      if (main && !(state.global_step % std::max<int64_t>(1, p.logging_steps) == 0 || state.global_step == total_steps)) {
        // Between logged steps the bar still moves (the loss and rates of the last window).
        obs::ProgressState ps;
        ps.step = state.global_step;
        ps.total_steps = total_steps;
        ps.epoch = epoch_progress();
        ps.loss = std::nan("");
        progress->update(ps);
      }
      if (p.eval_every > 0 && state.global_step % p.eval_every == 0) evaluate(epoch_progress());
      if (state.micro_step >= micro_per_epoch) {
        // Epoch boundary: the checkpoint below records the start of the next epoch.
        if (p.eval_every == 0) evaluate(epoch_progress());  // = state.epoch + 1 here
        state.epoch += 1;
        state.micro_step = 0;
        sampler.set_epoch(state.epoch);
      }
      if (p.checkpoint_every > 0 && state.global_step % p.checkpoint_every == 0) {
        checkpoint();
        last_checkpoint = state.global_step;
      }
      if (state.micro_step == 0) break;  // next epoch: new order
    }
  }

  if (p.checkpoint_every > 0 && last_checkpoint != state.global_step) checkpoint();
  // Rank 0 ends its progress bar before any other rank may print again: a line written while
  // the bar is on screen would be glued to it.
  if (main) progress->finish();
  pg->barrier();
  if (zero) zero->gather_all();  // final/ is always the full (consolidated) model
  if (main) {
    workload->save_final((project / "final").string());
    const double seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
    spdlog::info("done: {} steps in {:.1f} s; model in {}/final", state.global_step, seconds, config.project_name);
    // The curves of the run, for a person to open; a missing gnuplot is a note, not a failure.
    try {
      const obs::PlotResult plot = obs::plot_metrics(config.project_name);
      if (plot.written) spdlog::info("plot: {}", plot.path);
      else spdlog::info("no plot: {}", plot.note);
    } catch (const Error& e) {
      spdlog::warn("no plot: {}", e.what());
    }
  }
  if (timeline_file) write_timeline(*pg, *timeline_file);
  // Per-worker memory of the model state (parameters, gradients, optimizer state).
  int64_t optimizer_bytes = 0;
  for (const auto& [name, t] : optimizer_state(*optimizer, p.optimizer, params, names)) {
    optimizer_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  constexpr double MiB = 1024.0 * 1024.0;
  if (ddp) {
    int64_t param_bytes = 0, grad_bytes = 0;
    for (auto& t : model->parameters()) {
      param_bytes += t.numel() * static_cast<int64_t>(t.element_size());
      if (t.requires_grad()) grad_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    }
    spdlog::info("rank {}: backend ddp{} per-worker model state: {:.1f} MiB parameters + {:.1f} MiB gradients + "
                 "{:.1f} MiB optimizer = {:.1f} MiB; peak RSS {:.1f} MiB",
                 pg->rank(),
                 ddp_sharded ? (ddp->parameters_shared() ? " (sharded optimizer), parameters shared by the host's workers,"
                                                         : " (sharded optimizer),")
                             : ",",
                 param_bytes / MiB, grad_bytes / MiB, optimizer_bytes / MiB,
                 (param_bytes + grad_bytes + optimizer_bytes) / MiB, usage.ru_maxrss / 1024.0);
  }
  if (zero) {
    zero->release_all();
    const zero::MemoryStats m = zero->memory();
    const int64_t total = m.master_bytes + m.master_grad_bytes + optimizer_bytes + m.peak_gathered_bytes +
                          m.peak_transient_grad_bytes;
    spdlog::info("rank {}: backend zero3, per-worker model state: {:.1f} MiB master shards + {:.1f} MiB gradient "
                 "shards + {:.1f} MiB optimizer shards + peak {:.1f} MiB gathered parameters + peak {:.1f} MiB "
                 "transient gradients = {:.1f} MiB at most; peak RSS {:.1f} MiB",
                 pg->rank(), m.master_bytes / MiB, m.master_grad_bytes / MiB, optimizer_bytes / MiB,
                 m.peak_gathered_bytes / MiB, m.peak_transient_grad_bytes / MiB, total / MiB,
                 usage.ru_maxrss / 1024.0);
  }
  pg->barrier();
  return 0;
}

int run(const io::RunConfig& config, const std::vector<std::string>& self_argv) {
  if (dist::world_from_env()) return run_worker(config);  // started by a launcher
  check_workload_config(config);  // what can be refused before any worker starts
  const int nproc = config.params.nproc_per_node == 0
                        ? launch::resolve_nproc("auto")
                        : launch::resolve_nproc(std::to_string(config.params.nproc_per_node));
  if (nproc == 1) return run_worker(config);
  launch::LaunchOptions opts;
  opts.nproc_per_node = nproc;
  opts.master_addr = config.params.master_addr;
  opts.master_port = config.params.master_port;
  opts.max_restarts = config.params.max_restarts;
  opts.threads_per_worker = config.params.threads_per_worker;
  opts.error_dir = (fs::path(config.project_name) / "errors").string();
  opts.command = self_argv;
  opts.token = config.params.token;
  return launch::run(opts);
}

}  // namespace replica::train
