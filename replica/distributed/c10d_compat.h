// Internal: the only place that touches c10d types. c10d's C++ API is not stable between
// LibTorch releases (how backends are built, Store's virtuals, the Gloo and NCCL headers), so
// every c10d call is in c10d_compat.cpp and the rest of replica never names a c10d class.
#pragma once

#include "replica/distributed/process_group.h"

#include <chrono>
#include <memory>
#include <string>

namespace replica::distributed::detail {

// A key-value store handle, type-erased so callers need no c10d header.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string get(const std::string& key) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};

// The locked rendezvous store (store.h): rank 0 (is_server) hosts it on host:port, listening
// on that address only; everyone, rank 0 included, connects and proves `token`. Returns
// nullptr when nothing answered at host:port within `timeout`; replica::Error for a busy
// port, a foreign address or a refused token.
std::shared_ptr<Store> make_store(const std::string& host, int port, bool is_server, const std::string& token,
                                  std::chrono::milliseconds timeout);

// The process group with its collective backend on a rendezvous store (keys under `prefix`).
std::shared_ptr<ProcessGroup> make_process_group(const std::shared_ptr<Store>& store,
                                                 const std::string& prefix,
                                                 const WorldInfo& world,
                                                 const ProcessGroupOptions& options);

}  // namespace replica::distributed::detail
