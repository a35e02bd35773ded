#include "replica/train/optim.h"

#include "replica/core/error.h"
#include "replica/core/file_tensor.h"
#include "replica/core/files.h"
#include "replica/train/adafactor.h"
#include "replica/train/optim_8bit.h"
#include "replica/train/saved_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <optional>

namespace replica::train {

namespace {

// One pass of SGD over [begin, end) (the semantics of torch::optim::SGD::step for one
// parameter). Each variant is its own branch-free loop, so that the compiler vectorizes it;
// noinline keeps the __restrict promises, which GCC loses when it inlines the loop into the
// parallel_for lambda (and then leaves it scalar).
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
__attribute__((noinline)) void sgd_loop(float* __restrict p, const float* __restrict g, float* __restrict b, int64_t begin, int64_t end,
              float lr, float weight_decay, float momentum, float keep) {
  for (int64_t i = begin; i < end; ++i) {
    float d = g[i];
    if constexpr (kDecay) d += weight_decay * p[i];
    if constexpr (kMomentum) {
      float buf;
      if constexpr (kFirst) {
        buf = d;  // the buffer starts as the gradient
      } else {
        buf = momentum * b[i] + keep * d;
      }
      b[i] = buf;
      if constexpr (kNesterov) {
        d += momentum * buf;
      } else {
        d = buf;
      }
    }
    p[i] -= lr * d;
  }
}

template <bool kDecay, bool kMomentum, bool kFirst>
void sgd_loop(bool nesterov, float* p, const float* g, float* b, int64_t begin, int64_t end, float lr,
              float weight_decay, float momentum, float keep) {
  if (nesterov) return sgd_loop<kDecay, kMomentum, kFirst, true>(p, g, b, begin, end, lr, weight_decay, momentum, keep);
  sgd_loop<kDecay, kMomentum, kFirst, false>(p, g, b, begin, end, lr, weight_decay, momentum, keep);
}

template <bool kDecay>
void sgd_loop(bool momentum_on, bool first, bool nesterov, float* p, const float* g, float* b, int64_t begin,
              int64_t end, float lr, float weight_decay, float momentum, float keep) {
  if (!momentum_on) return sgd_loop<kDecay, false, false, false>(p, g, b, begin, end, lr, weight_decay, momentum, keep);
  if (first) return sgd_loop<kDecay, true, true>(nesterov, p, g, b, begin, end, lr, weight_decay, momentum, keep);
  sgd_loop<kDecay, true, false>(nesterov, p, g, b, begin, end, lr, weight_decay, momentum, keep);
}

// `first`: no momentum buffer yet. Chunks run on the intra-op threads.
void fused_sgd_update(float* p, const float* g, float* b, int64_t n, float lr, float weight_decay, float momentum,
                      float dampening, bool nesterov, bool first) {
  const float keep = 1.0f - dampening;
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    if (weight_decay != 0.0f) {
      sgd_loop<true>(momentum != 0.0f, first, nesterov, p, g, b, begin, end, lr, weight_decay, momentum, keep);
    } else {
      sgd_loop<false>(momentum != 0.0f, first, nesterov, p, g, b, begin, end, lr, weight_decay, momentum, keep);
    }
  });
}

