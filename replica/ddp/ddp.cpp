#include "replica/ddp/ddp.h"

#include "replica/core/error.h"
#include "replica/core/gradient_home.h"
#include "replica/core/system.h"
#include "replica/ddp/bucketing.h"
#include "replica/distributed/grad_norm.h"
#include "replica/obs/timeline.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/util/strides.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <sstream>

namespace replica::ddp {

CommHook allreduce_average_hook() {
  return [](distributed::ProcessGroup& pg, GradBucket& bucket) -> std::function<void()> {
    // Divide first (PyTorch's default): the sum of averages cannot overflow fp16/bf16.
    bucket.buffer.div_(pg.size());
    auto work = std::make_shared<distributed::Work>(pg.allreduce_sum(bucket.buffer));
    return [work] { work->wait(); };
  };
}

namespace {

CommHook compress_hook(torch::ScalarType wire) {
  return [wire](distributed::ProcessGroup& pg, GradBucket& bucket) -> std::function<void()> {
    if (bucket.buffer.scalar_type() == wire) return allreduce_average_hook()(pg, bucket);
    auto compressed = std::make_shared<torch::Tensor>(bucket.buffer.to(wire).div_(pg.size()));
    auto work = std::make_shared<distributed::Work>(pg.allreduce_sum(*compressed));
    torch::Tensor target = bucket.buffer;
    return [work, compressed, target]() mutable {
      work->wait();
      target.copy_(*compressed);
    };
  };
}

}  // namespace

CommHook bf16_compress_hook() { return compress_hook(torch::kBFloat16); }
CommHook fp16_compress_hook() { return compress_hook(torch::kHalf); }

namespace {

// Same-kind tensors share a bucket; one flat broadcast per kind on construction.
std::string kind_of(const torch::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + "@" + t.device().str();
}

void broadcast_coalesced(distributed::ProcessGroup& pg, const std::vector<torch::Tensor>& tensors) {
  std::map<std::string, std::vector<torch::Tensor>> by_kind;
  for (const auto& t : tensors) by_kind[kind_of(t)].push_back(t);
  for (auto& [kind, group] : by_kind) {
    std::vector<torch::Tensor> flat_parts;
    for (auto& t : group) flat_parts.push_back(t.detach().reshape({-1}));
    std::vector<torch::Tensor> flat{torch::cat(flat_parts)};
    pg.broadcast(flat, 0);
    int64_t offset = 0;
    torch::NoGradGuard no_grad;
    for (auto& t : group) {
      t.detach().copy_(flat[0].slice(0, offset, offset + t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

// A tensor over part of the bucket's storage. Deliberately not an autograd view
// (slice().view()): optimizers call grad.detach_(), which LibTorch refuses on views.
torch::Tensor bucket_view(const torch::Tensor& buffer, int64_t offset, c10::IntArrayRef sizes) {
  torch::Tensor t = torch::empty({0}, buffer.options());
  t.set_(buffer.storage(), buffer.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

// Whether .grad already lives at its place in the bucket.
bool is_bucket_view(const torch::Tensor& grad, const torch::Tensor& view) {
  return grad.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
         grad.is_contiguous();
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<distributed::ProcessGroup> pg,
                                                 DDPOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options),
      hook_(allreduce_average_hook()) {
  if (!module_) fail("DistributedDataParallel needs a module");
  if (!pg_) fail("DistributedDataParallel needs a process group");
  // A training process: large tensors freed by one step are reused by the next instead of
  // being unmapped and faulted in again (replica/core/system.h).
  keep_freed_memory_for(module_->parameters());

  // Identical replicas: everything rank 0 has, every rank has.
  std::vector<torch::Tensor> state;
  for (auto& p : module_->parameters()) state.push_back(p);
  for (auto& b : module_->buffers()) state.push_back(b);
  if (pg_->size() > 1 && !state.empty()) broadcast_coalesced(*pg_, state);

  for (auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;  // frozen: never synced
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
  if (pg_->size() <= 1) return;  // world size 1: no hooks, no buckets, no cost
  sharded_ = options_.shard_optimizer.value_or(parameters_can_be_shared());

  std::vector<size_t> reverse(params_.size());
  std::iota(reverse.rbegin(), reverse.rend(), 0);
  std::vector<ParamInfo> infos;
  for (auto& p : params_) infos.push_back({static_cast<size_t>(p.numel() * p.element_size()), kind_of(p)});
  build_buckets(assign_buckets(infos, reverse,
                               static_cast<size_t>(options_.first_bucket_cap_mb * 1024 * 1024),
                               static_cast<size_t>(options_.bucket_cap_mb * 1024 * 1024)));
  ready_.assign(params_.size(), false);
  if (sharded_) {
    rebuilt_ = true;  // the shards must stay where the optimizer saw them
    build_shards();
  }

  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          mark_ready(i);
          return outputs;
        }));
    grad_accumulators_.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // The hooks capture `this`; drop them with the accumulators we own. Anything still in
  // flight is waited for, so no collective outlives the buffers it writes.
  for (auto& b : buckets_) {
    if (b.complete) {
      try {
        b.complete();
      } catch (...) {
      }
    }
  }
  for (auto& acc : grad_accumulators_) acc->post_hooks().clear();
  for (auto& p : params_) set_gradient_home(p, torch::Tensor());
}

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  if (!hook) fail("register_comm_hook: empty hook");
  if (sharded_) fail("register_comm_hook: not with shard_optimizer (its buckets are reduce-scattered)");
  hook_ = std::move(hook);
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_assignment() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

void DistributedDataParallel::build_buckets(const std::vector<std::vector<size_t>>& assignment) {
  torch::NoGradGuard no_grad;
  std::vector<Bucket> buckets(assignment.size());
  slots_.assign(params_.size(), Slot{});
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.params = assignment[b];
    int64_t total = 0;
    for (size_t p : bucket.params) total += params_[p].numel();
    const auto& first = params_[bucket.params.front()];
    // From the process group: with the shared-memory transport the bucket lives in shared
    // memory and its all-reduce needs no copy in or out.
    bucket.buffer = first.device().is_cpu() ? pg_->alloc_buffer(total, first.scalar_type())
                                            : torch::zeros({total}, first.options().requires_grad(false));
    bucket.buffer.zero_();
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      auto& p = params_[bucket.params[k]];
      auto view = bucket_view(bucket.buffer, offset, p.sizes());
      offset += p.numel();
      // Gradients live in the bucket from now on: keep what was accumulated so far.
      if (p.grad().defined()) view.copy_(p.grad());
      if (p.grad().defined() || !buckets_.empty()) p.mutable_grad() = view;
      // Layers that compute their own weight gradient (models::FusedLinear) write it here
      // directly, so mark_ready finds it in place and copies nothing.
      set_gradient_home(p, view);
      bucket.views.push_back(view);
      slots_[bucket.params[k]] = Slot{b, k};
    }
    bucket.pending = bucket.params.size();
  }
  buckets_ = std::move(buckets);
}

void DistributedDataParallel::mark_ready(size_t param) {
  if (!sync_enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    // Static graph: what was unused in the first step is unused now; ready it at once.
    for (size_t i : static_unused_) {
      if (!ready_[i]) mark_unused_ready(i);
    }
    if (!static_unused_.empty()) launch_ready_buckets();
  }
  if (ready_[param]) return;
  ready_[param] = true;
  if (!rebuilt_) arrival_order_.push_back(param);

  const Slot slot = slots_[param];
  Bucket& bucket = buckets_[slot.bucket];
  auto& p = params_[param];
  auto& view = bucket.views[slot.position];
  // The optimizer may have reset .grad to undefined, or the user replaced it: bring the
  // gradient into the bucket and make .grad the view again.
  if (!is_bucket_view(p.grad(), view)) {
    torch::NoGradGuard no_grad;
    view.copy_(p.grad());
    p.mutable_grad() = view;
  }
  if (--bucket.pending == 0) launch_ready_buckets();
}

void DistributedDataParallel::mark_unused_ready(size_t i) {
  torch::NoGradGuard no_grad;
  const Slot slot = slots_[i];
  Bucket& bucket = buckets_[slot.bucket];
  auto& view = bucket.views[slot.position];
  auto& p = params_[i];
  if (p.grad().defined() && !is_bucket_view(p.grad(), view)) {
    view.copy_(p.grad());
  } else if (!p.grad().defined()) {
    view.zero_();
  }
  p.mutable_grad() = view;
  ready_[i] = true;
  if (!rebuilt_) arrival_order_.push_back(i);
  --bucket.pending;
}

void DistributedDataParallel::launch_ready_buckets() {
  // Strictly in bucket order: collectives must be issued in the same order on every rank.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_];
    if (sharded_ && options_.reduce_scatter_gradients) {
      // Half an all-reduce: this worker only needs the average of its own shard.
      auto work = std::make_shared<distributed::Work>(pg_->reduce_scatter_average(bucket.buffer));
      bucket.complete = [work] { work->wait(); };
    } else {
      GradBucket view{next_bucket_, bucket.buffer, bucket.params, next_bucket_ + 1 == buckets_.size()};
      bucket.complete = hook_(*pg_, view);
    }
    bucket.launched_us = obs::Timeline::instance().enabled() ? obs::Timeline::now_us() : -1;
    ++next_bucket_;
  }
}

void DistributedDataParallel::finalize_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (next_bucket_ < buckets_.size()) {
    std::vector<size_t> missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) missing.push_back(i);
    }
    const bool allowed = options_.find_unused_parameters || (options_.static_graph && !static_known_);
    if (!missing.empty() && !allowed) {
      std::string names;
      for (size_t k = 0; k < missing.size() && k < 20; ++k) names += (k ? ", " : "") + names_[missing[k]];
      if (missing.size() > 20) names += fmt::format(", ... ({} in all)", missing.size());
      reset_iteration();
      fail("rank {}: DistributedDataParallel: {} parameter{} received no gradient in this "
           "backward pass: {}. Set find_unused_parameters to true if parts of the model are "
           "unused in some steps, or freeze them (requires_grad false).",
           pg_->rank(), missing.size(), missing.size() == 1 ? "" : "s", names);
    }
    // Unused here (maybe used on another rank): contribute zeros so the all-reduce matches.
    for (size_t i : missing) mark_unused_ready(i);
    if (options_.static_graph && !static_known_) static_unused_ = missing;
    launch_ready_buckets();
  }
  // The optimizer step needs every bucket: wait for those still in flight (in order).
  const auto wait_start = std::chrono::steady_clock::now();
  {
    obs::Span wait_span("comm wait", "comm");
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      if (bucket.complete) {
        auto complete = std::move(bucket.complete);
        bucket.complete = nullptr;
        complete();
        // The timeline shows each bucket on its own track, from launch (during backward) to
        // when this thread saw it complete, so its overlap with backward is visible.
        if (bucket.launched_us >= 0) {
          const int64_t bytes = bucket.buffer.numel() * static_cast<int64_t>(bucket.buffer.element_size());
          obs::Timeline::instance().record(fmt::format("allreduce bucket {}", b), "comm",
                                           fmt::format("comm bucket {}", b), bucket.launched_us,
                                           obs::Timeline::now_us(),
                                           fmt::format(R"({{"bytes":{},"parameters":{}}})", bytes, bucket.params.size()));
          bucket.launched_us = -1;
        }
      }
    }
  }
  comm_wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  // The optimizer may have reset its tensors' gradients: point them at the averaged shards.
  for (auto& shard : shards_) {
    if (!shard.values.grad().defined() || shard.values.grad().data_ptr() != shard.grad.data_ptr()) {
      shard.values.mutable_grad() = shard.grad;
    }
  }
  const bool rebuild = !rebuilt_;
  if (options_.static_graph) static_known_ = true;
  reset_iteration();
  if (rebuild) rebuild_buckets();
}

