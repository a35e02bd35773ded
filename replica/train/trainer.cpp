#include "replica/train/trainer.h"

#include "replica/train/model_card.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/core/system.h"
#include "replica/data/sampler.h"
#include "replica/distributed/process_group.h"
#include "replica/launch/launcher.h"
#include "replica/models/linear.h"
#include "replica/obs/plot.h"
#include "replica/obs/timeline.h"
#include "replica/train/engine.h"
#include "replica/train/loss_scale.h"
#include "replica/train/nonfinite.h"
#include "replica/train/optim.h"
#include "replica/train/run_state.h"
#include "replica/train/schedule.h"
#include "replica/train/step_log.h"
#include "replica/train/workload.h"

#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// --timeline FILE (REPLICA_TIMELINE): every rank's events reach rank 0 through the process
// group (so it works across hosts), which writes one Chrome trace.
void write_timeline(distributed::ProcessGroup& pg, const std::string& file) {
  const std::string mine = obs::Timeline::instance().take_chrome_trace_events();
  obs::Timeline::instance().disable();
  std::vector<std::string> ranks = pg.allgather_strings(mine);
  if (pg.rank() != 0) return;
  const fs::path path(file);
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  write_file_atomically(path.string(), obs::merge_chrome_trace(ranks));
  spdlog::info("timeline: {} (open in ui.perfetto.dev or chrome://tracing)", file);
}

// Intra-op threads: cores / workers unless the user said otherwise (PRODUCT.md).
int worker_threads(const RunParams& p, const distributed::WorldInfo& world) {
  int threads = p.threads_per_worker;
  if (threads <= 0) {
    if (auto t = env_int("REPLICA_THREADS_PER_WORKER")) threads = static_cast<int>(*t);
  }
  if (threads <= 0) threads = std::max(1, usable_cores() / std::max(1, world.local_world_size));
  return threads;
}

distributed::ProcessGroupOptions process_group_options(const RunParams& p, torch::Device device) {
  distributed::ProcessGroupOptions options;
  // NCCL between GPUs (control tensors kept on the CPU are staged through the device by the
  // process group), Gloo on the CPU.
  options.backend = process_group_backend(p.ddp_backend, device);
  if (options.backend == "nccl") options.cuda_device = device.index();
  double rdzv_timeout = p.rdzv_timeout;
  // REPLICA_RDZV_TIMEOUT applies where the configuration left the default.
  if (auto t = env("REPLICA_RDZV_TIMEOUT"); t && p.rdzv_timeout == RunParams{}.rdzv_timeout) {
    try {
      rdzv_timeout = std::stod(*t);
    } catch (...) {
      fail("REPLICA_RDZV_TIMEOUT='{}' is not a number of seconds", *t);
    }
  }
  options.rdzv_timeout = std::chrono::milliseconds(static_cast<int64_t>(rdzv_timeout * 1000));
  options.collective_timeout = std::chrono::milliseconds(static_cast<int64_t>(p.collective_timeout * 1000));
  options.token = p.token;  // empty: REPLICA_TOKEN from the launcher
  return options;
}

