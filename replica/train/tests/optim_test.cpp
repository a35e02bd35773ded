// Optimizer state as named tensors: exporting it from a trained optimizer and loading it into
// a fresh one over a copy of the parameters must make the next step identical.
#include "replica/train/optim.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <set>

using replica::train::OptimizerSpec;

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 4));
    fc2 = register_module("fc2", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Trainable {
  std::shared_ptr<Net> net = std::make_shared<Net>();
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  Trainable() { collect(); }
  void collect() {
    params.clear();
    names.clear();
    for (auto& item : net->named_parameters()) {
      params.push_back(item.value());
      names.push_back(item.key());
    }
  }
  // A deep copy of the parameters (same values, different tensors).
  Trainable copy() const {
    Trainable t;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) t.params[i].copy_(params[i]);
    return t;
  }
};

torch::Tensor batch_x(int i) { return torch::sin(torch::arange(40, torch::kFloat).reshape({8, 5}) * (0.3 + 0.1 * i)); }
torch::Tensor batch_y(int i) { return (torch::arange(8, torch::kLong) + i) % 3; }

void train_step(Trainable& m, torch::optim::Optimizer& opt, int i) {
  opt.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(m.net->forward(batch_x(i)), batch_y(i));
  loss.backward();
  opt.step();
}

void expect_equal_params(const Trainable& a, const Trainable& b) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.params[i], b.params[i]))
        << a.names[i] << " max diff " << (a.params[i] - b.params[i]).abs().max().item<double>();
  }
}

// Trains `steps`, exports, loads into a fresh optimizer over a copy, steps both once more.
void check_round_trip(replica::train::OptimizerKind kind, int steps,
                      const std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<torch::Tensor>&)>& make,
                      const std::vector<std::string>& expected_fields) {
  torch::manual_seed(0);
  Trainable a;
  auto opt_a = make(a.params);
  for (int i = 0; i < steps; ++i) train_step(a, *opt_a, i);

  const auto state = replica::train::optimizer_state(*opt_a, kind, a.params, a.names);
  // Every parameter has every field.
  std::set<std::string> keys;
  for (const auto& [name, t] : state) keys.insert(name);
  for (const auto& n : a.names) {
    for (const auto& f : expected_fields) EXPECT_TRUE(keys.count(n + "." + f)) << n << "." << f;
  }
  EXPECT_EQ(state.size(), a.names.size() * expected_fields.size());

  // Through safetensors, as a checkpoint stores it.
  replica::io::NamedTensors stored;
  for (const auto& [name, t] : state) stored.emplace_back(name, t.clone());

  Trainable b = a.copy();
  expect_equal_params(a, b);
  auto opt_b = make(b.params);
  replica::train::load_optimizer_state(*opt_b, kind, b.params, b.names, stored);

  // The exported state of the restored optimizer is the same as the original's.
  const auto state_b = replica::train::optimizer_state(*opt_b, kind, b.params, b.names);
  ASSERT_EQ(state_b.size(), state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(state_b[i].first, state[i].first);
    EXPECT_TRUE(torch::equal(state_b[i].second, state[i].second)) << state[i].first;
  }

  for (int i = steps; i < steps + 2; ++i) {
    train_step(a, *opt_a, i);
    train_step(b, *opt_b, i);
    expect_equal_params(a, b);
  }

  // Control: a fresh optimizer WITHOUT the state takes a different step, so the check above
  // actually depends on the restored state.
  Trainable c = a.copy();
  auto opt_c = make(c.params);
  train_step(c, *opt_c, 50);
  train_step(a, *opt_a, 50);
  bool differs = false;
  for (size_t i = 0; i < a.params.size(); ++i) differs = differs || !torch::equal(a.params[i], c.params[i]);
  EXPECT_TRUE(differs) << "restoring the state made no difference; the test checks nothing";
}

TEST(OptimizerState, SgdMomentumRoundTrip) {
  OptimizerSpec spec{replica::train::OptimizerKind::Sgd, 0.1, 0.9, 0.01};
  check_round_trip(replica::train::OptimizerKind::Sgd, 3, [&](const auto& p) { return replica::train::make_optimizer(spec, p); },
                   {"momentum_buffer"});
}