// The closure's loss (undefined without one), evaluated with gradients on, as LibTorch's own
// optimizers run it before their step.
torch::Tensor closure_loss(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

torch::Tensor FusedSGD::step(LossClosure closure) {
  const torch::Tensor loss = closure_loss(closure);
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    const auto lr = static_cast<float>(options.lr());
    const auto weight_decay = static_cast<float>(options.weight_decay());
    const auto momentum = static_cast<float>(options.momentum());
    const auto dampening = static_cast<float>(options.dampening());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const torch::Tensor& g = p.grad();
      void* const key = p.unsafeGetTensorImpl();  // LibTorch keys optimizer state by TensorImpl
      auto it = state_.find(key);
      const bool first = it == state_.end();
      torch::Tensor buf;
      if (!first) buf = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
      const bool fusable = p.scalar_type() == torch::kFloat && g.scalar_type() == torch::kFloat &&
                           p.is_contiguous() && g.is_contiguous() && g.numel() == p.numel() && !g.is_sparse() &&
                           p.device().is_cpu() && g.device().is_cpu() &&
                           (momentum == 0.0f || first ||
                            (buf.defined() && buf.scalar_type() == torch::kFloat && buf.is_contiguous() &&
                             buf.numel() == p.numel()));
      if (!fusable) {
        // LibTorch's own step for this parameter (torch::optim::SGD::step's body).
        auto d_p = g;
        if (weight_decay != 0) d_p = d_p.add(p, weight_decay);
        if (momentum != 0) {
          if (first) {
            buf = state_zeros(p).copy_(d_p);
            auto state = std::make_unique<torch::optim::SGDParamState>();
            state->momentum_buffer(buf);
            state_[key] = std::move(state);
          } else {
            buf.mul_(momentum).add_(d_p, 1 - dampening);
          }
          d_p = options.nesterov() ? d_p.add(buf, momentum) : buf;
        }
        p.add_(d_p, -1 * options.lr());
        continue;
      }
      if (momentum != 0.0f && first) {
        buf = state_zeros(p);
        auto state = std::make_unique<torch::optim::SGDParamState>();
        state->momentum_buffer(buf);
        state_[key] = std::move(state);
      }
      fused_sgd_update(p.data_ptr<float>(), g.data_ptr<float>(), momentum != 0.0f ? buf.data_ptr<float>() : nullptr,
                       p.numel(), lr, weight_decay, momentum, dampening, options.nesterov(), first);
    }
  }
  return loss;
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  const torch::Tensor loss = closure_loss(closure);
  torch::NoGradGuard no_grad;
  // LibTorch's step for all parameters (the closure has run already).
  const auto unfused_step = [this, &loss] {
    torch::optim::AdamW::step(nullptr);
    return loss;
  };
  // First pass: create missing state as torch::optim::AdamW::step does, and check that every
  // parameter with a gradient can go through the fused kernel.
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      const torch::Tensor& g = p.grad();
      if (!g.defined()) continue;
      const bool plain = !g.is_sparse() && g.scalar_type() == p.scalar_type() && g.device() == p.device() &&
                         p.is_contiguous() && g.is_contiguous() && at::isFloatingType(p.scalar_type()) &&
                         (p.device().is_cpu() || p.device().is_cuda());
      if (!plain) return unfused_step();
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) {
        auto state = std::make_unique<torch::optim::AdamWParamState>();
        state->step(0);
        state->exp_avg(state_zeros(p));
        state->exp_avg_sq(state_zeros(p));
        if (options.amsgrad()) state->max_exp_avg_sq(state_zeros(p));
        state_[p.unsafeGetTensorImpl()] = std::move(state);
        continue;
      }
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      for (const torch::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()}) {
        if (t == &s.max_exp_avg_sq() && !options.amsgrad()) continue;
        if (!t->defined() || t->scalar_type() != p.scalar_type() || t->device() != p.device() ||
            !t->is_contiguous() || t->sizes() != p.sizes()) {
          return unfused_step();
        }
      }
    }
  }
  // Second pass: one fused call per group and (device, dtype), as PyTorch groups them.
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    struct Lists {
      std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
      std::vector<float> step_counts;
    };
    std::map<std::pair<std::string, int>, Lists> by_kind;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& s = static_cast<torch::optim::AdamWParamState&>(*state_.at(p.unsafeGetTensorImpl()));
      s.step(s.step() + 1);
      auto& l = by_kind[{p.device().str(), static_cast<int>(p.scalar_type())}];
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.exp_avgs.push_back(s.exp_avg());
      l.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (options.amsgrad()) l.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      l.step_counts.push_back(static_cast<float>(s.step()));
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& [kind, l] : by_kind) {
      // The kernel reads the step counts (for the bias corrections) from float32 tensors on the
      // parameters' device, as PyTorch's fused AdamW keeps them: here views of one tensor, made
      // on a GPU by one copy from pinned memory rather than a fill kernel per parameter.
      const auto device = l.params.front().device();
      auto counts = torch::from_blob(l.step_counts.data(), {static_cast<int64_t>(l.step_counts.size())},
                                     torch::kFloat32);
      if (device.is_cuda()) counts = counts.pin_memory().to(device, /*non_blocking=*/true);
      else counts = counts.clone();
      for (int64_t i = 0; i < counts.size(0); ++i) l.steps.push_back(counts[i]);
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps, options.lr(), beta1,
                        beta2, options.weight_decay(), options.eps(), options.amsgrad(), /*maximize=*/false);
    }
  }
  return loss;
}