// A bf16 / fp16 run on the CPU says which GEMMs its products take (models/linear.h): through the
// fp32 GEMM where the CPU lacks the type's arithmetic, and a warning where ATen's generic loop was
// forced there (tens of times slower than fp32: never silently slow).
void log_cpu_half_gemms(Precision precision) {
  const bool fp16 = precision == Precision::Fp16;
  const auto dtype = fp16 ? at::kHalf : at::kBFloat16;
  const char* type = fp16 ? "fp16" : "bf16";
  const char* isa = fp16 ? "AVX512-FP16 / AMX-FP16" : "AVX512-BF16 / AMX-BF16";
  const char* var = fp16 ? "REPLICA_CPU_FP16_GEMM" : "REPLICA_CPU_BF16_GEMM";
  if (models::cpu_half_through_fp32(dtype)) {
    spdlog::info("mixed_precision {}: {} the model's GEMMs run through the fp32 GEMM on {} values, rounded to {} "
                 "once ({}=aten forces ATen's {} kernels)",
                 type, models::cpu_does_half_arithmetic(dtype) ? fmt::format("{}=fp32:", var)
                                                               : fmt::format("this CPU has no {}, so", isa),
                 type, type, var, type);
  } else if (!models::cpu_does_half_arithmetic(dtype)) {
    spdlog::warn("mixed_precision {} with {}=aten on a CPU without {}: ATen's generic {} GEMM loop, tens of times "
                 "slower than fp32; unset {} (the GEMMs then go through the fp32 GEMM, the same rounding) or use "
                 "fp32",
                 type, var, isa, type, var);
  }
}

// The training loop of one worker, from the first step to be taken (fresh or resumed) to
// total_steps. The model is made parallel once, by the engine; nothing here asks which.
class Loop {
 public:
  // `start`: the step a resumed run continues from (-1: a fresh start).
  Loop(const RunConfig& config, distributed::ProcessGroup& pg, Workload& workload, ParallelEngine& engine,
       torch::optim::Optimizer& optimizer, TrainerState& state, int64_t start)
      : config_(config),
        p_(config.params),
        pg_(pg),
        workload_(workload),
        engine_(engine),
        optimizer_(optimizer),
        state_(state),
        sampler_(workload.train_size(), pg.rank(), pg.size(), p_.shuffle, static_cast<uint64_t>(p_.seed),
                 /*drop_last=*/false),
        // Micro-batches of this worker per epoch, optimizer steps per epoch and in all.
        micro_per_epoch_((sampler_.num_samples() + p_.batch_size - 1) / p_.batch_size),
        total_steps_(p_.max_steps > 0 ? p_.max_steps
                                      : p_.epochs * ((micro_per_epoch_ + p_.gradient_accumulation - 1) /
                                                     p_.gradient_accumulation)),
        warmup_(warmup_steps(p_.warmup_steps, p_.warmup_ratio, total_steps_)),
        log_(config, pg, start, total_steps_),
        scaler_(p_.mixed_precision == Precision::Fp16),
        read_late_(reads_late(engine.device())) {
    if (micro_per_epoch_ == 0) fail("the training split '{}' is empty", config.data.train_split);
    scaler_.restore(state_.loss_scale, state_.loss_scale_good_steps);  // a resumed fp16 run
  }

  // Rank 0 ends its progress bar (before any other rank may print again: a line written
  // while the bar is on screen would be glued to it).
  void finish_console() { log_.finish(); }

  void run() {
    workload_.model()->train();
    int64_t last_checkpoint = state_.global_step;
    while (state_.global_step < total_steps_) {
      sampler_.set_epoch(state_.epoch);
      const std::vector<std::vector<int64_t>> orders = orders_of_every_rank();
      while (state_.micro_step < micro_per_epoch_ && state_.global_step < total_steps_) {
        step(orders);
        const int64_t every = eval_every_steps();
        if (every > 0 && state_.global_step % every == 0) evaluate(epoch_progress());
        const bool epoch_end = state_.micro_step >= micro_per_epoch_;
        if (epoch_end) {
          // Epoch boundary: the checkpoint below records the start of the next epoch.
          if (every == 0 && p_.eval_strategy == EvalStrategy::Epoch) evaluate(epoch_progress());  // = epoch + 1
          state_.epoch += 1;
          state_.micro_step = 0;
          sampler_.set_epoch(state_.epoch);
        }
        const bool save = p_.save_strategy == SaveStrategy::Steps
                              ? p_.checkpoint_every > 0 && state_.global_step % p_.checkpoint_every == 0
                              : p_.save_strategy == SaveStrategy::Epoch && epoch_end;
        if (save) {
          settle_step();  // nothing unread is saved
          save_run_checkpoint(config_, state_, engine_, workload_, optimizer_, pg_);
          last_checkpoint = state_.global_step;
        }
        if (state_.micro_step == 0) break;  // next epoch: new order
      }
    }
    settle_step();
    const bool saves = p_.save_strategy == SaveStrategy::Epoch ||
                       (p_.save_strategy == SaveStrategy::Steps && p_.checkpoint_every > 0);
    if (saves && last_checkpoint != state_.global_step) {
      save_run_checkpoint(config_, state_, engine_, workload_, optimizer_, pg_);
    }
  }