TEST(OptimizerState, AdamwRoundTrip) {
  OptimizerSpec spec{replica::train::OptimizerKind::AdamW, 0.01, 0.0, 0.05};
  check_round_trip(replica::train::OptimizerKind::AdamW, 4, [&](const auto& p) { return replica::train::make_optimizer(spec, p); },
                   {"step", "exp_avg", "exp_avg_sq"});
}

TEST(OptimizerState, AdamwAmsgradRoundTrip) {
  check_round_trip(
      replica::train::OptimizerKind::AdamW, 3,
      [](const std::vector<torch::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).amsgrad(true));
      },
      {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"});
}

TEST(OptimizerState, AdamwStepCountIsExported) {
  torch::manual_seed(0);
  Trainable a;
  auto opt = replica::train::make_optimizer({replica::train::OptimizerKind::AdamW, 0.01, 0.0, 0.0}, a.params);
  for (int i = 0; i < 3; ++i) train_step(a, *opt, i);
  for (const auto& [name, t] : replica::train::optimizer_state(*opt, replica::train::OptimizerKind::AdamW, a.params, a.names)) {
    if (name.size() > 5 && name.substr(name.size() - 5) == ".step") EXPECT_EQ(t.item<int64_t>(), 3) << name;
  }
}

TEST(OptimizerState, FreshOptimizerHasNoStateAndLoadsNone) {
  Trainable a;
  auto opt = replica::train::make_optimizer({replica::train::OptimizerKind::Sgd, 0.1, 0.9, 0.0}, a.params);
  const auto state = replica::train::optimizer_state(*opt, replica::train::OptimizerKind::Sgd, a.params, a.names);
  EXPECT_TRUE(state.empty());
  EXPECT_NO_THROW(replica::train::load_optimizer_state(*opt, replica::train::OptimizerKind::Sgd, a.params, a.names, state));
}

replica::io::NamedTensors trained_state(replica::train::OptimizerKind kind, Trainable& a) {
  auto opt = replica::train::make_optimizer({kind, 0.1, 0.9, 0.0}, a.params);
  for (int i = 0; i < 2; ++i) train_step(a, *opt, i);
  auto s = replica::train::optimizer_state(*opt, kind, a.params, a.names);
  for (auto& [n, t] : s) t = t.clone();
  return s;
}

TEST(OptimizerState, ShapeMismatchIsAnError) {
  for (const auto kind : {replica::train::OptimizerKind::Sgd, replica::train::OptimizerKind::AdamW}) {
    SCOPED_TRACE(replica::train::name_of(kind));
    torch::manual_seed(0);
    Trainable a;
    auto state = trained_state(kind, a);
    // Same names, another shape.
    for (auto& [n, t] : state) {
      if (n == "fc1.weight.exp_avg" || n == "fc1.weight.momentum_buffer") t = torch::zeros({3, 3});
    }
    Trainable b;
    auto opt = replica::train::make_optimizer({kind, 0.1, 0.9, 0.0}, b.params);
    try {
      replica::train::load_optimizer_state(*opt, kind, b.params, b.names, state);
      FAIL() << "no error";
    } catch (const replica::Error& e) {
      EXPECT_NE(std::string(e.what()).find("fc1.weight"), std::string::npos) << e.what();
    }
  }
}

TEST(OptimizerState, StateOfAnotherModelIsAnError) {
  torch::manual_seed(0);
  Trainable a;
  auto state = trained_state(replica::train::OptimizerKind::Sgd, a);
  // Another model with a parameter of another shape under the same name.
  struct Wider : torch::nn::Module {
    Wider() {
      register_module("fc1", torch::nn::Linear(6, 4));
      register_module("fc2", torch::nn::Linear(4, 3));
    }
  } wider;
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (auto& item : wider.named_parameters()) {
    params.push_back(item.value());
    names.push_back(item.key());
  }
  auto opt = replica::train::make_optimizer({replica::train::OptimizerKind::Sgd, 0.1, 0.9, 0.0}, params);
  EXPECT_THROW(replica::train::load_optimizer_state(*opt, replica::train::OptimizerKind::Sgd, params, names, state), replica::Error);
}

