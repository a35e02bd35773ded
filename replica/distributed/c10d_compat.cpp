// Every c10d call replica makes lives here, so that a change of LibTorch touches one file.
//
// Note [Gloo's headers]: ProcessGroupGloo.hpp includes <gloo/...>, and PyTorch's wheels ship
// no Gloo headers, while libtorch_cpu.so carries (and exports) its own Gloo. We compile this one
// file against Debian's libgloo-dev headers (an older Gloo commit) and use Gloo's types only
// through pointers: `Options::devices` holds shared_ptr<gloo::transport::Device> made by
// libtorch's own createDevice* functions, and ProcessGroupGloo's members that name Gloo types
// are pointers too, so no Gloo object layout is compiled into replica. What must not happen is
// replica emitting Gloo code of its own (an inline Gloo function, or the vtable of
// ProcessGroupGloo::GlooStore, whose base class differs between the two commits), which could
// then interpose libtorch's: this file constructs no Gloo type, and the CTest
// `NoGlooCodeOfOurOwn` checks with nm that no replica binary defines a gloo:: symbol or
// GlooStore's vtable. Only this file includes the Gloo headers (USE_C10D_GLOO, which guards
// them, comes with the wheel's Torch target everywhere; CMakeLists.txt sets it here as well).
//
// Note [NCCL]: ProcessGroupNCCL's Options change layout with the NCCL version (NCCL_HAS_CONFIG
// and friends), so this file compiles against the NCCL headers of the wheel's nvidia-nccl
// package (the library libtorch_cuda.so loads), falling back to the CUDA toolkit's. Built
// only where LibTorch has CUDA (REPLICA_WITH_CUDA); a CPU LibTorch builds without it.
#include "replica/distributed/c10d_compat.h"

#include "replica/core/error.h"
#include "replica/distributed/collective_monitor.h"
#include "replica/core/system.h"
#include "replica/distributed/store.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <optional>
#ifdef REPLICA_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace replica::distributed {

// ---- Work ---------------------------------------------------------------------------------

namespace {

// A collective of a CPU tensor staged through the GPU: the result comes back on wait().
struct StagedWork final : Work::Impl {
  StagedWork(Work inner, at::Tensor host, at::Tensor device)
      : inner(std::move(inner)), host(std::move(host)), device(std::move(device)) {}
  void wait() override {
    inner.wait();
    host.copy_(device);
  }
  bool done() const override { return inner.done(); }
  Work inner;
  at::Tensor host, device;
};

// A collective whose result still has to be put in place (a padded tail, a shard copied
// back) when it is waited for.
struct FinishingWork final : Work::Impl {
  FinishingWork(Work inner, std::function<void()> finish) : inner(std::move(inner)), finish(std::move(finish)) {}
  void wait() override {
    inner.wait();
    if (finish) {
      auto f = std::move(finish);
      finish = nullptr;
      f();
    }
  }
  bool done() const override { return inner.done(); }
  Work inner;
  std::function<void()> finish;
};

struct C10dWork final : Work::Impl {
  C10dWork(c10::intrusive_ptr<c10d::Work> w, int r, const char* what) : work(std::move(w)), rank(r), what(what) {}
  void wait() override {
    try {
      work->wait();
    } catch (const std::exception& e) {
      fail("rank {}: {} failed: {}", rank, what, e.what());
    }
  }
  bool done() const override { return work->isCompleted(); }
  c10::intrusive_ptr<c10d::Work> work;
  int rank = 0;
  const char* what = "collective";
};

}  // namespace

void Work::wait() {
  if (impl_) impl_->wait();
}

bool Work::done() const { return !impl_ || impl_->done(); }

// ---- ProcessGroup -------------------------------------------------------------------------

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Backend> backend;  // Gloo or NCCL; null for world size 1
  c10::intrusive_ptr<c10d::Store> store;
  // NCCL: the rank's GPU, through which CPU tensors (control messages) are staged.
  std::optional<at::Device> stage;

  // `t` where the backend can reduce it: a copy on the staging device for a CPU tensor under
  // NCCL, else `t` itself.
  at::Tensor on_backend(const at::Tensor& t) const {
    return stage && !t.is_cuda() ? t.to(*stage, /*non_blocking=*/false, /*copy=*/true) : t;
  }
};