 private:
  // Evaluation every this many steps; 0: none by steps (eval_strategy epoch evaluates at epoch ends).
  int64_t eval_every_steps() const {
    switch (p_.eval_strategy) {
      case EvalStrategy::No: return 0;
      case EvalStrategy::Steps: return p_.eval_every > 0 ? p_.eval_every : p_.logging_steps;
      case EvalStrategy::Epoch: break;
    }
    return p_.eval_every;
  }

  // Epochs done, with the fraction of the current one: what every metrics line logs as "epoch".
  double epoch_progress() const {
    return state_.epoch + static_cast<double>(state_.micro_step) / micro_per_epoch_;
  }

  // One optimizer step: gradient_accumulation micro-batches of this worker's slice of `order`.
  void step(const std::vector<std::vector<int64_t>>& orders) {
    const std::vector<int64_t>& order = orders[static_cast<size_t>(pg_.rank())];
    const int64_t batch = p_.batch_size;
    const int64_t group = std::min<int64_t>(p_.gradient_accumulation, micro_per_epoch_ - state_.micro_step);
    set_learning_rate(optimizer_, learning_rate(p_.scheduler, p_.lr, state_.global_step, total_steps_, warmup_));
    // Gradients to undefined rather than zero (PyTorch's zero_grad(set_to_none=True)): the
    // first backward then hands its gradient over instead of adding it to zeros, one pass
    // less over every gradient; DDP moves it into its bucket.
    for (torch::Tensor param : engine_.parameters()) param.mutable_grad() = torch::Tensor();
    const auto data_start = Clock::now();
    std::optional<obs::Span> data_span(std::in_place, "data", "data");
    // This step's micro-batches of every rank (this rank's are the ones it runs).
    auto micro_batches_of = [&](const std::vector<int64_t>& o) {
      std::vector<std::vector<int64_t>> out;
      for (int64_t k = 0; k < group; ++k) {
        const int64_t begin = std::min<int64_t>((state_.micro_step + k) * batch, static_cast<int64_t>(o.size()));
        const int64_t end = std::min<int64_t>(begin + batch, static_cast<int64_t>(o.size()));
        out.emplace_back(o.begin() + begin, o.begin() + end);
      }
      return out;
    };
    const std::vector<std::vector<int64_t>> micro_batches = micro_batches_of(order);
    const double item_scale = loss_item_scale(orders, micro_batches_of);
    data_span.reset();
    log_.split().data += since(data_start);
    // Each micro-batch's loss stays on the device (Note [the step's reads, a step late]).
    std::vector<torch::Tensor> micro_losses;
    std::vector<MicroCounts> micro_counts;
    for (int64_t k = 0; k < group; ++k) {
      const std::vector<int64_t>& indices = micro_batches[k];
      // The micro-batch after this one (within the epoch), for the workload to prepare meanwhile.
      if (const int64_t next = (state_.micro_step + k + 1) * batch; next < static_cast<int64_t>(order.size())) {
        workload_.prefetch(std::vector<int64_t>(
            order.begin() + next, order.begin() + std::min<int64_t>(next + batch, static_cast<int64_t>(order.size()))));
      }
      const torch::Tensor loss = forward(indices, item_scale, group);
      // The previous step's numbers, read now that this step's first forward is queued behind
      // them: the device has finished (or nearly) what they wait for, and keeps busy meanwhile.
      if (k == 0) settle_step();
      const auto backward_start = Clock::now();
      const double comm_wait_before = engine_.comm_wait_seconds();
      {
        obs::Span backward_span("backward", "compute");
        // fp16: the loss scaled up, so that small gradients survive in float16 (loss_scale.h).
        engine_.backward(scaler_.enabled() ? loss * scaler_.scale() : loss, /*sync=*/k + 1 == group);
      }
      log_.split().backward += since(backward_start);
      log_.split().comm_wait += engine_.comm_wait_seconds() - comm_wait_before;
      micro_losses.push_back(loss.detach());
      micro_counts.push_back({static_cast<int64_t>(indices.size()), workload_.tokens_in(indices),
                              workload_.train_metrics()});
    }
    const int64_t step_number = state_.global_step + 1;
    if (read_late_ && !scaler_.enabled() && p_.nonfinite_loss == NonfiniteLoss::Stop) {
      step_reading_late(step_number, group, torch::stack(micro_losses), std::move(micro_counts));
      return;
    }
    StepLosses losses = log_micro_steps(torch::stack(micro_losses), std::move(micro_counts));
    const auto optimizer_start = Clock::now();
    bool stepped = false;
    {
      obs::Span optimizer_span("optimizer step", "compute");
      // fp16: gradients back to their true size; an overflow (or a NaN/Inf loss) on any rank
      // skips the step on all, whatever nonfinite_loss says: the scaler's own remedy.
      const bool finite = scaler_.unscale_and_check(engine_.parameters(), pg_, !losses.finite());
      // Otherwise a NaN/Inf loss on any rank (nonfinite.h: every rank decides alike).
      std::string nonfinite;
      if (!scaler_.enabled()) {
        const NonfiniteLosses bad = agree_on_losses(losses, pg_);
        if (bad.found) nonfinite = fmt::format("the training loss is not finite ({})", bad.where);
      }
      if (finite && nonfinite.empty()) {
        // The global norm over every worker's gradients: clipped when asked, logged anyway.
        if (p_.max_grad_norm > 0 || log_.is_logged(step_number)) {
          grad_norm_ = engine_.clip_grad_norm(p_.max_grad_norm > 0 ? p_.max_grad_norm
                                                                   : std::numeric_limits<double>::infinity())
                           .item<double>();
          // Finite losses can still give gradients that overflow; the norm is the same on every
          // rank (global), so this decision is too. (fp16's were checked by the scaler.)
          if (!scaler_.enabled() && !std::isfinite(grad_norm_)) {
            nonfinite = fmt::format("the gradient norm is {} (every worker's loss is finite)", grad_norm_);
          }
        }
      }
      if (!nonfinite.empty()) skip_nonfinite_step(step_number, nonfinite);  // or stops the run
      if (finite && nonfinite.empty()) {
        optimizer_.step();
        stepped = true;
      } else if (!finite && pg_.rank() == 0) {
        spdlog::warn("step {}: fp16 gradients overflowed{}; step skipped, loss scale {} -> {}", step_number,
                     losses.finite() ? "" : " (or a loss was NaN/Inf)", scaler_.scale(),
                     scaler_.scale() * LossScaler::kBackoffFactor);
      }
      engine_.after_step();  // collective where sharded: every rank, stepped or not
      scaler_.update(finite);
      state_.loss_scale = scaler_.enabled() ? scaler_.scale() : 0;
      state_.loss_scale_good_steps = scaler_.good_steps();
    }
    log_.split().optimizer += since(optimizer_start);
    state_.micro_step += group;
    state_.global_step += 1;
    // A step skipped for a non-finite loss (either way) keeps it out of the logged mean.
    const bool loss_counted = stepped || losses.finite();
    log_.end_step(state_.global_step, epoch_progress(),
                  learning_rate(p_.scheduler, p_.lr, state_.global_step - 1, total_steps_, warmup_), grad_norm_,
                  loss_counted, state_.nonfinite_skipped_steps);
  }