TEST(OptimizerState, UnknownNamesAreAnError) {
  for (const auto kind : {replica::train::OptimizerKind::Sgd, replica::train::OptimizerKind::AdamW}) {
    SCOPED_TRACE(replica::train::name_of(kind));
    torch::manual_seed(0);
    Trainable a;
    auto state = trained_state(kind, a);
    state.emplace_back("fc9.weight.momentum_buffer", torch::zeros({4, 5}));
    Trainable b;
    auto opt = replica::train::make_optimizer({kind, 0.1, 0.9, 0.0}, b.params);
    EXPECT_THROW(replica::train::load_optimizer_state(*opt, kind, b.params, b.names, state), replica::Error);

    // A renamed parameter: its state matches nothing.
    auto renamed = trained_state(kind, a);
    for (auto& [n, t] : renamed) {
      if (n.rfind("fc2.bias.", 0) == 0) n = "head.bias." + n.substr(9);
    }
    auto opt2 = replica::train::make_optimizer({kind, 0.1, 0.9, 0.0}, b.params);
    EXPECT_THROW(replica::train::load_optimizer_state(*opt2, kind, b.params, b.names, renamed), replica::Error);
  }
}

TEST(OptimizerState, StateOfAnotherOptimizerIsAnError) {
  torch::manual_seed(0);
  Trainable a;
  auto sgd_state = trained_state(replica::train::OptimizerKind::Sgd, a);
  Trainable b;
  auto adamw = replica::train::make_optimizer({replica::train::OptimizerKind::AdamW, 0.1, 0.9, 0.0}, b.params);
  EXPECT_THROW(replica::train::load_optimizer_state(*adamw, replica::train::OptimizerKind::AdamW, b.params, b.names, sgd_state), replica::Error);
  auto adamw_state = trained_state(replica::train::OptimizerKind::AdamW, a);
  auto sgd = replica::train::make_optimizer({replica::train::OptimizerKind::Sgd, 0.1, 0.9, 0.0}, b.params);
  EXPECT_THROW(replica::train::load_optimizer_state(*sgd, replica::train::OptimizerKind::Sgd, b.params, b.names, adamw_state), replica::Error);
}

TEST(OptimizerState, SetLearningRateAppliesToEveryGroup) {
  Trainable a;
  auto opt = replica::train::make_optimizer({replica::train::OptimizerKind::Sgd, 0.1, 0.9, 0.0}, a.params);
  replica::train::set_learning_rate(*opt, 0.025);
  for (auto& g : opt->param_groups()) EXPECT_DOUBLE_EQ(g.options().get_lr(), 0.025);
}

}  // namespace

namespace {

// Parameters of a few shapes (one large enough to be split across threads, one
// non-contiguous, which takes LibTorch's own step) and their gradients for `steps` steps.
struct SgdCase {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]
};

SgdCase sgd_case(int steps) {
  torch::manual_seed(3);
  SgdCase c;
  c.params = {torch::randn({100'003}), torch::randn({7, 5}), torch::randn({6, 4}).t(), torch::randn({1})};
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (const auto& p : c.params) g.push_back(torch::randn(p.sizes()));
    c.grads.push_back(g);
  }
  return c;
}

std::vector<torch::Tensor> run_sgd(torch::optim::Optimizer& opt, std::vector<torch::Tensor> params,
                                   const SgdCase& c) {
  for (const auto& step : c.grads) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = step[i].clone();
    opt.step();
  }
  return params;
}

}  // namespace

