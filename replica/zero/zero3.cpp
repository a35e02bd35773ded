#include "replica/zero/zero3.h"

#include "replica/core/error.h"
#include "replica/core/file_tensor.h"
#include "replica/distributed/grad_norm.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <cmath>
#include <set>

namespace replica::zero {

struct Zero3::Group {
  GroupInfo info;
  std::vector<torch::Tensor> params;  // views into `storage` while gathered
  c10::Storage storage;               // N * S elements of info.dtype; 0 bytes when released
  torch::Device device = torch::kCPU; // of the parameters and `storage` (Note [ZeRO-3 on the device])
  torch::Tensor master;               // [S] fp32, this worker's slice (on `device`, or the host)
  bool gathered = false;
  distributed::Work in_flight;               // a gather launched ahead of use (prefetch)
  size_t pending = 0;                 // trainable parameters without a gradient this backward
  bool reduced = false;
  int64_t full_bytes() const { return info.shard * pg_size * static_cast<int64_t>(c10::elementSize(info.dtype)); }
  int64_t pg_size = 1;
};

namespace {

void resize_storage(const c10::Storage& storage, size_t bytes) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (bytes == 0) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  } else {
    impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  }
  impl->set_nbytes(bytes);
}

// The flat buffer as a tensor that shares no version counter with the parameters: writing
// the gathered values must not look like an in-place change to autograd's saved tensors.
torch::Tensor flat_of(const c10::Storage& storage, int64_t numel, torch::ScalarType dtype) {
  return torch::from_blob(storage.mutable_data(), {numel}, torch::TensorOptions().dtype(dtype).device(storage.device()));
}

// `part` added into `into` (a slice of a master shard's gradient), scaled; `part` copied to the
// master's device first where the master lives elsewhere (offload_param_device: host masters
// of GPU parameters).
void add_to_master(torch::Tensor into, const torch::Tensor& part, double scale = 1.0) {
  into.add_(part.device() == into.device() ? part : part.to(into.device()), scale);
}

}  // namespace

// Identity on a layer's output whose backward gathers the layer's groups before the layer's
// own backward runs (it consumes this node's output gradient).
struct PreBackward : torch::autograd::Function<PreBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, int64_t engine,
                               int64_t layer) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["layer"] = layer;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* engine = reinterpret_cast<Zero3*>(ctx->saved_data["engine"].toInt());
    engine->pre_backward(ctx->saved_data["layer"].toInt());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