  // Note [the step's reads, a step late]
  // On a GPU the host runs ahead, queueing kernels the device has not reached yet; every number
  // the host reads back (a loss, a norm, a flag) makes it wait until the device has caught up,
  // and the device then idles while the host launches again. A step needs three: the losses
  // (logged, and checked for NaN/Inf on every rank), the gradient norm (clipping, logged,
  // checked) and the global batch's loss items (token-weighted losses). The items are counted
  // on the host from every rank's micro-batches (loss_item_scale: no collective). With
  // nonfinite_loss: stop (the default) and no loss scaler, nothing else is read during the
  // step: the losses are stacked on the device, their non-finite flag all-reduced there, the
  // norm clips the gradients there (distributed/grad_norm.h), and the optimizer steps
  // unconditionally; the step's numbers are read during the next step, once its first forward
  // is queued (settle_step), or before anything is evaluated or saved. A NaN/Inf stops the run
  // then, naming its step, with the same words on every rank; the update it made is never
  // saved. nonfinite_loss: skip and fp16's scaler must decide before the update, so they read
  // the step's numbers before it (one read of all the losses, one of the norm). Reading late is
  // the rule on a GPU; REPLICA_STEP_READS=late|now forces either way anywhere (tests run both).
  struct MicroCounts {
    int64_t samples = 0, tokens = 0;
    std::map<std::string, double> metrics;
  };
  struct UnreadStep {
    int64_t step = 0;
    torch::Tensor losses;      // [micro-batches], this rank's, as backpropagated
    torch::Tensor nonfinite;   // how many ranks had a non-finite loss (all-reduced on the device)
    torch::Tensor grad_norm;   // 0-dim; undefined when not measured
    std::vector<MicroCounts> counts;
    double epoch = 0, lr = 0;
  };

