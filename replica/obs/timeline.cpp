#include "replica/obs/timeline.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <map>

namespace replica::obs {

Timeline& Timeline::instance() {
  static Timeline timeline;
  return timeline;
}

int64_t Timeline::now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Timeline::enable(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_ = rank;
  enabled_.store(true);
}

void Timeline::disable() { enabled_.store(false); }

void Timeline::record(std::string name, const char* category, std::string track, int64_t begin_us, int64_t end_us,
                      std::string args) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({std::move(name), std::move(args), category, std::move(track), begin_us, end_us});
}

size_t Timeline::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::string Timeline::take_chrome_trace_events() {
  std::vector<Event> events;
  int rank;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(events_);
    rank = rank_;
  }
  // Tracks become thread ids in order of first use; "compute" first so it is drawn on top.
  std::map<std::string, int> tids = {{"compute", 0}};
  std::string out = nlohmann::json{{"name", "process_name"}, {"ph", "M"}, {"pid", rank},
                                   {"args", {{"name", fmt::format("rank {}", rank)}}}}
                        .dump();
  out += "," + nlohmann::json{{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank},
                              {"args", {{"sort_index", rank}}}}
                   .dump();
  for (const auto& e : events) {
    auto it = tids.find(e.track);
    if (it == tids.end()) it = tids.emplace(e.track, static_cast<int>(tids.size())).first;
  }
  for (const auto& [track, tid] : tids) {
    out += "," + nlohmann::json{{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid},
                                {"args", {{"name", track}}}}
                     .dump();
    out += "," + nlohmann::json{{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", tid},
                                {"args", {{"sort_index", tid}}}}
                     .dump();
  }
  for (const auto& e : events) {
    nlohmann::json j = {{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", rank},
                        {"tid", tids[e.track]}, {"ts", e.begin_us}, {"dur", std::max<int64_t>(0, e.end_us - e.begin_us)}};
    if (!e.args.empty()) j["args"] = nlohmann::json::parse(e.args);
    out += "," + j.dump();
  }
  return out;
}

std::string merge_chrome_trace(const std::vector<std::string>& rank_events) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (const auto& events : rank_events) {
    if (events.empty()) continue;
    if (!first) out += ",\n";
    out += events;
    first = false;
  }
  return out + "]}\n";
}

}  // namespace replica::obs