torch::Tensor StateHome::state_zeros(const torch::Tensor& param) const {
  if (allocate_) return allocate_(param);
  return torch::zeros_like(param, torch::MemoryFormat::Contiguous);
}

torch::Tensor StateHome::state_zeros(at::IntArrayRef sizes, const at::TensorOptions& options) const {
  // The allocators read only the shape and dtype of the tensor they are given.
  if (allocate_) return allocate_(torch::empty(sizes, options.device(torch::kMeta)));
  return torch::zeros(sizes, options);
}

// Note [optimizer offload]
// offload_optimizer_device says where the optimizer's state lives and where its step runs:
//   none  with the parameters it steps (a GPU's memory, or RAM for CPU training);
//   cpu   in host RAM, the step on the host: for parameters on a GPU, pinned host copies of
//         them (fp32 like the parameters), their gradients copied down after backward and
//         the stepped values copied back (CopyStepOptimizer). For CPU training the state
//         is in host RAM already: nothing moves.
//   nvme  as cpu, with every state tensor (AdamW's exp_avg and exp_avg_sq, SGD's momentum)
//         a memory-mapped file under nvme_path (replica/core/file_tensor.h), so state larger
//         than RAM pages to disk instead of failing.
// The arithmetic is the same fused kernel on the same values in every case, so an offloaded
// run's weights equal the in-memory run's (bit for bit on the CPU).
//
// Note [master weights]
// Parameters held in bf16 or fp16 (a model computing in bf16 throughout, as FSDP2's
// MixedPrecisionPolicy(param_dtype=bf16) and DeepSpeed's bf16 mode run it) are not stepped in
// their own dtype: an update smaller than half a bf16 ulp of the weight (lr 1e-5 on a weight of
// 1 is 1/400 of one) would round away. The optimizer steps fp32 copies of them instead, beside
// the parameters (or in pinned host memory when offloaded), its state fp32 too: each step
// casts the gradients up, steps the copies and rounds them back into the parameters (the same
// CopyStepOptimizer as offload). fp32 parameters are stepped in place as before. The exported
// state (optimizer_state) is the fp32 masters' exp_avg / exp_avg_sq and the masters themselves,
// as "<name>.master" (fp32): loading state puts them back (state without them starts them from
// the loaded weights), so a resumed run continues bit for bit. The trainer's full fine-tuning
// with torch_dtype: bfloat16 takes this path (llm_sft.cpp, Note [bf16 weights]), as do the
// benchmark's --dtype bf16-weights and the C++ API's bf16 models; ZeRO-3 steps its own fp32
// master shards instead (its parameters for the optimizer are those shards).
namespace {
bool is_low_precision(const torch::Tensor& p) {
  return p.scalar_type() == torch::kBFloat16 || p.scalar_type() == torch::kHalf;
}
// "<parameter name>.master": a bf16/fp16 parameter's fp32 master in the optimizer state.
constexpr const char* kMasterField = ".master";
}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec,
                                                        const std::vector<torch::Tensor>& params) {
  const bool on_gpu = std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return !p.device().is_cpu(); });
  const bool host_step = spec.offload != OffloadDevice::None && on_gpu;
  const bool masters = std::any_of(params.begin(), params.end(), is_low_precision);
  std::vector<torch::Tensor> copies;
  if (host_step || masters) {
    // The copies the optimizer steps (Note [optimizer offload], Note [master weights]): in
    // pinned host memory when offloaded, else beside the parameters; fp32 for bf16/fp16 ones.
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      auto options = p.options().dtype(is_low_precision(p) ? torch::kFloat32 : p.scalar_type());
      auto c = host_step ? torch::empty(p.sizes(), options.device(torch::kCPU).pinned_memory(true))
                         : torch::empty(p.sizes(), options);
      c.copy_(p.detach());
      c.set_requires_grad(true);
      copies.push_back(c);
    }
  }
  const std::vector<torch::Tensor>& stepped = host_step || masters ? copies : params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  StateHome* home = nullptr;
  if (spec.kind == OptimizerKind::Sgd) {
    auto o = std::make_unique<FusedSGD>(
        stepped, torch::optim::SGDOptions(spec.lr).momentum(spec.momentum).weight_decay(spec.weight_decay));
    home = o.get();
    optimizer = std::move(o);
  } else if (spec.kind == OptimizerKind::AdamW8bit || spec.kind == OptimizerKind::PagedAdamW8bit) {
    auto o = std::make_unique<AdamW8bit>(
        stepped, AdamW8bitOptions(spec.lr).weight_decay(spec.weight_decay).paged(spec.kind == OptimizerKind::PagedAdamW8bit));
    home = o.get();
    optimizer = std::move(o);
  } else if (spec.kind == OptimizerKind::Adafactor) {
    optimizer = std::make_unique<Adafactor>(stepped, AdafactorOptions(spec.lr).weight_decay(spec.weight_decay));
  } else {
    auto o = std::make_unique<FusedAdamW>(stepped, torch::optim::AdamWOptions(spec.lr).weight_decay(spec.weight_decay));
    home = o.get();
    optimizer = std::move(o);
  }
  if (spec.offload == OffloadDevice::Nvme) {
    if (spec.nvme_path.empty()) fail("offload nvme needs nvme_path (a directory for the swap files)");
    if (home == nullptr) fail("offload nvme: optimizer {} keeps no per-element state to put in files", name_of(spec.kind));
    home->set_state_allocator([dir = spec.nvme_path](const torch::Tensor& p) {
      return file_backed_zeros(dir, p.sizes(), p.scalar_type());
    });
  }
  if (!host_step && !masters) return optimizer;
  return std::make_unique<CopyStepOptimizer>(params, std::move(copies), std::move(optimizer));
}