Zero3::Zero3(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<distributed::ProcessGroup> process_group,
             Zero3Options options)
    : model_(std::move(model)), pg_(std::move(process_group)), options_(options) {
  torch::NoGradGuard no_grad;
  const int64_t world = pg_->size();
  const int rank = pg_->rank();

  // Which parameter goes to which group: per hooked layer (first owner wins), then the rest.
  std::map<const c10::TensorImpl*, std::string> name_of;
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (auto& item : model_->named_parameters()) {
    if (name_of.count(item.value().unsafeGetTensorImpl())) continue;
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
    all.emplace_back(item.key(), item.value());
  }
  std::map<const c10::TensorImpl*, size_t> group_of;
  auto add_groups = [&](const std::vector<torch::Tensor>& tensors, const std::string& where) {
    for (bool trainable : {true, false}) {
      auto g = std::make_unique<Group>();
      g->pg_size = world;
      for (const auto& t : tensors) {
        auto* impl = t.unsafeGetTensorImpl();
        if (group_of.count(impl) || t.requires_grad() != trainable) continue;
        if (!g->params.empty() && t.scalar_type() != g->info.dtype) {
          fail("ZeRO-3: parameters of {} mix dtypes ({} is {}, {} is {})", where, name_of[impl],
               c10::toString(t.scalar_type()), g->info.params[0].name, c10::toString(g->info.dtype));
        }
        if (!g->params.empty() && t.device() != g->device) {
          fail("ZeRO-3: parameters of {} are on different devices ({} is on {}, {} on {}); move the model to one "
               "device before ZeRO-3 wraps it",
               where, name_of[impl], t.device().str(), g->info.params[0].name, g->device.str());
        }
        g->info.dtype = t.scalar_type();
        g->device = t.device();
        g->info.params.push_back({name_of[impl], t.sizes().vec(), g->info.numel});
        g->info.numel += t.numel();
        g->params.push_back(t);
        group_of[impl] = groups_.size();
      }
      if (g->params.empty()) continue;
      g->info.trainable = trainable;
      g->info.name = fmt::format("group.{}", groups_.size());
      groups_.push_back(std::move(g));
    }
  };
  hooked_ = dynamic_cast<models::HookedLayers*>(model_.get());
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  if (hooked_) layers = hooked_->hooked_layers();
  for (auto& layer : layers) {
    std::vector<torch::Tensor> tensors;
    for (auto& p : layer->parameters(/*recurse=*/true)) tensors.push_back(p);
    add_groups(tensors, "layer " + layer->name());
  }
  const size_t first_rest = groups_.size();
  {
    std::vector<torch::Tensor> rest;
    for (auto& [name, t] : all) rest.push_back(t);
    add_groups(rest, "the model");
  }
  for (auto& layer : layers) {
    std::set<size_t> used;
    for (auto& p : layer->parameters(/*recurse=*/true)) used.insert(group_of.at(p.unsafeGetTensorImpl()));
    layer_index_[layer.get()] = layers_.size();
    layers_.push_back(layer.get());
    layer_groups_.emplace_back(used.begin(), used.end());
  }

  // Flatten: rank 0's values (as DDP broadcasts them), sharded; parameters become views.
  for (size_t k = 0; k < groups_.size(); ++k) {
    Group& g = *groups_[k];
    g.info.shard = (g.info.numel + world - 1) / world;
    // Parameters outside every layer are used at any time: they stay gathered.
    g.info.persistent = k >= first_rest || !hooked_ ||
                        static_cast<double>(g.info.numel) < options_.stage3_param_persistence_threshold;
    torch::Tensor flat =
        torch::zeros({g.info.shard * world}, torch::TensorOptions().dtype(g.info.dtype).device(g.device));
    for (size_t i = 0; i < g.params.size(); ++i) {
      flat.narrow(0, g.info.params[i].offset, g.params[i].numel()).copy_(g.params[i].reshape(-1));
    }
    std::vector<torch::Tensor> msg{flat};
    pg_->broadcast(msg, 0);
    const auto own = flat.narrow(0, rank * g.info.shard, g.info.shard);
    if (!options_.param_swap_dir.empty()) {
      g.master = file_backed_zeros(options_.param_swap_dir, {g.info.shard}, torch::kFloat32);
      g.master.copy_(own);
    } else if (options_.master_on_host && g.device.is_cuda()) {
      // Pinned: the per-layer gathers copy the shard up, the reductions copy gradients down.
      g.master = torch::empty({g.info.shard}, torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(true));
      g.master.copy_(own);
    } else {
      g.master = own.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
    }
    if (g.info.trainable) g.master.set_requires_grad(true);
    g.storage = flat.storage();
    for (size_t i = 0; i < g.params.size(); ++i) {
      g.params[i].set_data(flat.narrow(0, g.info.params[i].offset, g.params[i].numel()).view(g.info.params[i].shape));
    }
    g.gathered = true;
    note_gathered(g.full_bytes());
    stats_.master_bytes += g.info.shard * 4;
    if (g.info.trainable) stats_.master_grad_bytes += g.info.shard * 4;
    if (!g.info.persistent) release(g);
  }
  // Elements gathered between a layer's forward and its backward: the later layers' groups.
  reuse_distance_.assign(layers_.size(), 0);
  for (size_t i = layers_.size(); i-- > 1;) {
    int64_t n = 0;
    for (size_t k : layer_groups_[i]) n += groups_[k]->info.persistent ? 0 : groups_[k]->info.shard * world;
    reuse_distance_[i - 1] = reuse_distance_[i] + n;
  }
  // Buffers (BatchNorm statistics) are not sharded: rank 0's, as DDP starts.
  std::vector<torch::Tensor> buffers;
  for (auto& b : model_->buffers()) buffers.push_back(b);
  if (!buffers.empty()) pg_->broadcast(buffers, 0);

  for (size_t k = 0; k < groups_.size(); ++k) {
    if (!groups_[k]->info.trainable) continue;
    for (auto& p : groups_[k]->params) {
      auto acc = torch::autograd::impl::grad_accumulator(p);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_grad_ready(k);
            return outputs;
          }));
      grad_accumulators_.push_back(std::move(acc));
    }
    groups_[k]->pending = groups_[k]->params.size();
  }
  if (hooked_) hooked_->set_layer_hooks(this);
}

