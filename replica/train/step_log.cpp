#include "replica/train/step_log.h"

#include "replica/core/files.h"
#include "replica/distributed/process_group.h"
#include "replica/obs/tensorboard.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

using Clock = std::chrono::steady_clock;

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
  write_file_atomically(path.string(), kept);
}

}  // namespace

StepLog::StepLog(const RunConfig& config, distributed::ProcessGroup& pg, int64_t start_step, int64_t total_steps)
    : config_(config),
      pg_(pg),
      total_steps_(total_steps),
      logging_steps_(std::max<int64_t>(1, config.params.logging_steps)),
      window_start_(Clock::now()) {
  if (pg_.rank() != 0) return;
  const fs::path project(config.project_name);
  // Resuming: drop metrics of steps that will be redone. Fresh start: a dead run's metrics go.
  truncate_metrics(project / "metrics.jsonl", std::max<int64_t>(start_step, 0));
  metrics_.open(project / "metrics.jsonl", std::ios::app);
  if (config.log == LogFormat::TensorBoard) tensorboard_ = std::make_unique<obs::EventFileWriter>(project.string());
  progress_.emplace(2);  // rank 0's console
}

StepLog::~StepLog() = default;

bool StepLog::is_logged(int64_t step) const { return step % logging_steps_ == 0 || step == total_steps_; }

void StepLog::add_micro_step(double loss, int64_t samples, int64_t tokens, const std::map<std::string, double>& metrics) {
  step_loss_ += loss;
  if (!metrics.empty()) {
    for (const auto& [name, value] : metrics) window_metrics_[name] += value;
    window_metric_micro_ += 1;
  }
  window_samples_ += samples;
  window_tokens_ += tokens;
}

void StepLog::write(const nlohmann::json& j) {
  if (metrics_.is_open()) {
    metrics_ << j.dump() << "\n";
    metrics_.flush();
  }
  if (!tensorboard_) return;
  // TensorBoard's names for what metrics.jsonl logs ("train/loss", "eval/accuracy").
  const int64_t step = j["step"].get<int64_t>();
  for (const auto& [key, value] : j.items()) {
    if (key == "step" || !value.is_number()) continue;
    if (key.rfind("eval_", 0) == 0) tensorboard_->add_scalar("eval/" + key.substr(5), value.get<double>(), step);
    else tensorboard_->add_scalar("train/" + key, value.get<double>(), step);
  }
  tensorboard_->flush();
}

void StepLog::end_step(int64_t step, double epoch, double lr, double grad_norm, bool loss_counted,
                       int64_t skipped_steps) {
  if (loss_counted) {
    window_loss_ += step_loss_;
    window_loss_steps_ += 1;
  }
  step_loss_ = 0;
  window_steps_ += 1;
  const bool main = pg_.rank() == 0;
  if (!is_logged(step)) {
    if (main) {
      // Between logged steps the bar still moves (the loss and rates of the last window).
      obs::ProgressState ps;
      ps.step = step;
      ps.total_steps = total_steps_;
      ps.epoch = epoch;
      ps.loss = std::nan("");
      progress_->update(ps);
    }
    return;
  }
  std::vector<double> sums = {window_loss_, static_cast<double>(window_loss_steps_),
                              static_cast<double>(window_samples_), static_cast<double>(window_tokens_),
                              static_cast<double>(window_metric_micro_)};
  for (const auto& [name, value] : window_metrics_) sums.push_back(value);
  auto t = torch::tensor(sums, torch::kDouble);
  pg_.allreduce_sum(t).wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - window_start_).count();
  if (main) {
    // Every step of the window skipped for a non-finite loss: no mean (null in metrics.jsonl).
    const bool has_loss = t[1].item<double>() > 0;
    const double loss = has_loss ? t[0].item<double>() / t[1].item<double>() : std::nan("");
    const double sps = t[2].item<double>() / std::max(seconds, 1e-9);
    const double tps = t[3].item<double>() / std::max(seconds, 1e-9);
    // Time split: seconds per step on rank 0; compute is forward + backward minus the part
    // of backward spent blocked on communication.
    const double per_step = 1.0 / std::max<int64_t>(1, window_steps_);
    nlohmann::json j = {{"step", step},
                        {"epoch", epoch},
                        {"loss", has_loss ? nlohmann::json(loss) : nlohmann::json(nullptr)},
                        {"lr", lr},
                        {"grad_norm", grad_norm},
                        {"samples_per_s", sps},
                        {"tokens_per_s", tps},
                        {"time_compute_s", (split_.forward + split_.backward - split_.comm_wait) * per_step},
                        {"time_comm_wait_s", split_.comm_wait * per_step},
                        {"time_data_wait_s", split_.data * per_step},
                        {"time_optimizer_s", split_.optimizer * per_step}};
    if (skipped_steps > 0) j["skipped_steps"] = skipped_steps;
    // The workload's metrics (TRL's names: rewards/chosen, ...): means over the micro-batches.
    const double micro = t[4].item<double>();
    int64_t at = 5;
    for (const auto& item : window_metrics_) j[item.first] = t[at++].item<double>() / std::max(micro, 1.0);
    write(j);
    const bool tokens = t[3].item<double>() > 0;
    obs::ProgressState ps{step, total_steps_, epoch, loss, sps, tokens ? tps : 0};
    if (!progress_->live()) {
      if (tokens) {
        progress_->line(fmt::format("step {}/{} epoch {:.2f} loss {:.4f} lr {:.3g} {:.1f} samples/s {:.0f} tokens/s",
                                    step, total_steps_, epoch, loss, lr, sps, tps));
      } else {
        progress_->line(fmt::format("step {}/{} epoch {:.2f} loss {:.4f} lr {:.3g} {:.0f} samples/s", step,
                                    total_steps_, epoch, loss, lr, sps));
      }
    }
    progress_->update(ps);
  }
  split_ = TimeSplit{};
  window_loss_ = 0;
  window_metrics_.clear();
  window_metric_micro_ = 0;
  window_steps_ = window_loss_steps_ = window_samples_ = window_tokens_ = 0;
  window_start_ = Clock::now();
}

nlohmann::json StepLog::evaluation(int64_t step, double epoch, const EvalSums& s) {
  std::vector<double> sums = {s.loss_sum, s.correct, s.count, s.tokens};
  for (const auto& [name, value] : s.extra) sums.push_back(value);
  auto t = torch::tensor(sums, torch::kDouble);
  pg_.allreduce_sum(t).wait();
  if (pg_.rank() != 0) return nullptr;
  const double count = t[2].item<double>();
  const double tokens = t[3].item<double>();
  const double per = tokens > 0 ? tokens : count;  // LLMs: means over predicted tokens
  nlohmann::json j = {{"step", step},
                      {"epoch", epoch},
                      {"eval_loss", t[0].item<double>() / per},
                      {"eval_accuracy", t[1].item<double>() / per},
                      {"eval_samples", static_cast<int64_t>(count)}};
  if (tokens > 0) j["eval_tokens"] = static_cast<int64_t>(tokens);
  int64_t extra_at = 4;
  for (const auto& [name, value] : s.extra) j["eval_" + name] = t[extra_at++].item<double>() / count;
  write(j);
  progress_->line(fmt::format("eval step {}: eval_loss {:.4f} eval_accuracy {:.4f}", step,
                              j["eval_loss"].get<double>(), j["eval_accuracy"].get<double>()));
  return j;
}

void StepLog::finish() {
  if (progress_) progress_->finish();
}

}  // namespace replica::train
