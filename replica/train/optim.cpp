#include "replica/train/optim.h"

#include "replica/core/error.h"

#include <torch/torch.h>

#include <map>

namespace replica::train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec,
                                                        const std::vector<torch::Tensor>& params) {
  if (spec.name == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(spec.lr).momentum(spec.momentum).weight_decay(spec.weight_decay));
  }
  if (spec.name == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(spec.lr).weight_decay(spec.weight_decay));
  }
  fail("unknown optimizer '{}' (sgd, adamw)", spec.name);
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

namespace {

std::string key_of(const torch::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

}  // namespace

io::NamedTensors optimizer_state(torch::optim::Optimizer& optimizer, const std::string& kind,
                                 const std::vector<torch::Tensor>& params,
                                 const std::vector<std::string>& names) {
  io::NamedTensors out;
  auto& state = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(key_of(params[i]));
    if (it == state.end()) continue;
    const std::string& n = names[i];
    if (kind == "sgd") {
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined()) out.emplace_back(n + ".momentum_buffer", s.momentum_buffer());
    } else if (kind == "adamw") {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      out.emplace_back(n + ".step", torch::tensor(s.step(), torch::kLong));
      out.emplace_back(n + ".exp_avg", s.exp_avg());
      out.emplace_back(n + ".exp_avg_sq", s.exp_avg_sq());
      if (s.max_exp_avg_sq().defined()) out.emplace_back(n + ".max_exp_avg_sq", s.max_exp_avg_sq());
    } else {
      fail("unknown optimizer '{}'", kind);
    }
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& kind,
                          const std::vector<torch::Tensor>& params,
                          const std::vector<std::string>& names, const io::NamedTensors& state) {
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  size_t used = 0;
  auto take = [&](const std::string& name, const torch::Tensor& like) -> torch::Tensor {
    auto it = by_name.find(name);
    if (it == by_name.end()) return {};
    if (like.defined() && it->second.sizes() != like.sizes()) {
      fail("optimizer state '{}' has shape {} but the parameter has {}", name,
           c10::str(it->second.sizes()), c10::str(like.sizes()));
    }
    ++used;
    return it->second.to(like.defined() ? like.options() : it->second.options()).clone();
  };
  auto& slots = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = names[i];
    const auto& p = params[i];
    if (kind == "sgd") {
      auto buf = take(n + ".momentum_buffer", p);
      if (!buf.defined()) continue;
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buf);
      slots[key_of(p)] = std::move(s);
    } else if (kind == "adamw") {
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
    } else {
      fail("unknown optimizer '{}'", kind);
    }
  }
  if (used != state.size()) {
    fail("optimizer state has {} tensors that match no parameter of this model (was it saved "
         "with another optimizer or model?)", state.size() - used);
  }
}

}  // namespace replica::train
