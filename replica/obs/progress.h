// Training progress on the console, like tqdm: a live bar on a terminal, plain lines elsewhere.
//
// What: Progress draws, on a terminal, one self-rewriting line
//   " 42% |############            | 420/1000 epoch 1.26 loss 0.4182 1834 samples/s ETA 0:31"
// redrawn at most 10 times a second; log lines (evaluations, notes) are printed above it.
// When the stream is not a terminal (CI logs, files, pipes) it never draws a bar: the trainer's
// periodic lines (every logging_steps) are the progress, one plain line each, no escape codes.
//
// Why: people live in their terminal (tqdm, rich); CI logs must stay readable.
//
// Thread-safety: not synchronized; the trainer calls it from rank 0's training thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace replica::obs {

struct ProgressState {
  int64_t step = 0;
  int64_t total_steps = 0;
  double epoch = 0;
  double loss = 0;            // NaN before the first logged step
  double samples_per_s = 0;
  double tokens_per_s = 0;    // > 0: shown instead of samples/s
};

// The bar line (no carriage return, no escape codes) for `width` terminal columns;
// `eta_seconds` < 0 means not known yet.
std::string render_progress_line(const ProgressState& s, double eta_seconds, int width);
// "1:02:03" / "2:03".
std::string format_duration(double seconds);

class Progress {
 public:
  // fd: where to write (stderr normally). live: draw the bar; by default when fd is a terminal.
  explicit Progress(int fd = 2);
  Progress(int fd, bool live);
  ~Progress();
  bool live() const { return live_; }
  // Called every optimizer step: redraws the bar (live) when 100 ms passed or at the end.
  void update(const ProgressState& s);
  // A log line: printed as is (plain) or above the bar, which is then redrawn (live).
  void line(const std::string& text);
  // Leaves the bar's last state on screen and moves to a new line (live); idempotent.
  void finish();

 private:
  void draw();
  void write(const std::string& text);
  int fd_;
  bool live_;
  bool drawn_ = false;
  ProgressState last_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  int64_t first_step_ = -1;
};

}  // namespace replica::obs