CopyStepOptimizer::CopyStepOptimizer(std::vector<torch::Tensor> params, std::vector<torch::Tensor> copies,
                                     std::unique_ptr<torch::optim::Optimizer> inner)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)}, inner->defaults().clone()),
      params_(std::move(params)), copies_(std::move(copies)), inner_(std::move(inner)) {}

torch::Tensor CopyStepOptimizer::step(LossClosure closure) {
  const torch::Tensor loss = closure_loss(closure);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& g = params_[i].grad();
    if (!g.defined()) {
      copies_[i].mutable_grad() = torch::Tensor();
      continue;
    }
    if (!copies_[i].grad().defined()) copies_[i].mutable_grad() = torch::empty_like(copies_[i]);
    copies_[i].mutable_grad().copy_(g);  // the step reads it next (to the host: a blocking copy)
  }
  inner_->step();
  // From pinned memory (or the device), ordered before the next kernel on the stream; the copy
  // is not written again before the next step's blocking gradient copy.
  for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(copies_[i], /*non_blocking=*/true);
  return loss;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
  if (auto* copying = dynamic_cast<CopyStepOptimizer*>(&optimizer)) set_learning_rate(copying->inner(), lr);
}

namespace {

// LibTorch keys an optimizer's per-parameter state by the parameter's TensorImpl.
void* key_of(const torch::Tensor& p) { return p.unsafeGetTensorImpl(); }

}  // namespace