void DistributedDataParallel::reset_iteration() {
  callback_queued_ = false;
  next_bucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.complete = nullptr;
  }
}

void DistributedDataParallel::rebuild_buckets() {
  // Rank 0's arrival order, so every rank builds the same buckets.
  torch::Tensor order = torch::empty({static_cast<int64_t>(params_.size())}, torch::kLong);
  if (arrival_order_.size() == params_.size()) {
    for (size_t i = 0; i < arrival_order_.size(); ++i) order[i] = static_cast<int64_t>(arrival_order_[i]);
  } else {
    // Should not happen (finalize marks every parameter); keep the current order.
    int64_t k = 0;
    for (auto& b : buckets_)
      for (size_t p : b.params) order[k++] = static_cast<int64_t>(p);
  }
  std::vector<torch::Tensor> msg{order};
  pg_->broadcast(msg, 0);
  std::vector<size_t> agreed(params_.size());
  auto acc = msg[0].accessor<int64_t, 1>();
  for (size_t i = 0; i < agreed.size(); ++i) agreed[i] = static_cast<size_t>(acc[i]);
  std::vector<ParamInfo> infos;
  for (auto& p : params_) infos.push_back({static_cast<size_t>(p.numel() * p.element_size()), kind_of(p)});
  build_buckets(assign_buckets(infos, agreed,
                               static_cast<size_t>(options_.first_bucket_cap_mb * 1024 * 1024),
                               static_cast<size_t>(options_.bucket_cap_mb * 1024 * 1024)));
  rebuilt_ = true;
  arrival_order_.clear();
}

