#include "replica/distributed/collective_monitor.h"

#include "replica/core/error.h"
#include "replica/core/system.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace replica::distributed {
namespace {

using Clock = std::chrono::steady_clock;

std::string progress_key(int rank) { return "monitor/progress/" + std::to_string(rank); }
std::string desync_key(uint64_t seq, int rank) { return fmt::format("monitor/desync/{}/{}", seq, rank); }

const char* base_name(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

// A desync record is "what|where": ranks must agree on `what`; `where` is for the message.
std::pair<std::string, std::string> split_record(const std::string& record) {
  const auto bar = record.find('|');
  if (bar == std::string::npos) return {record, "?"};
  return {record.substr(0, bar), record.substr(bar + 1)};
}

}  // namespace

CollectiveMonitor::CollectiveMonitor(int rank, int world_size, std::chrono::milliseconds timeout,
                                     bool desync_check, StoreAccess store)
    : rank_(rank), world_size_(world_size), timeout_(timeout), desync_check_(desync_check),
      store_(std::move(store)) {
  store_.set(progress_key(rank_), "0|0|-|-");
  if (timeout_.count() > 0) thread_ = std::thread([this] { watch(); });
}

CollectiveMonitor::~CollectiveMonitor() { stop(); }

void CollectiveMonitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool CollectiveMonitor::desync_from_env() {
  auto v = env("REPLICA_DISTRIBUTED_DEBUG");
  if (!v) v = env("TORCH_DISTRIBUTED_DEBUG");
  if (!v) return false;
  std::string upper = *v;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  if (upper == "DETAIL") return true;
  if (upper == "OFF" || upper == "INFO" || upper.empty()) return false;
  fail("REPLICA_DISTRIBUTED_DEBUG='{}' is not one of OFF, INFO, DETAIL", *v);
}

std::string CollectiveMonitor::describe(const std::vector<torch::Tensor>& tensors) {
  std::string out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i) out += ", ";
    std::ostringstream shape;
    shape << tensors[i].sizes();
    out += fmt::format("{}{}", c10::toString(tensors[i].scalar_type()), shape.str());
  }
  return out;
}

uint64_t CollectiveMonitor::begin(const char* kind, const std::vector<torch::Tensor>& tensors, const char* file,
                                  int line) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    seq = next_seq_++;
    in_flight_[seq] = InFlight{kind, Clock::now()};
  }
  if (!desync_check_) return seq;

  const std::string what = fmt::format("{} {}", kind, describe(tensors));
  const std::string where = fmt::format("{}:{}", base_name(file), line);
  store_.set(desync_key(seq, rank_), what + "|" + where);
  auto mismatch = [&](int other, const std::string& record) {
    const auto [other_what, other_where] = split_record(record);
    fail("collective desync at collective #{}: rank {} issued {} at {}, but rank {} issued {} at {} "
         "(REPLICA_DISTRIBUTED_DEBUG=DETAIL)",
         seq, rank_, what, where, other, other_what, other_where);
  };
  if (rank_ != 0) {
    const std::string zero = store_.get(desync_key(seq, 0));
    if (split_record(zero).first != what) mismatch(0, zero);
  } else {
    for (int r = 1; r < world_size_; ++r) {
      const std::string other = store_.get(desync_key(seq, r));
      if (split_record(other).first != what) mismatch(r, other);
    }
  }
  return seq;
}

void CollectiveMonitor::end(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = in_flight_.find(seq);
  if (it == in_flight_.end()) return;
  if (seq > last_completed_) {
    last_completed_ = seq;
    last_completed_kind_ = it->second.kind;
  }
  in_flight_.erase(it);
}

// "completed|kind|waiting": last completed sequence number and kind, and the oldest
// collective this rank is waiting in ("-" when none).
std::string CollectiveMonitor::state_locked() const {
  std::string waiting = "-";
  if (!in_flight_.empty()) {
    waiting = fmt::format("#{} {}", in_flight_.begin()->first, in_flight_.begin()->second.kind);
  }
  return fmt::format("{}|{}|{}", last_completed_, last_completed_kind_.empty() ? "-" : last_completed_kind_,
                     waiting);
}

