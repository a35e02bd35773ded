// Rendezvous: who joined, who did not, and what was wrong with the address.
#include "replica/dist/process_group.h"

#include "replica/core/error.h"
#include "replica/dist/c10d_compat.h"
#include "replica/dist/collective_monitor.h"
#include "replica/dist/shm_transport.h"
#include "replica/core/system.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace replica::dist {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

// Rank 0 hosts the store: make sure MASTER_ADDR:MASTER_PORT can be listened on, so that a
// busy port or a foreign address gets a message that says so instead of c10d's generic one.
void check_port_free(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(addr.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    fail("MASTER_ADDR '{}' does not resolve to an address", addr);
  }
  int fd = socket(res->ai_family, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (res->ai_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in6*>(res->ai_addr)->sin6_port = htons(static_cast<uint16_t>(port));
  }
  int rc = bind(fd, res->ai_addr, res->ai_addrlen);
  int err = errno;
  if (rc == 0) rc = listen(fd, 1), err = errno;
  close(fd);
  freeaddrinfo(res);
  if (rc != 0 && err == EADDRINUSE) {
    fail("rendezvous port {} on {} is already in use (MASTER_PORT); choose another with "
         "--master-port / params.master_port, or leave it unset on one node for a free port",
         port, addr);
  }
  if (rc != 0 && err == EADDRNOTAVAIL) {
    fail("MASTER_ADDR {} is not an address of this host, but rank 0 must host the rendezvous "
         "there", addr);
  }
  if (rc != 0) fail("cannot listen on {}:{} for the rendezvous: {}", addr, port, std::strerror(err));
}

// Workers may start before rank 0 listens. c10d's client gives up at the first refused
// connection (and logs each try), so wait quietly for the listener until the deadline.
bool wait_for_listener(const std::string& addr, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(addr.c_str(), service.c_str(), &hints, &res) != 0 || res == nullptr) {
    fail("MASTER_ADDR '{}' does not resolve to an address", addr);
  }
  bool up = false;
  while (!up) {
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    up = connect(fd, res->ai_addr, res->ai_addrlen) == 0;
    close(fd);
    if (up || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  freeaddrinfo(res);
  return up;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    if (i == 8 && ranks.size() > 10) {
      s += fmt::format("... ({} more)", ranks.size() - i);
      break;
    }
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const WorldInfo& world,
                                                 const ProcessGroupOptions& options) {
  if (world.world_size <= 1) return std::make_shared<ProcessGroup>(world);

  const std::string where = fmt::format("{}:{}", world.master_addr, world.master_port);
  // Keys are per restart so a restarted group never reads its predecessor's check-ins.
  const std::string prefix = fmt::format("replica/restart{}/", world.restart_count);
  const bool server = world.rank == 0;
  if (server) check_port_free(world.master_addr, world.master_port);

  std::shared_ptr<detail::Store> store;
  if (!server && !wait_for_listener(world.master_addr, world.master_port,
                                    Clock::now() + options.rdzv_timeout)) {
    fail("rank {} could not reach the rendezvous at {} within {} s (is rank 0 running there? "
         "check MASTER_ADDR/MASTER_PORT)",
         world.rank, where, seconds(options.rdzv_timeout));
  }
  try {
    store = detail::make_tcp_store(world.master_addr, world.master_port, server, world.world_size,
                                   options.rdzv_timeout);
  } catch (const std::exception& e) {
    if (server) fail("rank 0 could not host the rendezvous at {}: {}", where, e.what());
    fail("rank {} could not reach the rendezvous at {} within {} s (is rank 0 running there? "
         "check MASTER_ADDR/MASTER_PORT): {}",
         world.rank, where, seconds(options.rdzv_timeout), e.what());
  }

  // Check in, then rank 0 waits for everyone and releases them together.
  const auto joined_key = [&](int r) { return prefix + "joined/" + std::to_string(r); };
  try {
    store->set(joined_key(world.rank), std::to_string(getpid()));
  } catch (const std::exception& e) {
    fail("rank {} lost the rendezvous at {}: {}", world.rank, where, e.what());
  }
  if (server) {
    std::vector<std::string> keys;
    for (int r = 0; r < world.world_size; ++r) keys.push_back(joined_key(r));
    const auto deadline = Clock::now() + options.rdzv_timeout;
    // Polling with a deadline (rather than one blocking wait) is what lets us name the
    // ranks that never arrived.
    while (!store->check(keys)) {
      if (Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < world.world_size; ++r) {
          if (!store->check({joined_key(r)})) missing.push_back(r);
        }
        fail("rendezvous at {} timed out after {} s: rank{} {} never joined ({} of {} joined)",
             where, seconds(options.rdzv_timeout), missing.size() == 1 ? "" : "s",
             rank_list(missing), world.world_size - static_cast<int>(missing.size()),
             world.world_size);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    store->set(prefix + "ready", "1");
  } else {
    try {
      store->wait({prefix + "ready"}, options.rdzv_timeout);
    } catch (const std::exception& e) {
      fail("rank {}: rendezvous at {} did not complete within {} s (rank 0 reports which ranks "
           "never joined): {}",
           world.rank, where, seconds(options.rdzv_timeout), e.what());
    }
  }

  // The transports' own timeouts come a little after the watchdog's, so that a hang is
  // reported by the watchdog, which can say which rank is behind.
  ProcessGroupOptions transport_options = options;
  if (options.collective_timeout.count() > 0) {
    transport_options.collective_timeout +=
        std::max<std::chrono::milliseconds>(std::chrono::seconds(5), options.collective_timeout / 10);
  }
  std::shared_ptr<ProcessGroup> pg;
  try {
    pg = detail::make_process_group(store, prefix, world, transport_options);
  } catch (const replica::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank {}: building the {} process group at {} failed: {}", world.rank, options.backend,
         where, e.what());
  }

  // The all-reduce transport: shared memory among the ranks of each node (hierarchical across
  // nodes), unless Gloo is asked for.
  std::string transport = options.transport;
  if (transport == "auto") transport = env("REPLICA_TRANSPORT").value_or("auto");
  if (transport != "auto" && transport != "shm" && transport != "gloo") {
    fail("unknown all-reduce transport '{}' (auto, shm, gloo)", transport);
  }
  const int local = world.local_world_size;
  const bool uniform = local >= 1 && world.world_size % local == 0 && world.local_rank < local;
  if (transport == "shm" && !uniform) {
    fail("rank {}: the shm transport needs the same number of workers on every node (LOCAL_WORLD_SIZE {} "
         "does not divide WORLD_SIZE {})", world.rank, local, world.world_size);
  }
  if (transport != "gloo" && uniform && local > 1) {
    const int nodes = world.world_size / local;
    const std::string job = fmt::format("{}shm/node{}/", prefix, world.node_rank);
    auto local_group = std::make_unique<ShmAllreduce>(world.local_rank, local, store_rendezvous(*pg),
                                                      transport_options.collective_timeout, job);
    std::shared_ptr<ProcessGroup> leaders;
    if (nodes > 1 && world.local_rank == 0) {
      WorldInfo lw = world;
      lw.rank = world.node_rank;
      lw.world_size = nodes;
      lw.local_rank = 0;
      lw.local_world_size = 1;
      leaders = detail::make_process_group(store, prefix + "leaders/", lw, transport_options);
    }
    pg->shm_ = std::make_shared<ShmTransport>(std::move(local_group), leaders, nodes > 1);
    pg->use_shm_ = true;
  }
  ProcessGroup* raw = pg.get();
  StoreAccess access{[raw](const std::string& k, const std::string& v) { raw->store_set(k, v); },
                     [raw](const std::string& k) { return raw->store_get(k); },
                     [raw](const std::string& k) { return raw->store_check(k); }};
  pg->monitor_ = std::make_shared<CollectiveMonitor>(world.rank, world.world_size, options.collective_timeout,
                                                     options.desync_check || CollectiveMonitor::desync_from_env(),
                                                     std::move(access));
  return pg;
}

namespace {

// Tells the monitor when an asynchronous all-reduce completes.
struct MonitoredWork final : Work::Impl {
  MonitoredWork(Work inner, std::shared_ptr<CollectiveMonitor> monitor, uint64_t seq)
      : inner(std::move(inner)), monitor(std::move(monitor)), seq(seq) {}
  // A Work dropped without wait() is no longer anyone's to wait for: stop watching it.
  ~MonitoredWork() override { monitor->end(seq); }
  void wait() override {
    inner.wait();
    monitor->end(seq);
  }
  bool done() const override { return inner.done(); }
  Work inner;
  std::shared_ptr<CollectiveMonitor> monitor;
  uint64_t seq;
};

}  // namespace

Work ProcessGroup::allreduce_sum(torch::Tensor& tensor, const char* file, int line) {
  const uint64_t seq = monitor_ ? monitor_->begin("all-reduce", {tensor}, file, line) : 0;
  Work work = use_shm_ && ShmTransport::supports(tensor) ? shm_->submit(tensor) : backend_allreduce_sum(tensor);
  if (!monitor_) return work;
  return Work(std::make_shared<MonitoredWork>(std::move(work), monitor_, seq));
}

std::string ProcessGroup::transport() const {
  if (size() <= 1) return "none";
  return use_shm_ ? "shm" : "gloo";
}

void ProcessGroup::set_transport(const std::string& transport) {
  if (transport == "gloo") {
    use_shm_ = false;
  } else if (transport == "shm" || transport == "auto") {
    if (!shm_ && size() > 1) {
      fail("rank {}: the shm transport is not active in this process group (it needs several workers per "
           "node and was not turned off with transport: gloo)", rank());
    }
    use_shm_ = shm_ != nullptr;
  } else {
    fail("unknown all-reduce transport '{}' (auto, shm, gloo)", transport);
  }
}

torch::Tensor ProcessGroup::alloc_buffer(int64_t numel, torch::ScalarType dtype) {
  if (shm_ && (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf)) {
    return shm_->alloc(numel, dtype);
  }
  return torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
}

}  // namespace replica::dist
