// Watches the collectives of one process group: a watchdog for hangs and, in debug mode, a
// cross-rank check of every collective's kind, shapes, dtypes and order (desync).
//
// Why a watchdog: a rank that hangs (stopped, deadlocked, stuck in compute) leaves every other
// rank blocked in its next collective; Gloo's own timeout then says only "timed out". Here
// each rank numbers its collectives (sequence number, kind) and a thread publishes, every
// tick, the last one it completed and the one it is waiting in to the rendezvous store. When
// a collective has waited longer than collective_timeout, the watchdog reads every rank's
// report, names the ranks that are not in that collective, writes the worker's error file and
// ends the process, so the launcher restarts or fails the job: it never hangs.
//
// Desync debug mode (REPLICA_DISTRIBUTED_DEBUG=DETAIL, or params.distributed_debug: detail):
// before each collective every rank posts (sequence number, kind, dtype, shape, call site) to
// the store and compares it with rank 0's; the first mismatch is a replica::Error naming both
// ranks and call sites. Off, it costs one branch per collective.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace replica::distributed {

struct StoreAccess {
  std::function<void(const std::string&, const std::string&)> set;
  std::function<std::string(const std::string&)> get;  // blocks until the key exists (store timeout)
  std::function<bool(const std::string&)> check;       // whether the key exists now
};

class CollectiveMonitor {
 public:
  // timeout <= 0: no watchdog thread (desync checks may still be on).
  CollectiveMonitor(int rank, int world_size, std::chrono::milliseconds timeout, bool desync_check,
                    StoreAccess store);
  ~CollectiveMonitor();
  CollectiveMonitor(const CollectiveMonitor&) = delete;
  CollectiveMonitor& operator=(const CollectiveMonitor&) = delete;

  // A collective is issued: returns its sequence number. With desync checks on, compares it
  // with rank 0's collective of the same number first (replica::Error on a mismatch).
  uint64_t begin(const char* kind, const std::vector<torch::Tensor>& tensors, const char* file, int line);
  // The collective `seq` completed on this rank.
  void end(uint64_t seq);

  bool desync_check() const { return desync_check_; }
  // Stops the watchdog thread (idempotent); the destructor calls it.
  void stop();

  // "float[4, 8]": what desync mode compares.
  static std::string describe(const std::vector<torch::Tensor>& tensors);
  // Whether REPLICA_DISTRIBUTED_DEBUG asks for desync checks (DETAIL; OFF/INFO/unset: no).
  static bool desync_from_env();

 private:
  void watch();
  void publish();
  std::chrono::milliseconds tick() const;
  std::string state_locked() const;
  [[noreturn]] void report_timeout(uint64_t seq, const std::string& kind, double waited_s);

  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  const bool desync_check_;
  StoreAccess store_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  uint64_t heartbeat_ = 0;  // watchdog thread only
  uint64_t next_seq_ = 1;
  uint64_t last_completed_ = 0;
  std::string last_completed_kind_;
  struct InFlight {
    std::string kind;
    std::chrono::steady_clock::time_point since;
  };
  std::map<uint64_t, InFlight> in_flight_;  // issued, not yet completed
  std::thread thread_;
};

}  // namespace replica::distributed