std::chrono::milliseconds CollectiveMonitor::tick() const {
  // Short against the timeout, so that a report is at most one tick old.
  return std::clamp<std::chrono::milliseconds>(timeout_ / 10, std::chrono::milliseconds(100),
                                               std::chrono::milliseconds(2000));
}

// Every tick: "heartbeat|completed|kind|waiting". The heartbeat tells a live rank from a
// stopped or dead one, whose last report stays behind unchanged.
void CollectiveMonitor::publish() {
  std::string state;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state = state_locked();
  }
  try {
    store_.set(progress_key(rank_), fmt::format("{}|{}", ++heartbeat_, state));
  } catch (const std::exception&) {
    // The store is gone (rank 0 ended): the transports report that on their own.
  }
}

void CollectiveMonitor::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, tick(), [this] { return stopping_; });
    if (stopping_) break;
    std::optional<std::pair<uint64_t, InFlight>> overdue;
    if (!in_flight_.empty() && Clock::now() - in_flight_.begin()->second.since > timeout_) {
      overdue.emplace(in_flight_.begin()->first, in_flight_.begin()->second);
    }
    lock.unlock();
    publish();
    if (overdue) {
      const double waited = std::chrono::duration<double>(Clock::now() - overdue->second.since).count();
      report_timeout(overdue->first, overdue->second.kind, waited);
    }
    lock.lock();
  }
}

void CollectiveMonitor::report_timeout(uint64_t seq, const std::string& kind, double waited_s) {
  auto read_all = [&] {
    std::vector<std::string> states(world_size_);
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      try {
        if (store_.check(progress_key(r))) states[r] = store_.get(progress_key(r));
      } catch (const std::exception&) {
      }
    }
    return states;
  };
  // Two looks at the others' reports, a few ticks apart (publishing our own heartbeat
  // meanwhile, since the others are doing the same): a report that did not change belongs to
  // a rank whose watchdog does not run, i.e. a stopped, frozen or dead process.
  const auto before = read_all();
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(tick());
    publish();
  }
  const auto after = read_all();

  std::string per_rank;
  std::vector<int> absent;  // ranks not waiting in this collective
  for (int r = 0; r < world_size_; ++r) {
    if (!per_rank.empty()) per_rank += "; ";
    std::string state;
    if (r == rank_) {
      std::lock_guard<std::mutex> lock(mutex_);
      state = "0|" + state_locked();
    } else {
      state = after[r];
    }
    if (state.empty()) {
      per_rank += fmt::format("rank {}: no report", r);
      absent.push_back(r);
      continue;
    }
    std::vector<std::string> fields;
    std::stringstream in(state);
    for (std::string f; std::getline(in, f, '|');) fields.push_back(f);
    fields.resize(4);
    const std::string& completed = fields[1];
    const std::string& completed_kind = fields[2];
    const std::string& waiting = fields[3];
    per_rank += completed == "0" ? fmt::format("rank {}: none", r)
                                 : fmt::format("rank {}: #{} {}", r, completed, completed_kind);
    if (r != rank_ && before[r] == after[r]) {
      per_rank += " at its last report (its watchdog stopped reporting since: the process is stopped, frozen "
                  "or dead)";
      absent.push_back(r);
      continue;
    }
    per_rank += waiting == "-" ? " (not in a collective)" : fmt::format(" (waiting in {})", waiting);
    if (waiting == "-" || std::strtoull(waiting.c_str() + 1, nullptr, 10) > seq) absent.push_back(r);
  }
  std::string suspects;
  for (int r : absent) suspects += (suspects.empty() ? "" : ", ") + std::to_string(r);
  const std::string message = fmt::format(
      "rank {}: collective timeout: {} #{} did not complete within {:.0f} s (collective_timeout {:.0f} s); "
      "last collective completed by each rank: {}{}",
      rank_, kind, seq, waited_s, timeout_.count() / 1000.0, per_rank,
      suspects.empty() ? std::string()
                       : fmt::format("; not in this collective: rank{} {} (hung, stopped or dead)",
                                     absent.size() == 1 ? "" : "s", suspects));
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  write_worker_error_file(message);
  // The main thread is blocked inside the transport; only ending the process frees the job.
  std::_Exit(1);
}

}  // namespace replica::distributed
