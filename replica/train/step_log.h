// What a run reports as it trains: per logged step the loss, learning rate, gradient norm,
// samples and tokens per second and the time split (averaged over the logging window, every
// worker's sums all-reduced), per evaluation the eval_* metrics. Rank 0 writes them to
// metrics.jsonl, to TensorBoard events (log: tensorboard), and to the console: a live progress
// bar on a terminal, one plain line per logged step elsewhere.
#pragma once

#include "replica/train/run_config.h"
#include "replica/obs/progress.h"
#include "replica/train/workload.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

namespace replica::obs {
class EventFileWriter;
}
namespace replica::distributed {
class ProcessGroup;
}

namespace replica::train {

// Seconds spent in each part of the loop over the logging window (rank 0's own clock).
struct TimeSplit {
  double data = 0, forward = 0, backward = 0, comm_wait = 0, optimizer = 0;
};

class StepLog {
 public:
  // Rank 0 opens project/metrics.jsonl, dropping the lines of steps after `start_step` (they
  // are redone; a fresh start is step 0), and the TensorBoard writer.
  StepLog(const RunConfig& config, distributed::ProcessGroup& pg, int64_t start_step, int64_t total_steps);
  ~StepLog();

  TimeSplit& split() { return split_; }
  // One micro-step's loss (as backpropagated), samples and tokens.
  // `metrics`: the workload's further metrics of that micro-batch (Workload::train_metrics).
  void add_micro_step(double loss, int64_t samples, int64_t tokens, const std::map<std::string, double>& metrics = {});
  // After optimizer step `step`: on logging steps (collective there) the window's means are
  // written; on the others the bar moves. `loss_counted` false: the step was skipped for a
  // non-finite loss, which stays out of the window's mean (every rank passes the same);
  // `skipped_steps` > 0: the run's count of such steps so far, written with the line.
  bool is_logged(int64_t step) const;
  void end_step(int64_t step, double epoch, double lr, double grad_norm, bool loss_counted = true,
                int64_t skipped_steps = 0);
  // An evaluation's sums from this worker (collective). Rank 0 writes them and returns the
  // metrics line (for trainer_state.json's log_history); others return null.
  nlohmann::json evaluation(int64_t step, double epoch, const EvalSums& local);
  // Leaves the bar's last state on screen (rank 0; idempotent).
  void finish();

 private:
  void write(const nlohmann::json& j);
  const RunConfig& config_;
  distributed::ProcessGroup& pg_;
  const int64_t total_steps_;
  const int64_t logging_steps_;
  std::ofstream metrics_;
  std::unique_ptr<obs::EventFileWriter> tensorboard_;
  std::optional<obs::Progress> progress_;
  TimeSplit split_;
  double step_loss_ = 0, window_loss_ = 0;
  std::map<std::string, double> window_metrics_;  // sums over the window's micro-batches
  int64_t window_metric_micro_ = 0;
  int64_t window_steps_ = 0, window_loss_steps_ = 0, window_samples_ = 0, window_tokens_ = 0;
  std::chrono::steady_clock::time_point window_start_;
};

}  // namespace replica::train