// FusedSGD is torch::optim::SGD in one pass: the same parameters and momentum buffers after
// several steps, for every option combination, up to float rounding.
TEST(FusedSGD, MatchesTorchSgd) {
  const SgdCase c = sgd_case(5);
  struct Opt {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const Opt o : {Opt{0.9, 0, 0, false}, Opt{0.9, 0.1, 0.01, false}, Opt{0.8, 0, 0.05, true}, Opt{0, 0, 0.01, false}}) {
    auto options = torch::optim::SGDOptions(0.05).momentum(o.momentum).dampening(o.dampening)
                       .weight_decay(o.weight_decay).nesterov(o.nesterov);
    std::vector<torch::Tensor> a, b;
    for (const auto& p : c.params) {
      a.push_back(p.clone());
      b.push_back(p.clone());
    }
    // The non-contiguous parameter stays non-contiguous in both.
    a[2] = c.params[2].clone().t().contiguous().t();
    b[2] = c.params[2].clone().t().contiguous().t();
    ASSERT_FALSE(a[2].is_contiguous());
    torch::optim::SGD reference(a, options);
    replica::train::FusedSGD fused(b, options);
    run_sgd(reference, a, c);
    run_sgd(fused, b, c);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6))
          << "param " << i << " momentum " << o.momentum << " nesterov " << o.nesterov << " max diff "
          << (a[i] - b[i]).abs().max().item<float>();
    }
    if (o.momentum != 0) {
      for (size_t i = 0; i < a.size(); ++i) {
        auto key = [](const torch::Tensor& t) -> void* { return t.unsafeGetTensorImpl(); };
        const auto& ra = static_cast<torch::optim::SGDParamState&>(*reference.state().at(key(a[i])));
        const auto& rb = static_cast<torch::optim::SGDParamState&>(*fused.state().at(key(b[i])));
        EXPECT_TRUE(torch::allclose(ra.momentum_buffer(), rb.momentum_buffer(), 1e-6, 1e-6)) << "buffer " << i;
      }
    }
  }
}