  static bool reads_late(torch::Device device) {
    if (const auto mode = env("REPLICA_STEP_READS")) {
      if (*mode == "late") return true;
      if (*mode == "now") return false;
      fail("REPLICA_STEP_READS={} is not late or now", *mode);
    }
    return device.is_cuda();
  }

  // One read of a step's losses, logged micro-batch by micro-batch.
  StepLosses log_micro_steps(const torch::Tensor& losses, std::vector<MicroCounts> counts) {
    StepLosses out;
    const auto values = losses.to(torch::kCPU, torch::kDouble).contiguous();
    const double* v = values.data_ptr<double>();
    for (size_t k = 0; k < counts.size(); ++k) {
      out.add(v[k]);
      log_.add_micro_step(v[k], counts[k].samples, counts[k].tokens, counts[k].metrics);
    }
    return out;
  }

  // The rest of a step whose numbers are read during the next one.
  void step_reading_late(int64_t step_number, int64_t group, torch::Tensor losses, std::vector<MicroCounts> counts) {
    const auto optimizer_start = Clock::now();
    UnreadStep u;
    u.step = step_number;
    u.losses = losses;
    {
      obs::Span optimizer_span("optimizer step", "compute");
      u.nonfinite = torch::isfinite(losses).logical_not().any().to(torch::kDouble).reshape({1});
      pg_.allreduce_sum(u.nonfinite).wait();  // a device tensor on a GPU: queued, not waited for
      if (p_.max_grad_norm > 0 || log_.is_logged(step_number)) {
        u.grad_norm = engine_.clip_grad_norm(p_.max_grad_norm > 0 ? p_.max_grad_norm
                                                                  : std::numeric_limits<double>::infinity());
      }
      optimizer_.step();
      engine_.after_step();
    }
    log_.split().optimizer += since(optimizer_start);
    state_.micro_step += group;
    state_.global_step += 1;
    u.counts = std::move(counts);
    u.epoch = epoch_progress();
    u.lr = learning_rate(p_.scheduler, p_.lr, state_.global_step - 1, total_steps_, warmup_);
    unread_ = std::move(u);
  }