io::NamedTensors optimizer_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                                 const std::vector<torch::Tensor>& params,
                                 const std::vector<std::string>& names) {
  if (auto* copying = dynamic_cast<CopyStepOptimizer*>(&optimizer)) {
    io::NamedTensors out = optimizer_state(copying->inner(), kind, copying->copies(), names);
    // The fp32 masters of bf16/fp16 parameters (Note [master weights]): a resumed run continues
    // from them, not from their rounding. Copies of fp32 parameters equal them: not saved.
    for (size_t i = 0; i < params.size(); ++i) {
      if (is_low_precision(params[i])) out.emplace_back(names[i] + kMasterField, copying->copies()[i]);
    }
    return out;
  }
  if (auto* eight = dynamic_cast<AdamW8bit*>(&optimizer)) return adamw_8bit_state(*eight, params, names);
  if (auto* factor = dynamic_cast<Adafactor*>(&optimizer)) return adafactor_state(*factor, params, names);
  io::NamedTensors out;
  auto& state = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(key_of(params[i]));
    if (it == state.end()) continue;
    const std::string& n = names[i];
    if (kind == OptimizerKind::Sgd) {
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined()) out.emplace_back(n + ".momentum_buffer", s.momentum_buffer());
    } else {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      out.emplace_back(n + ".step", torch::tensor(s.step(), torch::kLong));
      out.emplace_back(n + ".exp_avg", s.exp_avg());
      out.emplace_back(n + ".exp_avg_sq", s.exp_avg_sq());
      if (s.max_exp_avg_sq().defined()) out.emplace_back(n + ".max_exp_avg_sq", s.max_exp_avg_sq());
    }
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                          const std::vector<torch::Tensor>& params,
                          const std::vector<std::string>& names, const io::NamedTensors& state) {
  if (auto* copying = dynamic_cast<CopyStepOptimizer*>(&optimizer)) {
    // The copies were made as the optimizer was, before the checkpoint's weights were loaded:
    // from those weights now, and the fp32 masters over them where the checkpoint has them.
    torch::NoGradGuard no_grad;
    io::NamedTensors inner_state;
    std::map<std::string, torch::Tensor> masters;
    for (const auto& [name, t] : state) {
      if (ends_with(name, kMasterField)) masters.emplace(name, t);
      else inner_state.emplace_back(name, t);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& copy = copying->copies()[i];
      copy.copy_(params[i]);
      auto it = masters.find(names[i] + kMasterField);
      if (it == masters.end()) continue;
      if (it->second.sizes() != copy.sizes()) {
        fail("optimizer state '{}' has shape {} but the parameter has {}", it->first, c10::str(it->second.sizes()),
             c10::str(copy.sizes()));
      }
      copy.copy_(it->second);
      masters.erase(it);
    }
    if (!masters.empty()) {
      fail("optimizer state '{}' holds master weights of no bf16/fp16 parameter of this run (was it saved with "
           "another torch_dtype or model?)",
           masters.begin()->first);
    }
    return load_optimizer_state(copying->inner(), kind, copying->copies(), names, inner_state);
  }
  // The optimizers with loaders of their own: what they took.
  std::optional<size_t> own;
  if (auto* eight = dynamic_cast<AdamW8bit*>(&optimizer)) own = load_adamw_8bit_state(*eight, params, names, state);
  if (auto* factor = dynamic_cast<Adafactor*>(&optimizer)) own = load_adafactor_state(*factor, params, names, state);
  if (own) {
    if (*own != state.size()) {
      fail("optimizer state has {} tensors that match no parameter of this model or this optimizer (was it saved "
           "with another optimizer or model?)", state.size() - *own);
    }
    return;
  }
  const auto* home = dynamic_cast<const StateHome*>(&optimizer);
  SavedOptimizerState saved(state);
  auto take = [&](const std::string& name, const torch::Tensor& like) -> torch::Tensor {
    const torch::Tensor t = saved.take(name, like);
    if (!t.defined()) return t;
    // State tensors land where the optimizer allocates them (nvme: in files).
    if (like.defined() && home) return home->state_zeros(like).copy_(t);
    return t.to(like.defined() ? like.options() : t.options()).clone();
  };
  auto& slots = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = names[i];
    const auto& p = params[i];
    if (kind == OptimizerKind::Sgd) {
      auto buf = take(n + ".momentum_buffer", p);
      if (!buf.defined()) continue;
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buf);
      slots[key_of(p)] = std::move(s);
    } else {
      auto step = take(n + ".step", torch::Tensor());
      if (!step.defined()) continue;
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step.item<int64_t>());
      s->exp_avg(take(n + ".exp_avg", p));
      s->exp_avg_sq(take(n + ".exp_avg_sq", p));
      if (!s->exp_avg().defined() || !s->exp_avg_sq().defined()) {
        fail("optimizer state for '{}' is incomplete (exp_avg/exp_avg_sq missing)", n);
      }
      auto m = take(n + ".max_exp_avg_sq", p);
      if (m.defined()) s->max_exp_avg_sq(m);
      slots[key_of(p)] = std::move(s);
    }
  }
  if (saved.used() != saved.size()) {
    fail("optimizer state has {} tensors that match no parameter of this model (was it saved "
         "with another optimizer or model?)", saved.size() - saved.used());
  }
}

int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  if (auto* copying = dynamic_cast<CopyStepOptimizer*>(&optimizer)) return optimizer_state_bytes(copying->inner());
  if (auto* eight = dynamic_cast<AdamW8bit*>(&optimizer)) return adamw_8bit_state_bytes(*eight);
  if (auto* factor = dynamic_cast<Adafactor*>(&optimizer)) return adafactor_state_bytes(*factor);
  int64_t bytes = 0;
  for (auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      for (const torch::Tensor* t : {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()}) {
        if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
      }
    } else if (auto* m = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      if (m->momentum_buffer().defined()) bytes += m->momentum_buffer().numel() * static_cast<int64_t>(m->momentum_buffer().element_size());
    }
  }
  return bytes;
}

}  // namespace replica::train