Zero3::~Zero3() {
  if (hooked_) hooked_->set_layer_hooks(nullptr);
  for (auto& acc : grad_accumulators_) acc->post_hooks().clear();
  for (auto& g : groups_) {
    if (g->in_flight.valid()) {
      try {
        g->in_flight.wait();
      } catch (...) {
      }
    }
  }
}

void Zero3::note_gathered(int64_t delta) {
  gathered_bytes_ += delta;
  // Training's peak: gather_all (evaluation, the final save) holds the whole model on purpose.
  if (delta > 0 && !hold_all_) stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, gathered_bytes_);
}

// Launches the gather of `g` (asynchronous when the transport allows); finish with wait.
void Zero3::gather(Group& g) {
  if (g.gathered) return;
  const int64_t full = g.info.shard * pg_->size();
  resize_storage(g.storage, static_cast<size_t>(g.full_bytes()));
  torch::Tensor flat = flat_of(g.storage, full, g.info.dtype);
  flat.narrow(0, pg_->rank() * g.info.shard, g.info.shard).copy_(g.master);
  if (pg_->native_chunks(flat)) {
    g.in_flight = pg_->all_gather_chunks(flat, g.info.shard);  // Note [native reduce-scatter and all-gather]
  } else {
    // The shared-memory all-reduce of zeros around each rank's own shard (see the top of zero3.h).
    flat.narrow(0, 0, pg_->rank() * g.info.shard).zero_();
    flat.narrow(0, (pg_->rank() + 1) * g.info.shard, full - (pg_->rank() + 1) * g.info.shard).zero_();
    g.in_flight = pg_->allreduce_sum(flat);
  }
  g.gathered = true;
  note_gathered(g.full_bytes());
}

void Zero3::release(Group& g) {
  if (!g.gathered || g.info.persistent) return;
  if (g.in_flight.valid()) {
    g.in_flight.wait();
    g.in_flight = distributed::Work();
  }
  resize_storage(g.storage, 0);
  g.gathered = false;
  note_gathered(-g.full_bytes());
}

void Zero3::before(torch::nn::Module& layer) {
  auto it = layer_index_.find(&layer);
  if (it == layer_index_.end()) return;
  const size_t index = it->second;
  for (size_t k : layer_groups_[index]) gather(*groups_[k]);
  // Prefetch: the next layer's groups travel while this layer computes.
  if (options_.overlap_comm && torch::GradMode::is_enabled() && index + 1 < layers_.size()) {
    int64_t budget = static_cast<int64_t>(options_.stage3_prefetch_bucket_size);
    const int64_t live_limit = static_cast<int64_t>(options_.stage3_max_live_parameters);
    int64_t live = 0;
    for (auto& g : groups_) live += g->gathered ? g->info.shard * pg_->size() : 0;
    for (size_t k : layer_groups_[index + 1]) {
      Group& next = *groups_[k];
      const int64_t n = next.info.shard * pg_->size();
      if (next.gathered || n > budget || live + n > live_limit) continue;
      gather(next);
      budget -= n;
      live += n;
    }
  }
  for (size_t k : layer_groups_[index]) {
    Group& g = *groups_[k];
    if (g.in_flight.valid()) {
      g.in_flight.wait();
      g.in_flight = distributed::Work();
    }
  }
}

torch::Tensor Zero3::after(torch::nn::Module& layer, torch::Tensor output) {
  auto it = layer_index_.find(&layer);
  if (it == layer_index_.end()) return output;
  const size_t index = it->second;
  const bool backward_follows = torch::GradMode::is_enabled() && output.requires_grad();
  bool keep = hold_all_;
  if (!keep && backward_follows &&
      static_cast<double>(reuse_distance_[index]) <= options_.stage3_max_reuse_distance) {
    // Kept for its backward when the parameters gathered meanwhile stay within the live limit.
    int64_t live = 0;
    for (auto& g : groups_) live += g->gathered ? g->info.shard * pg_->size() : 0;
    keep = static_cast<double>(live + reuse_distance_[index]) <= options_.stage3_max_live_parameters;
  }
  if (!keep) {
    for (size_t k : layer_groups_[index]) release(*groups_[k]);
  }
  if (!backward_follows) return output;
  return PreBackward::apply(output, reinterpret_cast<int64_t>(this), static_cast<int64_t>(index));
}