ProcessGroup::ProcessGroup(WorldInfo world, std::unique_ptr<Impl> impl)
    : world_(std::move(world)), impl_(std::move(impl)) {}

ProcessGroup::ProcessGroup(WorldInfo world) : world_(std::move(world)) {}

ProcessGroup::~ProcessGroup() {
  if (monitor_) monitor_->stop();  // its thread uses this group's store
}

namespace {

template <typename F>
auto guarded(int rank, const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const replica::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank {}: {} failed: {}", rank, what, e.what());
  }
}

}  // namespace

Work ProcessGroup::backend_allreduce_sum(torch::Tensor& tensor) {
  if (!impl_ || !impl_->backend) return Work();
  const at::Tensor target = impl_->on_backend(tensor);
  std::vector<at::Tensor> tensors{target};
  auto work = guarded(rank(), "all-reduce", [&] {
    return impl_->backend->allreduce(tensors, c10d::AllreduceOptions{});
  });
  Work done(std::make_shared<C10dWork>(work, rank(), "all-reduce"));
  if (target.is_same(tensor)) return done;
  return Work(std::make_shared<StagedWork>(std::move(done), tensor, target));
}

bool ProcessGroup::backend_takes(const torch::Tensor& tensor) const {
  return impl_ && impl_->backend && (impl_->stage ? tensor.is_cuda() : !tensor.is_cuda());
}

// Note [native reduce-scatter and all-gather]
// Without the shared-memory transport (across nodes, REPLICA_TRANSPORT=gloo, and NCCL on GPUs)
// the sharded DDP step and ZeRO-3 use the backend's reduce-scatter and all-gather, which move
// (N-1)/N of the tensor per rank where an all-reduce moves twice that. Both need N equal
// chunks: shard_range cuts the tensor into chunks of `chunk` elements with a short (or empty)
// tail, so a tensor of other than N * chunk elements goes through a padded copy. The
// reduce-scatter writes this rank's chunk into a separate buffer (no aliasing of input and
// output, which Gloo does not promise to handle) and copies it back, divided, on wait().
Work ProcessGroup::backend_reduce_scatter_sum(torch::Tensor& tensor, int64_t chunk, double divisor) {
  at::NoGradGuard no_grad;  // ZeRO-3 gathers inside forward: the backend's views must not join the graph
  const int n = size();
  const int64_t numel = tensor.numel(), padded = chunk * n;
  at::Tensor input = tensor;
  if (padded != numel) {
    input = torch::zeros({padded}, tensor.options());
    input.narrow(0, 0, numel).copy_(tensor);
  }
  at::Tensor output = torch::empty({chunk}, tensor.options());
  auto work = guarded(rank(), "reduce-scatter", [&] {
    return impl_->backend->_reduce_scatter_base(output, input, c10d::ReduceScatterOptions{});
  });
  Work done(std::make_shared<C10dWork>(work, rank(), "reduce-scatter"));
  const int64_t begin = std::min(numel, chunk * rank()), end = std::min(numel, begin + chunk);
  return Work(std::make_shared<FinishingWork>(std::move(done), [tensor, output, input, begin, end, divisor] {
    if (end <= begin) return;
    at::NoGradGuard no_grad;
    auto own = tensor.narrow(0, begin, end - begin);
    own.copy_(output.narrow(0, 0, end - begin));
    if (divisor != 1.0) own.div_(divisor);
  }));
}