bool DistributedDataParallel::parameters_can_be_shared() const {
  return pg_->shares_memory() &&
         std::all_of(params_.begin(), params_.end(), [](const torch::Tensor& p) { return p.device().is_cpu(); });
}

void DistributedDataParallel::build_shards() {
  torch::NoGradGuard no_grad;
  shards_.clear();
  // The parameters move into one flat buffer per bucket. On one host, with every parameter on
  // the CPU, that is a single buffer every worker maps: each steps its shard in place and a
  // barrier replaces the all-gather (no copy, and one copy of the parameters per host instead
  // of one per worker). Otherwise each worker's own buffer (shared memory where it can be),
  // which the all-gather fills.
  shared_params_ = parameters_can_be_shared();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    const auto& first = params_[bucket.params.front()];
    const int64_t total = bucket.buffer.numel();
    if (shared_params_) {
      bucket.params_flat = pg_->alloc_shared_buffer(total, first.scalar_type());
    } else {
      bucket.params_flat = first.device().is_cpu() ? pg_->alloc_buffer(total, first.scalar_type())
                                                   : torch::empty({total}, first.options().requires_grad(false));
    }
    const auto [own_begin, own_end] = pg_->shard_range(total, first.scalar_type(), pg_->rank());
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      auto& p = params_[i];
      const int64_t n = p.numel();
      auto values = bucket_view(bucket.params_flat, offset, p.sizes());
      // Shared: the replicas are identical (broadcast above), so one worker's copy is everyone's.
      if (!shared_params_ || pg_->rank() == 0) values.copy_(p.detach());
      p.set_data(values);
      const int64_t lo = std::max(offset, own_begin), hi = std::min(offset + n, own_end);
      if (lo < hi) {
        Shard shard;
        shard.param = i;
        shard.bucket = b;
        shard.begin = lo - offset;
        shard.end = hi - offset;
        shard.values = bucket_view(bucket.params_flat, lo, {hi - lo});
        shard.grad = bucket_view(bucket.buffer, lo, {hi - lo});
        shard.values.mutable_grad() = shard.grad;
        shards_.push_back(std::move(shard));
      }
      offset += n;
    }
  }
  if (shared_params_) pg_->shared_barrier().wait();  // nobody reads before rank 0 has copied
}