void Zero3::queue_finalize() {
  if (finalize_queued_) return;
  finalize_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
}

void Zero3::pre_backward(int64_t layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_finalize();
  const size_t index = static_cast<size_t>(layer);
  for (size_t k : layer_groups_[index]) gather(*groups_[k]);
  // Prefetch the layer the backward reaches next.
  if (options_.overlap_comm && index > 0) {
    int64_t budget = static_cast<int64_t>(options_.stage3_prefetch_bucket_size);
    for (size_t k : layer_groups_[index - 1]) {
      Group& prev = *groups_[k];
      const int64_t n = prev.info.shard * pg_->size();
      if (prev.gathered || n > budget) continue;
      // Only groups whose gradients are still to come (a reduced group is done).
      if (prev.info.trainable && prev.reduced) continue;
      gather(prev);
      budget -= n;
    }
  }
  for (size_t k : layer_groups_[index]) {
    Group& g = *groups_[k];
    if (g.in_flight.valid()) {
      g.in_flight.wait();
      g.in_flight = distributed::Work();
    }
  }
}

void Zero3::on_grad_ready(size_t group) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_finalize();
  Group& g = *groups_[group];
  if (g.pending > 0) --g.pending;
  if (g.pending == 0 && !g.reduced) reduce(g);
}

// Averages the group's gradients across workers and adds this worker's slice to the master
// shard's gradient; the full gradients (and, outside gather_all, the gathered parameters: all
// of them trainable, all their uses done) are freed. Each parameter's gradient is all-reduced
// where autograd left it (no flat copy: the transient memory stays one group's gradients);
// a parameter without a gradient counts as zeros.
void Zero3::reduce(Group& g) {
  torch::NoGradGuard no_grad;
  torch::Tensor& master_grad = g.master.mutable_grad();
  if (!master_grad.defined()) master_grad = torch::zeros_like(g.master);
  if (!reduce_native(g, master_grad)) reduce_all(g, master_grad);
  g.reduced = true;
  if (!hold_all_) release(g);
}

// The all-reduce path of reduce (the shared-memory transport's): every parameter's gradient
// all-reduced, this worker's slice of each added to the master shard's gradient.
void Zero3::reduce_all(Group& g, torch::Tensor& master_grad) {
  const int64_t world = pg_->size();
  const int64_t lo = pg_->rank() * g.info.shard, hi = lo + g.info.shard;
  std::vector<torch::Tensor> grads(g.params.size());
  std::vector<distributed::Work> works(g.params.size());
  int64_t grad_bytes = 0;
  for (size_t i = 0; i < g.params.size(); ++i) {
    torch::Tensor& grad = g.params[i].mutable_grad();
    grads[i] = grad.defined() ? grad.contiguous() : torch::zeros_like(g.params[i], torch::MemoryFormat::Contiguous);
    grad = torch::Tensor();
    if (grads[i].scalar_type() != torch::kFloat32) grads[i] = grads[i].to(torch::kFloat32);
    grad_bytes += grads[i].numel() * 4;
    works[i] = pg_->allreduce_sum(grads[i]);
  }
  stats_.peak_transient_grad_bytes = std::max(stats_.peak_transient_grad_bytes, grad_bytes);
  for (size_t i = 0; i < g.params.size(); ++i) {
    works[i].wait();
    const int64_t begin = g.info.params[i].offset, end = begin + grads[i].numel();
    const int64_t a = std::max(begin, lo), b = std::min(end, hi);
    if (a < b) add_to_master(master_grad.narrow(0, a - lo, b - a), grads[i].view(-1).narrow(0, a - begin, b - a), 1.0 / world);
    grads[i] = torch::Tensor();
  }
}