Work ProcessGroup::backend_all_gather(torch::Tensor& tensor, int64_t chunk) {
  at::NoGradGuard no_grad;  // as above
  const int n = size();
  const int64_t numel = tensor.numel(), padded = chunk * n;
  const int64_t begin = std::min(numel, chunk * rank()), end = std::min(numel, begin + chunk);
  at::Tensor input = torch::zeros({chunk}, tensor.options());
  if (end > begin) input.narrow(0, 0, end - begin).copy_(tensor.narrow(0, begin, end - begin));
  at::Tensor output = padded == numel ? tensor : torch::empty({padded}, tensor.options());
  auto work = guarded(rank(), "all-gather", [&] {
    return impl_->backend->_allgather_base(output, input, c10d::AllgatherOptions{});
  });
  Work done(std::make_shared<C10dWork>(work, rank(), "all-gather"));
  if (output.is_same(tensor)) return Work(std::make_shared<FinishingWork>(std::move(done), [input] {}));
  return Work(std::make_shared<FinishingWork>(std::move(done), [tensor, output, input, numel] {
    at::NoGradGuard no_grad;
    tensor.copy_(output.narrow(0, 0, numel));
  }));
}

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors, int root, const char* file, int line) {
  if (!impl_ || !impl_->backend) return;
  const uint64_t seq = monitor_ ? monitor_->begin("broadcast", tensors, file, line) : 0;
  guarded(rank(), "broadcast", [&] {
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{impl_->on_backend(t)};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      impl_->backend->broadcast(one, opts)->wait();
      if (!one[0].is_same(t)) t.copy_(one[0]);
    }
  });
  if (monitor_) monitor_->end(seq);
}

void ProcessGroup::allgather(std::vector<torch::Tensor>& out, const torch::Tensor& in, const char* file,
                             int line) {
  if (!impl_ || !impl_->backend) {
    out.assign(1, in.clone());
    return;
  }
  const uint64_t seq = monitor_ ? monitor_->begin("all-gather", {in}, file, line) : 0;
  guarded(rank(), "all-gather", [&] {
    const at::Tensor input = impl_->on_backend(in.contiguous());
    out.clear();
    for (int r = 0; r < size(); ++r) out.push_back(torch::empty_like(input));
    std::vector<std::vector<at::Tensor>> outputs{out};
    std::vector<at::Tensor> inputs{input};
    impl_->backend->allgather(outputs, inputs)->wait();
    out = outputs[0];
    if (input.device() != in.device()) {
      for (auto& t : out) t = t.to(in.device());
    }
  });
  if (monitor_) monitor_->end(seq);
}

void ProcessGroup::barrier(const char* file, int line) {
  if (!impl_ || !impl_->backend) return;
  const uint64_t seq = monitor_ ? monitor_->begin("barrier", {}, file, line) : 0;
  guarded(rank(), "barrier", [&] { impl_->backend->barrier()->wait(); });
  if (monitor_) monitor_->end(seq);
}

void ProcessGroup::store_set(const std::string& key, const std::string& value) {
  if (!impl_ || !impl_->store) return;
  guarded(rank(), "store set", [&] {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  });
}

bool ProcessGroup::store_check(const std::string& key) {
  if (!impl_ || !impl_->store) return false;
  return guarded(rank(), "store check", [&] { return impl_->store->check({key}); });
}

std::string ProcessGroup::store_get(const std::string& key) {
  if (!impl_ || !impl_->store) fail("store_get('{}') needs a distributed process group", key);
  return guarded(rank(), "store get", [&] {
    auto v = impl_->store->get(key);
    return std::string(v.begin(), v.end());
  });
}

std::string nccl_version() {
#ifdef REPLICA_WITH_CUDA
  return guarded(0, "NCCL version", [] { return c10d::getNcclVersion(); });
#else
  return "";
#endif
}

// ---- construction -------------------------------------------------------------------------