// Note [master weights]: bf16 parameters are stepped through fp32 copies, so updates far below
// a bf16 ulp accumulate instead of rounding away, and the parameters are those copies rounded.
TEST(MasterWeights, Bf16ParametersStepFp32CopiesAndHoldThemRounded) {
  torch::manual_seed(7);
  auto start = torch::randn({64}) + 4.0f;  // |w| ~ 4: a bf16 ulp there is 2^-5
  auto p32 = start.clone().requires_grad_();
  auto p16 = start.to(torch::kBFloat16).requires_grad_();
  auto ref16 = start.to(torch::kBFloat16).to(torch::kFloat32).requires_grad_();  // fp32 from bf16's values
  const OptimizerSpec spec{replica::train::OptimizerKind::AdamW, 1e-3, 0.0, 0.0};
  auto with_masters = replica::train::make_optimizer(spec, {p16});
  auto reference = replica::train::make_optimizer(spec, {ref16});
  ASSERT_NE(dynamic_cast<replica::train::CopyStepOptimizer*>(with_masters.get()), nullptr);
  EXPECT_EQ(dynamic_cast<replica::train::CopyStepOptimizer*>(reference.get()), nullptr);
  auto plain16 = start.to(torch::kBFloat16).requires_grad_();  // what stepping bf16 in place gives
  torch::optim::AdamW in_place({plain16}, torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
  for (int step = 0; step < 20; ++step) {
    auto g = torch::randn({64});
    p16.mutable_grad() = g.to(torch::kBFloat16);
    ref16.mutable_grad() = g.to(torch::kBFloat16).to(torch::kFloat32);
    plain16.mutable_grad() = g.to(torch::kBFloat16);
    with_masters->step();
    reference->step();
    in_place.step();
  }
  EXPECT_EQ(p16.scalar_type(), torch::kBFloat16);
  // The bf16 parameters are the fp32 run's weights rounded to bf16.
  EXPECT_TRUE(torch::equal(p16, ref16.detach().to(torch::kBFloat16)));
  // 20 steps of ~1e-3 moved the weights by ~0.02, less than one ulp: stepped in bf16 they stay put.
  EXPECT_TRUE(torch::equal(plain16, start.to(torch::kBFloat16)));
  EXPECT_GT((ref16.detach() - start.to(torch::kBFloat16).to(torch::kFloat32)).abs().max().item<double>(), 1e-2);
  // The exported state is the fp32 masters', under the parameter's name.
  const auto state = replica::train::optimizer_state(*with_masters, replica::train::OptimizerKind::AdamW, {p16}, {"w"});
  bool found = false;
  for (const auto& [name, tensor] : state) {
    if (name != "w.exp_avg") continue;
    found = true;
    EXPECT_EQ(tensor.scalar_type(), torch::kFloat32);
  }
  EXPECT_TRUE(found);
}

// The masters go into the optimizer state ("<name>.master", fp32) and come back from it: an
// optimizer made over the checkpoint's bf16 weights continues bit for bit, where one that
// started its masters from those weights (their rounding) would not. Loading also refreshes the
// copies of parameters without saved masters from the loaded weights (they were made before).
TEST(MasterWeights, MastersInTheStateResumeBitForBit) {
  torch::manual_seed(11);
  const auto start = torch::randn({64}) + 4.0f;
  const OptimizerSpec spec{replica::train::OptimizerKind::AdamW, 1e-3, 0.0, 0.01};
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 10; ++i) grads.push_back(torch::randn({64}).to(torch::kBFloat16));
  auto run_steps = [&](torch::optim::Optimizer& o, torch::Tensor& p, int from, int to) {
    for (int i = from; i < to; ++i) {
      p.mutable_grad() = grads[static_cast<size_t>(i)].clone();
      o.step();
    }
  };
  auto straight = start.to(torch::kBFloat16).requires_grad_();
  auto o1 = replica::train::make_optimizer(spec, {straight});
  run_steps(*o1, straight, 0, 10);

  auto first = start.to(torch::kBFloat16).requires_grad_();
  auto o2 = replica::train::make_optimizer(spec, {first});
  run_steps(*o2, first, 0, 5);
  const auto state = replica::train::optimizer_state(*o2, replica::train::OptimizerKind::AdamW, {first}, {"w"});
  torch::Tensor master;
  for (const auto& [name, t] : state) {
    if (name == "w.master") master = t.clone();
  }
  ASSERT_TRUE(master.defined()) << "no w.master in the optimizer state";
  EXPECT_EQ(master.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(master.to(torch::kBFloat16), first.detach()));  // the weights are its rounding
  EXPECT_FALSE(torch::equal(master, first.detach().to(torch::kFloat32)));  // and it holds more
  // A new run: the optimizer is made over the initial weights, then the checkpoint is loaded.
  auto resumed = start.to(torch::kBFloat16).requires_grad_();
  auto o3 = replica::train::make_optimizer(spec, {resumed});
  {
    torch::NoGradGuard no_grad;
    resumed.copy_(first.detach());  // the checkpoint's model weights
  }
  replica::train::load_optimizer_state(*o3, replica::train::OptimizerKind::AdamW, {resumed}, {"w"}, state);
  run_steps(*o3, resumed, 5, 10);
  EXPECT_TRUE(torch::equal(resumed, straight));

  // State without masters (an fp32 run's, or older): the masters start from the loaded weights,
  // not from the weights the optimizer was made over.
  replica::io::NamedTensors without;
  for (const auto& [name, t] : state) {
    if (name != "w.master") without.emplace_back(name, t);
  }
  auto from_weights = start.to(torch::kBFloat16).requires_grad_();
  auto o4 = replica::train::make_optimizer(spec, {from_weights});
  {
    torch::NoGradGuard no_grad;
    from_weights.copy_(first.detach());
  }
  replica::train::load_optimizer_state(*o4, replica::train::OptimizerKind::AdamW, {from_weights}, {"w"}, without);
  auto* copying = dynamic_cast<replica::train::CopyStepOptimizer*>(o4.get());
  ASSERT_NE(copying, nullptr);
  EXPECT_TRUE(torch::equal(copying->copies()[0].detach(), first.detach().to(torch::kFloat32)));

  // Masters of a parameter this run does not hold in bf16 are refused, naming the tensor.
  replica::io::NamedTensors stray = state;
  stray.emplace_back("v.master", torch::zeros({3}));
  auto o5 = replica::train::make_optimizer(spec, {start.to(torch::kBFloat16).requires_grad_()});
  try {
    replica::train::load_optimizer_state(*o5, replica::train::OptimizerKind::AdamW,
                                         {start.to(torch::kBFloat16).requires_grad_()}, {"w"}, stray);
    ADD_FAILURE() << "stray masters were accepted";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'v.master'"), std::string::npos) << e.what();
  }
}