  // Reads the step left unread (if any): logs it, and stops the run when its loss or gradient
  // norm was not finite on some rank. Every rank calls it at the same points.
  void settle_step() {
    if (!unread_) return;
    UnreadStep u = std::move(*unread_);
    unread_.reset();
    const StepLosses losses = log_micro_steps(u.losses, std::move(u.counts));
    if (u.nonfinite.item<double>() > 0) {
      // Which ranks, in the same words on every rank (a collective only in this case).
      const NonfiniteLosses bad = agree_on_losses(losses, pg_);
      fail("{}", nonfinite_stop_message(u.step, fmt::format("the training loss is not finite ({})", bad.where),
                                        /*read_late=*/true));
    }
    if (u.grad_norm.defined()) {
      grad_norm_ = u.grad_norm.item<double>();
      if (!std::isfinite(grad_norm_)) {
        fail("{}", nonfinite_stop_message(
                       u.step, fmt::format("the gradient norm is {} (every worker's loss is finite)", grad_norm_),
                       /*read_late=*/true));
      }
    }
    log_.end_step(u.step, u.epoch, u.lr, grad_norm_, true, state_.nonfinite_skipped_steps);
  }

  // Every rank's order of the current epoch (each rank computes all of them: the sampler is a
  // function of the epoch and the seed), for loss_item_scale.
  std::vector<std::vector<int64_t>> orders_of_every_rank() const {
    std::vector<std::vector<int64_t>> out;
    for (int r = 0; r < pg_.size(); ++r) {
      if (r == pg_.rank() || workload_.loss_items({}) < 0) {
        out.push_back(r == pg_.rank() ? sampler_.indices() : std::vector<int64_t>());
        continue;
      }
      data::DistributedSampler other(workload_.train_size(), r, pg_.size(), p_.shuffle,
                                     static_cast<uint64_t>(p_.seed), /*drop_last=*/false);
      other.set_epoch(state_.epoch);
      out.push_back(other.indices());
    }
    return out;
  }

  // A step whose loss (or gradient norm) is NaN/Inf on some rank: nonfinite_loss stop ends the
  // run here, before the update (the same error on every rank, none left waiting); skip drops
  // the step's gradients, counts it and says so, like fp16's scaler does for an overflow.
  void skip_nonfinite_step(int64_t step, const std::string& what) {
    if (p_.nonfinite_loss == NonfiniteLoss::Stop) fail("{}", nonfinite_stop_message(step, what));
    for (torch::Tensor param : engine_.parameters()) param.mutable_grad() = torch::Tensor();
    grad_norm_ = std::nan("");  // none for this step (null in metrics.jsonl), not the last step's
    state_.nonfinite_skipped_steps += 1;
    if (pg_.rank() == 0) {
      spdlog::warn("step {}: {}; step skipped (nonfinite_loss: skip), {} skipped so far", step, what,
                   state_.nonfinite_skipped_steps);
    }
  }

  // Token-weighted workloads: the loss terms of the whole global batch (every micro-batch of
  // this step on every rank), so that each rank's summed loss times world / items, averaged
  // by DDP, is the mean over all of them. 0 for workloads that average per micro-batch. Counted
  // here from every rank's micro-batches (orders_of_every_rank): every rank holds the whole
  // training set, so no collective (and on a GPU no wait) is needed for it.
  template <typename MicroBatchesOf>
  double loss_item_scale(const std::vector<std::vector<int64_t>>& orders, MicroBatchesOf micro_batches_of) {
    int64_t items = 0;
    for (const auto& order : orders) {
      for (const auto& indices : micro_batches_of(order)) {
        const int64_t n = workload_.loss_items(indices);
        if (n < 0) return 0;
        items += n;
      }
    }
    return static_cast<double>(pg_.size()) / std::max<double>(1.0, static_cast<double>(items));
  }

