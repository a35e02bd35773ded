// Rendezvous: who joined, who did not, and what was wrong with the address.
#include "replica/distributed/process_group.h"

#include "replica/core/error.h"
#include "replica/distributed/c10d_compat.h"
#include "replica/distributed/collective_monitor.h"
#include "replica/distributed/shm_transport.h"
#include "replica/core/system.h"

#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include <thread>

namespace replica::distributed {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

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
  std::string token = options.token;
  if (token.empty()) token = env("REPLICA_TOKEN").value_or("");
  if (token.empty() && server) {
    spdlog::warn("rendezvous {}: no REPLICA_TOKEN / --token is set, so any process that can reach this address "
                 "may join; `replica launch` on one node sets one itself, on several nodes pass the same --token "
                 "to every launcher",
                 where);
  }

  // Rank 0's port-in-use and foreign-address errors come from the server as they are.
  std::shared_ptr<detail::Store> store;
  try {
    store = detail::make_store(world.master_addr, world.master_port, server, token, options.rdzv_timeout);
  } catch (const replica::Error& e) {
    if (server) throw;
    fail("rank {}: {}", world.rank, e.what());
  } catch (const std::exception& e) {
    if (server) fail("rank 0 could not host the rendezvous at {}: {}", where, e.what());
    fail("rank {} could not join the rendezvous at {}: {}", world.rank, where, e.what());
  }
  if (!store) {
    fail("rank {} could not reach the rendezvous at {} within {} s (is rank 0 running there? "
         "check MASTER_ADDR/MASTER_PORT)",
         world.rank, where, seconds(options.rdzv_timeout));
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
  // NCCL moves GPU memory itself: the shared-memory transport is for CPU tensors only.
  pg->backend_ = options.backend;
  if (transport != "gloo" && uniform && local > 1 && options.backend != "nccl") {
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

// Starts a collective under the watchdog (when there is one): registered before it starts,
// ended when its Work is waited for or dropped.
template <typename Start>
Work monitored(const std::shared_ptr<CollectiveMonitor>& monitor, const char* what, const torch::Tensor& tensor,
               const char* file, int line, Start start) {
  if (!monitor) return start();
  const uint64_t seq = monitor->begin(what, {tensor}, file, line);
  return Work(std::make_shared<MonitoredWork>(start(), monitor, seq));
}

}  // namespace

Work ProcessGroup::allreduce_sum(torch::Tensor& tensor, const char* file, int line) {
  return monitored(monitor_, "all-reduce", tensor, file, line, [&] {
    return use_shm_ && ShmTransport::supports(tensor) ? shm_->submit(tensor) : backend_allreduce_sum(tensor);
  });
}

std::pair<int64_t, int64_t> ProcessGroup::shard_range(int64_t numel, torch::ScalarType dtype, int rank) const {
  if (rank < 0 || rank >= size()) fail("shard_range: rank {} of a world of {}", rank, size());
  return ShmAllreduce::shard_range(numel, size(), rank, c10::elementSize(dtype));
}

namespace {

// Elements per rank in shard_range's cut of `tensor` (rank 0's shard; the last may be short).
int64_t chunk_of(const ProcessGroup& pg, const torch::Tensor& tensor) {
  const auto [b, e] = pg.shard_range(tensor.numel(), tensor.scalar_type(), 0);
  return e - b;
}

}  // namespace

Work ProcessGroup::reduce_scatter_sum(torch::Tensor& tensor, const char* file, int line) {
  return reduce_scatter(tensor, 1.0, file, line);
}

Work ProcessGroup::reduce_scatter_average(torch::Tensor& tensor, const char* file, int line) {
  return reduce_scatter(tensor, static_cast<double>(size()), file, line);
}

// The sum across ranks divided by `divisor`, at least in this rank's shard: the shared-memory
// transport's reduce-scatter, else the backend's own where it takes the tensor (Note [native
// reduce-scatter and all-gather] in c10d_compat.cpp), else an all-reduce of the whole tensor.
Work ProcessGroup::reduce_scatter(torch::Tensor& tensor, double divisor, const char* file, int line) {
  if (size() <= 1) return Work();
  if (shares_memory() && ShmTransport::supports(tensor)) {
    return monitored(monitor_, "reduce-scatter", tensor, file, line, [&] {
      return shm_->submit(tensor, ShmTransport::Op::kReduceScatter, static_cast<float>(divisor));
    });
  }
  if (tensor.dim() == 1 && tensor.numel() > 0 && backend_takes(tensor)) {
    const int64_t chunk = chunk_of(*this, tensor);
    return monitored(monitor_, "reduce-scatter", tensor, file, line,
                     [&] { return backend_reduce_scatter_sum(tensor, chunk, divisor); });
  }
  if (divisor != 1.0) {
    torch::NoGradGuard no_grad;
    tensor.div_(divisor);
  }
  return allreduce_sum(tensor, file, line);
}

Work ProcessGroup::all_gather_shards(torch::Tensor& tensor, const char* file, int line) {
  if (size() <= 1) return Work();
  if (!(shares_memory() && ShmTransport::supports(tensor))) {
    if (tensor.dim() != 1) fail("all_gather_shards: needs a flat tensor, got shape {}", c10::str(tensor.sizes()));
    if (tensor.numel() > 0 && backend_takes(tensor)) {
      const int64_t chunk = chunk_of(*this, tensor);
      return monitored(monitor_, "all-gather", tensor, file, line, [&] { return backend_all_gather(tensor, chunk); });
    }
    auto [b, e] = shard_range(tensor.numel(), tensor.scalar_type(), rank());
    torch::NoGradGuard no_grad;
    tensor.slice(0, 0, b).zero_();
    tensor.slice(0, e).zero_();
    return allreduce_sum(tensor, file, line);
  }
  return monitored(monitor_, "all-gather", tensor, file, line,
                   [&] { return shm_->submit(tensor, ShmTransport::Op::kAllGather); });
}

Work ProcessGroup::reduce_scatter_chunks(torch::Tensor& tensor, int64_t chunk, double divisor, const char* file,
                                         int line) {
  if (size() <= 1) return Work();
  if (!native_chunks(tensor) || tensor.dim() != 1 || tensor.numel() != chunk * size()) {
    fail("reduce_scatter_chunks: needs a flat tensor of {} x {} elements on a backend that takes it, got {}", size(),
         chunk, c10::str(tensor.sizes()));
  }
  return monitored(monitor_, "reduce-scatter", tensor, file, line,
                   [&] { return backend_reduce_scatter_sum(tensor, chunk, divisor); });
}

Work ProcessGroup::all_gather_chunks(torch::Tensor& tensor, int64_t chunk, const char* file, int line) {
  if (size() <= 1) return Work();
  if (!native_chunks(tensor) || tensor.dim() != 1 || tensor.numel() != chunk * size()) {
    fail("all_gather_chunks: needs a flat tensor of {} x {} elements on a backend that takes it, got {}", size(),
         chunk, c10::str(tensor.sizes()));
  }
  return monitored(monitor_, "all-gather", tensor, file, line, [&] { return backend_all_gather(tensor, chunk); });
}

std::vector<std::string> ProcessGroup::allgather_strings(const std::string& mine, const char* file, int line) {
  if (size() <= 1) return {mine};
  torch::Tensor length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong);
  std::vector<torch::Tensor> lengths;
  allgather(lengths, length, file, line);
  int64_t longest = 1;
  for (auto& t : lengths) longest = std::max(longest, t.item<int64_t>());
  torch::Tensor bytes = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<torch::Tensor> all;
  allgather(all, bytes, file, line);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) {
    out.emplace_back(static_cast<const char*>(all[r].data_ptr()), static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

std::string ProcessGroup::transport() const {
  if (size() <= 1) return "none";
  return use_shm_ ? "shm" : backend_;
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

bool ProcessGroup::shares_memory() const {
  return size() > 1 && use_shm_ && shm_ && !shm_->multi_node();
}

torch::Tensor ProcessGroup::alloc_shared_buffer(int64_t numel, torch::ScalarType dtype) {
  if (!shares_memory()) return torch::Tensor();
  return shm_->alloc_shared(numel, dtype);
}

Work ProcessGroup::shared_barrier(const char* file, int line) {
  if (size() <= 1) return Work();
  if (!shares_memory()) {
    barrier(file, line);
    return Work();
  }
  torch::Tensor nothing = torch::empty({0});
  return monitored(monitor_, "barrier", nothing, file, line,
                   [&] { return shm_->submit(nothing, ShmTransport::Op::kBarrier); });
}

torch::Tensor ProcessGroup::alloc_buffer(int64_t numel, torch::ScalarType dtype) {
  if (shm_ && (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf)) {
    return shm_->alloc(numel, dtype);
  }
  return torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
}

}  // namespace replica::distributed