std::vector<torch::Tensor> DistributedDataParallel::shard_parameters() const {
  if (!sharded_) return params_;
  std::vector<torch::Tensor> out;
  for (const auto& s : shards_) out.push_back(s.values);
  return out;
}

std::vector<std::string> DistributedDataParallel::shard_names() const {
  if (!sharded_) return names_;
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(fmt::format("{}[{}:{}]", names_[s.param], s.begin, s.end));
  return out;
}

torch::Tensor DistributedDataParallel::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : shard_parameters()) grads.push_back(t.grad());
  return distributed::clip_grad_norm(grads, max_norm, sharded_ ? pg_.get() : nullptr);
}

void DistributedDataParallel::after_step() {
  if (!sharded_) return;
  if (shared_params_) {
    // Every worker stepped its shard of the one shared copy: wait until all have, so that no
    // forward reads a half-updated parameter. (No worker started stepping before all had
    // finished backward: the reduce-scatter of the last bucket needs everyone's gradients.)
    obs::Span span("barrier after step", "comm");
    pg_->shared_barrier().wait();
  } else {
    std::vector<distributed::Work> works;
    obs::Span span("all-gather parameters", "comm");
    for (auto& b : buckets_) works.push_back(pg_->all_gather_shards(b.params_flat));
    for (auto& w : works) w.wait();
  }
  // The step consumed the gradients; the next backward hands its own to the buckets.
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
}