  torch::Tensor forward(const std::vector<int64_t>& indices, double item_scale, int64_t group) {
    const auto forward_start = Clock::now();
    obs::Span forward_span("forward", "compute");
    // Autocast on the engine's device, the dtype set explicitly (CUDA's default is fp16).
    const bool mixed = p_.mixed_precision != Precision::Fp32;
    const auto device = engine_.device().type();
    at::autocast::set_autocast_enabled(device, mixed);
    if (mixed) {
      at::autocast::set_autocast_dtype(device, p_.mixed_precision == Precision::Bf16 ? at::kBFloat16 : at::kHalf);
    }
    torch::Tensor loss;
    if (item_scale > 0) {
      loss = workload_.train_loss_sum(indices).to(torch::kFloat) * item_scale;
      if (const auto aux = workload_.train_aux_loss(); aux.defined()) {
        loss = loss + aux.to(torch::kFloat) / static_cast<double>(group);
      }
    } else {
      loss = workload_.train_loss(indices).to(torch::kFloat) / static_cast<double>(group);
    }
    at::autocast::set_autocast_enabled(device, false);
    if (mixed) at::autocast::clear_cache();
    log_.split().forward += since(forward_start);
    return loss;
  }

  void evaluate(double epoch) {
    settle_step();  // the step's line before the evaluation's
    if (workload_.valid_size() == 0) return;
    std::vector<int64_t> mine;
    for (int64_t i = pg_.rank(); i < workload_.valid_size(); i += pg_.size()) mine.push_back(i);
    auto model = workload_.model();
    model->eval();
    engine_.eval_begin();
    const EvalSums sums = workload_.evaluate(mine);
    engine_.eval_end();
    model->train();
    const nlohmann::json line = log_.evaluation(state_.global_step, epoch, sums);
    if (!line.is_null()) state_.log_history.push_back(line);
  }

  const RunConfig& config_;
  const RunParams& p_;
  distributed::ProcessGroup& pg_;
  Workload& workload_;
  ParallelEngine& engine_;
  torch::optim::Optimizer& optimizer_;
  TrainerState& state_;
  data::DistributedSampler sampler_;
  const int64_t micro_per_epoch_, total_steps_, warmup_;
  StepLog log_;
  LossScaler scaler_;
  double grad_norm_ = 0;
  const bool read_late_;
  std::optional<UnreadStep> unread_;  // Note [the step's reads, a step late]
};

}  // namespace

