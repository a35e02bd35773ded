#include "replica/train/adafactor.h"

#include "replica/core/error.h"
#include "replica/train/saved_state.h"

#include <torch/torch.h>

#include <cmath>

namespace replica::train {

namespace {

// transformers' Adafactor._rms.
torch::Tensor rms(const torch::Tensor& t) { return t.norm(2) / std::pow(static_cast<double>(t.numel()), 0.5); }

bool factored(const torch::Tensor& p) { return p.dim() >= 2; }

std::vector<int64_t> row_shape(const torch::Tensor& p) {  // shape[:-1]
  auto s = p.sizes().vec();
  s.pop_back();
  return s;
}

std::vector<int64_t> col_shape(const torch::Tensor& p) {  // shape[:-2] + shape[-1:]
  auto s = p.sizes().vec();
  s.erase(s.end() - 2);
  return s;
}

}  // namespace

Adafactor::Adafactor(std::vector<torch::Tensor> params, AdafactorOptions options)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                              std::make_unique<AdafactorOptions>(options)) {}

AdafactorParamState Adafactor::fresh_state(const torch::Tensor& p) {
  AdafactorParamState s;
  const auto options = p.options().dtype(at::isReducedFloatingType(p.scalar_type()) ? torch::kFloat32 : p.scalar_type());
  if (factored(p)) {
    s.exp_avg_sq_row = torch::zeros(row_shape(p), options);
    s.exp_avg_sq_col = torch::zeros(col_shape(p), options);
  } else {
    s.exp_avg_sq = torch::zeros(p.sizes(), options);
  }
  return s;
}

torch::Tensor Adafactor::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const AdafactorOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor grad = p.grad();
      if (at::isReducedFloatingType(grad.scalar_type())) grad = grad.to(torch::kFloat32);
      if (grad.is_sparse()) fail("Adafactor does not support sparse gradients");
      void* const key = p.unsafeGetTensorImpl();
      auto it = state_.find(key);
      if (it == state_.end()) it = state_.emplace(key, std::make_unique<AdafactorParamState>(fresh_state(p))).first;
      auto& s = static_cast<AdafactorParamState&>(*it->second);
      torch::Tensor p32 = at::isReducedFloatingType(p.scalar_type()) ? p.to(torch::kFloat32) : p;
      s.step += 1;
      // _get_lr with relative_step and scale_parameter off: the group's rate.
      const double lr = o.lr();
      const double beta2t = 1.0 - std::pow(static_cast<double>(s.step), o.decay_rate());
      torch::Tensor update = grad.pow(2) + o.eps1();
      if (factored(p)) {
        s.exp_avg_sq_row.mul_(beta2t).add_(update.mean(-1), 1.0 - beta2t);
        s.exp_avg_sq_col.mul_(beta2t).add_(update.mean(-2), 1.0 - beta2t);
        // _approx_sq_grad
        const auto r_factor = (s.exp_avg_sq_row / s.exp_avg_sq_row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
        const auto c_factor = s.exp_avg_sq_col.unsqueeze(-2).rsqrt();
        update = torch::mul(r_factor, c_factor);
        update.mul_(grad);
      } else {
        s.exp_avg_sq.mul_(beta2t).add_(update, 1.0 - beta2t);
        update = s.exp_avg_sq.rsqrt().mul_(grad);
      }
      update.div_((rms(update) / o.clip_threshold()).clamp_(1.0));
      update.mul_(lr);
      if (o.weight_decay() != 0.0) p32.add_(p32, -o.weight_decay() * lr);
      p32.add_(-update);
      if (!p32.is_same(p)) p.copy_(p32);
    }
  }
  return loss;
}

io::NamedTensors adafactor_state(Adafactor& optimizer, const std::vector<torch::Tensor>& params,
                                 const std::vector<std::string>& names) {
  io::NamedTensors out;
  auto& state = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(params[i].unsafeGetTensorImpl());
    if (it == state.end()) continue;
    const auto& s = static_cast<const AdafactorParamState&>(*it->second);
    const std::string& n = names[i];
    out.emplace_back(n + ".step", torch::tensor(s.step, torch::kLong));
    if (s.exp_avg_sq.defined()) {
      out.emplace_back(n + ".exp_avg_sq", s.exp_avg_sq);
    } else {
      out.emplace_back(n + ".exp_avg_sq_row", s.exp_avg_sq_row);
      out.emplace_back(n + ".exp_avg_sq_col", s.exp_avg_sq_col);
    }
  }
  return out;
}

size_t load_adafactor_state(Adafactor& optimizer, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names, const io::NamedTensors& state) {
  SavedOptimizerState saved(state);
  auto take = [&](const std::string& name, const torch::Tensor& like) {
    return saved.take(name, like, SavedOptimizerState::Match::Shape, "adafactor's state for this parameter");
  };
  auto& slots = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = names[i];
    const auto step = take(n + ".step", torch::Tensor());
    if (!step.defined()) continue;
    AdafactorParamState s = Adafactor::fresh_state(params[i]);
    s.step = step.item<int64_t>();
    for (auto [field, t] : {std::pair<const char*, torch::Tensor*>{"exp_avg_sq", &s.exp_avg_sq},
                            {"exp_avg_sq_row", &s.exp_avg_sq_row},
                            {"exp_avg_sq_col", &s.exp_avg_sq_col}}) {
      if (!t->defined()) continue;
      const auto saved = take(n + "." + field, *t);
      if (!saved.defined()) fail("optimizer state for '{}' is incomplete ({} missing)", n, field);
      t->copy_(saved);
    }
    slots[params[i].unsafeGetTensorImpl()] = std::make_unique<AdafactorParamState>(std::move(s));
  }
  return saved.used();
}

int64_t adafactor_state_bytes(Adafactor& optimizer) {
  int64_t bytes = 0;
  for (auto& [key, state] : optimizer.state()) {
    const auto& s = static_cast<const AdafactorParamState&>(*state);
    for (const torch::Tensor* t : {&s.exp_avg_sq, &s.exp_avg_sq_row, &s.exp_avg_sq_col}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

}  // namespace replica::train