namespace {

// "<shard name>.<field>" -> (shard name, field): shard names end in "]".
std::pair<std::string, std::string> split_state_name(const std::string& name) {
  const auto at = name.rfind("].");
  if (at == std::string::npos) fail("optimizer state '{}' does not name a parameter shard", name);
  return {name.substr(0, at + 1), name.substr(at + 2)};
}

}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> DistributedDataParallel::full_optimizer_state(
    const std::vector<std::pair<std::string, torch::Tensor>>& shard_state) {
  if (!sharded_) return shard_state;
  torch::NoGradGuard no_grad;
  const auto names = shard_names();
  std::map<std::string, size_t> shard_of;
  for (size_t k = 0; k < names.size(); ++k) shard_of[names[k]] = k;
  // field -> (shard -> tensor); the fields every worker has, with their kind and dtype.
  std::map<std::string, std::map<size_t, torch::Tensor>> by_field;
  std::map<std::string, std::string> kinds;  // field -> "e:<dtype>" per element | "s:<dtype>" scalar
  for (const auto& [name, t] : shard_state) {
    auto [shard, field] = split_state_name(name);
    auto it = shard_of.find(shard);
    if (it == shard_of.end()) fail("optimizer state '{}': no such parameter shard on rank {}", name, pg_->rank());
    const bool scalar = t.dim() == 0;
    if (!scalar && t.numel() != shards_[it->second].end - shards_[it->second].begin) {
      fail("optimizer state '{}' has {} elements, its shard {}", name, t.numel(),
           shards_[it->second].end - shards_[it->second].begin);
    }
    by_field[field][it->second] = t;
    kinds[field] = fmt::format("{}:{}", scalar ? "s" : "e", static_cast<int>(t.scalar_type()));
  }
  std::string mine;
  for (const auto& [field, kind] : kinds) mine += field + "=" + kind + "\n";
  std::map<std::string, std::string> all_kinds;
  for (const auto& text : pg_->allgather_strings(mine)) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const auto eq = line.find('=');
      if (eq != std::string::npos) all_kinds[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  std::vector<int64_t> offsets(params_.size() + 1, 0);
  for (size_t i = 0; i < params_.size(); ++i) offsets[i + 1] = offsets[i] + params_[i].numel();
  std::map<size_t, std::vector<std::pair<std::string, torch::Tensor>>> per_param;
  for (const auto& [field, kind] : all_kinds) {
    const bool scalar = kind[0] == 's';
    const auto dtype = static_cast<torch::ScalarType>(std::stoi(kind.substr(2)));
    const auto& mine_of_field = by_field[field];
    // Which parameters have this field anywhere (a worker may hold none of a parameter).
    auto present = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kDouble);
    torch::Tensor values;
    if (scalar) {
      // Taken from the worker whose shard starts the parameter.
      values = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kDouble);
      for (const auto& [k, t] : mine_of_field) {
        present[static_cast<int64_t>(shards_[k].param)] = 1.0;
        if (shards_[k].begin == 0) values[static_cast<int64_t>(shards_[k].param)] = t.item<double>();
      }
    } else {
      values = torch::zeros({offsets.back()}, torch::kFloat);
      for (const auto& [k, t] : mine_of_field) {
        const Shard& s = shards_[k];
        present[static_cast<int64_t>(s.param)] = 1.0;
        values.slice(0, offsets[s.param] + s.begin, offsets[s.param] + s.end).copy_(t.reshape({-1}));
      }
    }
    pg_->allreduce_sum(present).wait();
    pg_->allreduce_sum(values).wait();
    auto seen = present.accessor<double, 1>();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (seen[static_cast<int64_t>(i)] == 0) continue;
      torch::Tensor full = scalar ? values[static_cast<int64_t>(i)].to(dtype).clone()
                                  : values.slice(0, offsets[i], offsets[i + 1]).view(params_[i].sizes()).to(dtype).clone();
      per_param[i].emplace_back(names_[i] + "." + field, std::move(full));
    }
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& [i, entries] : per_param) {
    for (auto& e : entries) out.push_back(std::move(e));
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> DistributedDataParallel::shard_optimizer_state(
    const std::vector<std::pair<std::string, torch::Tensor>>& full_state) const {
  if (!sharded_) return full_state;
  std::map<std::string, size_t> param_of;
  for (size_t i = 0; i < names_.size(); ++i) param_of[names_[i]] = i;
  std::map<size_t, std::vector<std::pair<std::string, torch::Tensor>>> fields;  // param -> (field, full)
  for (const auto& [name, t] : full_state) {
    // "<parameter>.<field>": the longest parameter name that prefixes it.
    const auto dot = name.rfind('.');
    if (dot == std::string::npos) continue;
    auto it = param_of.find(name.substr(0, dot));
    if (it == param_of.end()) continue;  // load_optimizer_state reports what is missing
    fields[it->second].emplace_back(name.substr(dot + 1), t);
  }
  const auto names = shard_names();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t k = 0; k < shards_.size(); ++k) {
    const Shard& s = shards_[k];
    for (const auto& [field, t] : fields[s.param]) {
      if (t.dim() == 0) {
        out.emplace_back(names[k] + "." + field, t);
      } else {
        if (t.numel() != params_[s.param].numel()) {
          fail("optimizer state '{}.{}' has shape {} but the parameter has {}", names_[s.param], field,
               c10::str(t.sizes()), c10::str(params_[s.param].sizes()));
        }
        out.emplace_back(names[k] + "." + field, t.reshape({-1}).slice(0, s.begin, s.end).clone());
      }
    }
  }
  return out;
}

void DistributedDataParallel::pre_forward() {
  if (!options_.broadcast_buffers || pg_->size() <= 1) return;
  auto buffers = module_->buffers();
  if (!buffers.empty()) broadcast_coalesced(*pg_, buffers);
}

}  // namespace replica::ddp
