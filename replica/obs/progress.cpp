#include "replica/obs/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <sys/ioctl.h>
#include <unistd.h>

namespace replica::obs {
namespace {

using Clock = std::chrono::steady_clock;

int terminal_width(int fd) {
  winsize ws{};
  if (ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) return ws.ws_col;
  return 100;
}

std::string timestamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  return fmt::format("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec);
}

}  // namespace

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string render_progress_line(const ProgressState& s, double eta_seconds, int width) {
  const double fraction = s.total_steps > 0 ? std::clamp(double(s.step) / double(s.total_steps), 0.0, 1.0) : 0.0;
  std::string stats = fmt::format(" {}/{} epoch {:.2f}", s.step, s.total_steps, s.epoch);
  if (!std::isnan(s.loss)) stats += fmt::format(" loss {:.4f}", s.loss);
  if (s.tokens_per_s > 0) stats += fmt::format(" {:.0f} tokens/s", s.tokens_per_s);
  else if (s.samples_per_s > 0) stats += fmt::format(" {:.0f} samples/s", s.samples_per_s);
  stats += " ETA " + (eta_seconds < 0 ? std::string("?") : format_duration(eta_seconds));
  const std::string percent = fmt::format("{:3.0f}% |", fraction * 100);
  const int bar = std::max(10, width - 1 - static_cast<int>(percent.size() + 1 + stats.size()));
  const int filled = static_cast<int>(std::floor(fraction * bar));
  return percent + std::string(filled, '#') + std::string(bar - filled, ' ') + "|" + stats;
}

Progress::Progress(int fd) : Progress(fd, isatty(fd) == 1) {}

Progress::Progress(int fd, bool live) : fd_(fd), live_(live), start_(Clock::now()) {
  last_.loss = std::nan("");
}

Progress::~Progress() { finish(); }

void Progress::update(const ProgressState& s) {
  if (!live_) return;
  if (first_step_ < 0) {
    first_step_ = s.step - 1;  // resumed runs: the rate counts only the steps of this run
    start_ = Clock::now();
  }
  const double loss = std::isnan(s.loss) ? last_.loss : s.loss;
  const double sps = s.samples_per_s > 0 ? s.samples_per_s : last_.samples_per_s;
  const double tps = s.tokens_per_s > 0 ? s.tokens_per_s : last_.tokens_per_s;
  last_ = s;
  last_.loss = loss;
  last_.samples_per_s = sps;
  last_.tokens_per_s = tps;
  const auto now = Clock::now();
  if (drawn_ && s.step < s.total_steps && now - last_draw_ < std::chrono::milliseconds(100)) return;
  draw();
}

void Progress::line(const std::string& text) {
  const std::string out = fmt::format("[{} info] {}\n", timestamp(), text);
  if (!live_) {
    write(out);
    return;
  }
  write("\r\x1b[K" + out);  // erase the bar, print the line, draw the bar below it again
  if (drawn_) draw();
}

void Progress::finish() {
  if (live_ && drawn_) write("\n");
  drawn_ = false;
}

void Progress::draw() {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const int64_t done = last_.step - first_step_;
  const double eta = done > 0 && elapsed > 0 ? elapsed / done * double(last_.total_steps - last_.step) : -1;
  write("\r" + render_progress_line(last_, eta, terminal_width(fd_)) + "\x1b[K");
  drawn_ = true;
  last_draw_ = Clock::now();
}

void Progress::write(const std::string& text) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed terminal must not stop training
    off += static_cast<size_t>(n);
  }
}

}  // namespace replica::obs