// Without the shared-memory transport: the group's gradients flattened into its N x S layout
// and reduce-scattered by the backend (Note [native reduce-scatter and all-gather] in
// c10d_compat.cpp), each worker receiving only its averaged shard. False (nothing done) where
// the transport's all-reduce is the path.
bool Zero3::reduce_native(Group& g, torch::Tensor& master_grad) {
  const int64_t world = pg_->size();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(g.device);
  if (world <= 1 || !pg_->native_chunks(torch::empty({0}, f32))) return false;
  torch::Tensor flat = torch::zeros({g.info.shard * world}, f32);
  for (size_t i = 0; i < g.params.size(); ++i) {
    torch::Tensor& grad = g.params[i].mutable_grad();
    if (grad.defined()) flat.narrow(0, g.info.params[i].offset, grad.numel()).copy_(grad.reshape(-1));
    grad = torch::Tensor();
  }
  stats_.peak_transient_grad_bytes = std::max(stats_.peak_transient_grad_bytes, flat.numel() * 4);
  pg_->reduce_scatter_chunks(flat, g.info.shard, static_cast<double>(world)).wait();
  add_to_master(master_grad, flat.narrow(0, pg_->rank() * g.info.shard, g.info.shard));
  return true;
}

void Zero3::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  finalize_queued_ = false;
  // Trainable groups that got no gradient (unused this step): reduced as zeros, in group
  // order, so every worker issues the same collectives.
  for (auto& g : groups_) {
    if (g->info.trainable && !g->reduced) reduce(*g);
  }
  for (auto& g : groups_) {
    g->reduced = false;
    g->pending = g->info.trainable ? g->params.size() : 0;
    if (!hold_all_) release(*g);
  }
}

std::vector<torch::Tensor> Zero3::shard_parameters() const {
  std::vector<torch::Tensor> out;
  for (auto& g : groups_) {
    if (g->info.trainable) out.push_back(g->master);
  }
  return out;
}

std::vector<std::string> Zero3::shard_names() const {
  std::vector<std::string> out;
  for (auto& g : groups_) {
    if (g->info.trainable) out.push_back(g->info.name);
  }
  return out;
}

torch::Tensor Zero3::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> grads;
  for (auto& g : groups_) {
    if (g->info.trainable) grads.push_back(g->master.grad());
  }
  return distributed::clip_grad_norm(grads, max_norm, pg_.get());
}

void Zero3::after_step() {
  torch::NoGradGuard no_grad;
  for (auto& g : groups_) {
    if (!g->gathered) continue;  // released: the next gather reads the new shard
    // Gathered (persistent, or held): take the new values.
    if (g->info.persistent) {
      g->gathered = false;
      note_gathered(-g->full_bytes());
    } else {
      release(*g);
    }
    gather(*g);
  }
  for (auto& g : groups_) {
    if (g->in_flight.valid()) {
      g->in_flight.wait();
      g->in_flight = distributed::Work();
    }
  }
}

void Zero3::gather_all() {
  hold_all_ = true;
  for (auto& g : groups_) gather(*g);
  for (auto& g : groups_) {
    if (g->in_flight.valid()) {
      g->in_flight.wait();
      g->in_flight = distributed::Work();
    }
  }
}

void Zero3::release_all() {
  hold_all_ = false;
  for (auto& g : groups_) release(*g);
}

io::NamedTensors Zero3::master_shards() const {
  io::NamedTensors out;
  for (auto& g : groups_) out.emplace_back(g->info.name, g->master.detach());
  return out;
}

void Zero3::load_shards(const io::NamedTensors& shards, const std::string& where) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> by_name(shards.begin(), shards.end());
  for (auto& g : groups_) {
    auto it = by_name.find(g->info.name);
    if (it == by_name.end()) fail("{}: shard '{}' is missing", where, g->info.name);
    if (it->second.numel() != g->info.shard) {
      fail("{}: shard '{}' has {} elements, this worker's shard has {}", where, g->info.name, it->second.numel(),
           g->info.shard);
    }
    g->master.copy_(it->second.reshape(-1));
  }
  after_step();
}

std::vector<Zero3::GroupInfo> Zero3::groups() const {
  std::vector<GroupInfo> out;
  for (auto& g : groups_) out.push_back(g->info);
  return out;
}

MemoryStats Zero3::memory() const { return stats_; }

}  // namespace replica::zero