int run_worker(const RunConfig& config) {
  const auto& p = config.params;
  const distributed::WorldInfo world = distributed::world_from_env().value_or(distributed::WorldInfo{});
  // A failure is recorded in the project, one file per rank, whoever started the workers
  // (replica's launcher may keep its own copy elsewhere; mpirun and Slurm keep none).
  if (world.is_distributed()) {
    keep_worker_error_file_at((fs::path(config.project_name) / "errors" /
                               fmt::format("rank-{}.restart-{}.json", world.rank, world.restart_count))
                                  .string());
  }
  const int threads = worker_threads(p, world);
  set_compute_threads(threads);
  if (p.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);

  const torch::Device device = worker_device(p.device, world, p.ddp_backend == "gloo");  // before any allocation
  auto pg = distributed::init_process_group(world, process_group_options(p, device));
  const bool main = pg->rank() == 0;
  // params.timeline (--timeline FILE), or REPLICA_TIMELINE for programs that run the trainer
  // without a config of their own; relative to the directory the run was started in.
  std::optional<std::string> timeline_file = env("REPLICA_TIMELINE");
  if (!p.timeline.empty()) timeline_file = p.timeline;
  if (timeline_file) obs::Timeline::instance().enable(pg->rank());
  if (main) {
    spdlog::info("replica: task {} on {} worker{} ({} thread{} each, {}), backend {}", config.task,
                 pg->size(), pg->size() == 1 ? "" : "s", threads, threads == 1 ? "" : "s",
                 device.is_cuda() ? "cuda:LOCAL_RANK" : "cpu", name_of(p.distributed_backend));
    for (const auto& note : config.notes) spdlog::info("note: {}", note);
    if (!device.is_cuda() && p.mixed_precision != Precision::Fp32) log_cpu_half_gemms(p.mixed_precision);
  }

  torch::manual_seed(static_cast<uint64_t>(p.seed));
  auto workload = make_workload(config, WorkloadContext{pg, world, threads, device});
  auto engine = make_engine(p, workload->model(), pg, device);
  // The steps' large blocks stay in the process from now on (core/system.h), not earlier: the
  // model's load (a quantized base's full-precision weights and the quantizer's temporaries)
  // must give its memory back. Sized by the model's trainable parameters and the engine's
  // (ZeRO's flat shards): Note [which freed blocks the process keeps] in core/system.cpp.
  {
    auto sized_by = engine->parameters();
    for (const auto& t : workload->model()->parameters()) sized_by.push_back(t);
    keep_freed_memory_for(sized_by);
  }
  auto optimizer = make_optimizer(
      OptimizerSpec{p.optimizer, p.lr, p.momentum, p.weight_decay, p.offload_optimizer_device, p.nvme_path},
      engine->parameters());

  TrainerState state;
  state.world_size = pg->size();
  state.batch_size = p.batch_size;
  state.seed = p.seed;
  const int64_t start = decide_start(config, *pg, world.restart_count);
  if (start >= 0) state = resume(config, start, *engine, *workload, *optimizer, *pg, world.restart_count);

  const fs::path project(config.project_name);
  if (main) {
    fs::create_directories(project);
    write_file_atomically((project / "config.yaml").string(), to_yaml(config));
    write_file_atomically((project / "training_params.json").string(), training_params_json(config));
  }
  const auto run_start = Clock::now();
  Loop loop(config, *pg, *workload, *engine, *optimizer, state, start);
  loop.run();
  loop.finish_console();
  // Nothing non-finite is saved (a finite loss can still be followed by an update that overflows).
  require_finite_weights(engine->parameters(), engine->names(), *pg, state.global_step, (project / "final").string());
  pg->barrier();
  engine->gather_full_model();
  if (main) {
    workload->save_final((project / "final").string());
    // AutoTrain's model card (model_card.h), after the metrics are complete.
    if (write_model_card(config, workload->model_card()).empty()) {
      spdlog::warn("{}/README.md is not replica's: the model card is in {}/final/README.md", config.project_name,
                   config.project_name);
    }
    const std::string skipped =
        state.nonfinite_skipped_steps == 0
            ? ""
            : fmt::format(" ({} skipped for a NaN/Inf loss)", state.nonfinite_skipped_steps);
    spdlog::info("done: {} steps{} in {:.1f} s; model in {}/final", state.global_step, skipped, since(run_start),
                 config.project_name);
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
  spdlog::info("{}", engine->memory_report(optimizer_state_bytes(*optimizer)));
  pg->barrier();
  return 0;
}

int run(const RunConfig& config, const std::vector<std::string>& self_argv) {
  if (distributed::world_from_env()) return run_worker(config);  // started by a launcher
  check_workload_config(config);  // what can be refused before any worker starts
  const int gpus = gpus_for(config.params.device);  // Note [worker device] in engine.cpp
  process_group_backend(config.params.ddp_backend, gpus > 0 ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU));
  const bool gpus_shared = config.params.ddp_backend == "gloo";
  const int nproc = config.params.nproc_per_node == 0
                        ? launch::resolve_nproc("auto", gpus)
                        : launch::resolve_nproc(std::to_string(config.params.nproc_per_node), gpus, gpus_shared);
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