namespace detail {
namespace {

// c10d's Store interface over the locked rendezvous client, so that Gloo rendezvouses
// through it. The server (rank 0 only) lives as long as the store.
class LockedStore final : public c10d::Store {
 public:
  LockedStore(std::shared_ptr<rdzv::Client> client, std::shared_ptr<rdzv::Server> server,
              std::chrono::milliseconds timeout)
      : c10d::Store(timeout), client_(std::move(client)), server_(std::move(server)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override { client_->set(key, value); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return client_->compare_set(key, expected, desired);
  }
  // c10d's get blocks until the key exists (up to the store's timeout).
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    auto value = client_->get(key);
    if (!value) fail("rendezvous: key '{}' vanished between wait and get", key);
    return *value;
  }
  int64_t add(const std::string& key, int64_t value) override { return client_->add(key, value); }
  bool deleteKey(const std::string& key) override { return client_->remove(key); }
  bool check(const std::vector<std::string>& keys) override { return client_->check(keys); }
  int64_t getNumKeys() override { return client_->num_keys(); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    if (!client_->wait(keys, timeout)) {
      fail("rendezvous at {}:{}: timed out after {} s waiting for {}", client_->host(), client_->port(),
           timeout.count() / 1000.0, keys.size() == 1 ? "key '" + keys[0] + "'" : fmt::format("{} keys", keys.size()));
    }
  }
  // A second connection to the same server (the server stays with the original).
  c10::intrusive_ptr<c10d::Store> clone() override {
    auto client = rdzv::Client::connect(client_->host(), client_->port(), client_->token(),
                                        rdzv::Clock::now() + timeout_);
    if (!client) fail("rendezvous at {}:{} is gone", client_->host(), client_->port());
    return c10::make_intrusive<LockedStore>(std::move(client), nullptr, timeout_);
  }

 private:
  std::shared_ptr<rdzv::Client> client_;
  std::shared_ptr<rdzv::Server> server_;
};

class StoreHandle final : public Store {
 public:
  explicit StoreHandle(c10::intrusive_ptr<c10d::Store> s) : store(std::move(s)) {}
  void set(const std::string& key, const std::string& value) override {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store->get(key);
    return std::string(v.begin(), v.end());
  }
  bool check(const std::vector<std::string>& keys) override { return store->check(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    store->wait(keys, timeout);
  }
  c10::intrusive_ptr<c10d::Store> store;
};

}  // namespace

std::shared_ptr<Store> make_store(const std::string& host, int port, bool is_server, const std::string& token,
                                  std::chrono::milliseconds timeout) {
  std::shared_ptr<rdzv::Server> server;
  if (is_server) server = std::make_shared<rdzv::Server>(host, port, token);
  std::shared_ptr<rdzv::Client> client = rdzv::Client::connect(host, port, token, rdzv::Clock::now() + timeout);
  if (!client) return nullptr;
  return std::make_shared<StoreHandle>(c10::make_intrusive<LockedStore>(std::move(client), std::move(server), timeout));
}

std::shared_ptr<ProcessGroup> make_process_group(const std::shared_ptr<Store>& store,
                                                 const std::string& prefix,
                                                 const WorldInfo& world,
                                                 const ProcessGroupOptions& options) {
  auto tcp = std::dynamic_pointer_cast<StoreHandle>(store);
  if (!tcp) fail("internal: process group needs the rendezvous store");
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix + "user/", tcp->store);
  if (options.backend == "nccl") {
#ifdef REPLICA_WITH_CUDA
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>(prefix + "nccl/", tcp->store);
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.collective_timeout;
    impl->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(pg_store, world.rank, world.world_size,
                                                                nccl_options);
    if (options.cuda_device < 0) fail("rank {}: the nccl backend needs this rank's GPU (cuda_device)", world.rank);
    impl->stage = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options.cuda_device));
    return std::make_shared<ProcessGroup>(world, std::move(impl));
#else
    fail("distributed backend 'nccl' needs a LibTorch built with CUDA; this replica was built against "
         "LibTorch {} without CUDA (available: gloo)", TORCH_VERSION);
#endif
  }
  if (options.backend != "gloo") {
    fail("distributed backend '{}' is not known (available: gloo{})", options.backend,
#ifdef REPLICA_WITH_CUDA
         ", nccl"
#else
         ""
#endif
    );
  }
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>(prefix + "gloo/", tcp->store);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.collective_timeout);
  // The interface Gloo's sockets use: GLOO_SOCKET_IFNAME wins (as in PyTorch); a loopback
  // rendezvous means a single-host job, so stay on loopback; else the host's own address.
  if (auto ifname = env("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty()) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
  } else if (world.master_addr.rfind("127.", 0) == 0 || world.master_addr == "localhost") {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, world.rank,
                                                               world.world_size, gloo_options);
  return std::make_shared<ProcessGroup>(world, std::move(impl));
}

}  // namespace detail
}  // namespace replica::distributed
