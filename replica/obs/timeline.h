// A Chrome trace of what each rank does, like Horovod's timeline.
//
// What: while enabled, spans (name, category, track, begin, end) are recorded in memory;
// chrome_trace_events() renders them as Chrome trace "complete" events ("ph": "X") with
// pid = rank and one tid per track ("compute" for forward/backward/optimizer, "comm" for
// the buckets' all-reduces), and merge_chrome_trace() joins every rank's events into one
// JSON document that chrome://tracing and ui.perfetto.dev open. Timestamps are wall-clock
// microseconds, so the ranks of one host (and of NTP-synced hosts) line up.
//
// Why process-wide: DDP's autograd hooks and the trainer's loop both record into it without
// either owning the other; when it is disabled a span costs one relaxed atomic load.
//
// Thread-safety: record() and Span may be used from any thread (autograd's, the transport's);
// enable/disable/take are meant for the training thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace replica::obs {

class Timeline {
 public:
  static Timeline& instance();
  static int64_t now_us();  // wall-clock microseconds since the epoch

  void enable(int rank);
  void disable();
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // A span on `track` ("compute", "comm", ...); args: a JSON object text or empty.
  void record(std::string name, const char* category, std::string track, int64_t begin_us, int64_t end_us,
              std::string args = {});
  size_t size() const;
  // This rank's events as a comma-separated list of JSON objects (with the process and thread
  // name metadata), and drops them from memory.
  std::string take_chrome_trace_events();

 private:
  struct Event {
    std::string name, args;
    const char* category;
    std::string track;
    int64_t begin_us, end_us;
  };
  std::atomic<bool> enabled_{false};
  int rank_ = 0;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

// Records [construction, destruction) on the process-wide timeline when it is enabled.
class Span {
 public:
  Span(const char* name, const char* category, const char* track = "compute")
      : name_(name), category_(category), track_(track),
        begin_(Timeline::instance().enabled() ? Timeline::now_us() : -1) {}
  ~Span() {
    if (begin_ >= 0) Timeline::instance().record(name_, category_, track_, begin_, Timeline::now_us());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* category_;
  const char* track_;
  int64_t begin_;
};

// One Chrome trace JSON document from the ranks' take_chrome_trace_events() outputs.
std::string merge_chrome_trace(const std::vector<std::string>& rank_events);

}  // namespace replica::obs
