// ZeRO-3 against DDP, with real worker processes started by the launcher.
//
// Each scenario runs on every rank: a ZeRO-3 copy and a DDP copy of the same model train on
// the rank's share of the same global batches with the same optimizer; after the steps the
// ZeRO-3 parameters, gathered, must equal DDP's (max abs difference <= 1e-5, fp32).
#include "replica/core/error.h"
#include "replica/testing/launch_scenario.h"
#include "replica/core/system.h"
#include "replica/ddp/ddp.h"
#include "replica/distributed/process_group.h"
#include "replica/io/safetensors.h"
#include "replica/launch/launcher.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/mlp.h"
#include "replica/zero/checkpoint.h"
#include "replica/zero/zero3.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <unistd.h>

namespace fs = std::filesystem;
using replica::fail;
using replica::zero::Zero3;
using replica::zero::Zero3Options;

using replica::testing::launch_scenario;

namespace {

// Two linear layers whose head reuses the first layer's weight (tied, transposed), plus a
// one-element bias: with 2 workers that group's second shard holds only padding.
struct TiedNetImpl : torch::nn::Module, replica::models::HookedLayers {
  TiedNetImpl() {
    embed = register_module("embed", torch::nn::Linear(torch::nn::LinearOptions(5, 7).bias(false)));
    mid = register_module("mid", torch::nn::Linear(7, 7));
    head_bias = register_parameter("head_bias", torch::zeros({5}));
    scale = register_module("scale", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = run_layer(*embed, [&] { return torch::tanh(embed(x)); });
    h = run_layer(*mid, [&] { return torch::tanh(mid(h)); });
    h = run_layer(*embed, [&] { return torch::linear(h, embed->weight.t(), head_bias); });
    return run_layer(*scale, [&] { return scale(h.unsqueeze(-1)).squeeze(-1); });
  }
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override {
    return {embed.ptr(), mid.ptr(), scale.ptr()};
  }
  torch::nn::Linear embed{nullptr}, mid{nullptr}, scale{nullptr};
  torch::Tensor head_bias;
};
TORCH_MODULE(TiedNet);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<torch::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.05).weight_decay(0.01));
}

// AdamW's moments as "<shard name>.exp_avg" / ".exp_avg_sq" (train/optim.h's names).
replica::io::NamedTensors adam_state(torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params,
                                     const std::vector<std::string>& names) {
  replica::io::NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = opt.state().find(static_cast<void*>(params[i].unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out.emplace_back(names[i] + ".exp_avg", s.exp_avg());
    out.emplace_back(names[i] + ".exp_avg_sq", s.exp_avg_sq());
  }
  return out;
}

double max_abs_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  double worst = 0;
  for (auto& item : pa) {
    const torch::Tensor* other = pb.find(item.key());
    if (!other) fail("parameter {} missing in the reference", item.key());
    worst = std::max(worst, (item.value() - *other).abs().max().item<double>());
  }
  return worst;
}

struct Setup {
  std::function<std::shared_ptr<torch::nn::Module>()> make;
  // Loss of `model` on rows [begin, end) of the global batch of `step`.
  std::function<torch::Tensor(torch::nn::Module&, int step, int64_t begin, int64_t end)> loss;
  int64_t global_batch = 8;
};

// Trains a ZeRO-3 copy and a DDP copy side by side; returns the max abs difference.
double train_both(const Setup& s, std::shared_ptr<replica::distributed::ProcessGroup> pg,
                  const std::string& optimizer, int steps, int accumulation, double max_grad_norm,
                  Zero3Options zopt, std::unique_ptr<Zero3>* keep = nullptr,
                  std::shared_ptr<torch::nn::Module>* zero_model_out = nullptr,
                  std::unique_ptr<torch::optim::Optimizer>* zero_opt_out = nullptr) {
  torch::manual_seed(7);
  auto zero_model = s.make();
  torch::manual_seed(7);
  auto ddp_model = s.make();
  auto zero = std::make_unique<Zero3>(zero_model, pg, zopt);
  replica::ddp::DistributedDataParallel ddp(ddp_model, pg);
  std::vector<torch::Tensor> ddp_params;
  for (auto& p : ddp_model->parameters()) {
    if (p.requires_grad()) ddp_params.push_back(p);
  }
  auto zero_opt = make_optimizer(optimizer, zero->shard_parameters());
  auto ddp_opt = make_optimizer(optimizer, ddp_params);
  const int64_t per_rank = s.global_batch / pg->size();
  const int64_t micro = per_rank / accumulation;
  for (int step = 0; step < steps; ++step) {
    for (auto& p : zero->shard_parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : ddp_params) p.mutable_grad() = torch::Tensor();
    for (int k = 0; k < accumulation; ++k) {
      const int64_t begin = pg->rank() * per_rank + k * micro, end = begin + micro;
      (s.loss(*zero_model, step, begin, end) / accumulation).backward();
      auto ddp_loss = s.loss(*ddp_model, step, begin, end) / accumulation;
      if (k + 1 < accumulation) {
        auto guard = ddp.no_sync();
        ddp_loss.backward();
      } else {
        ddp_loss.backward();
      }
    }
    if (max_grad_norm > 0) {
      const double zn = zero->clip_grad_norm(max_grad_norm).item<double>();
      // PyTorch's norm of the DDP gradients (a max_norm it never reaches scales by exactly 1)...
      const double torch_norm = torch::nn::utils::clip_grad_norm_(ddp_params, 1e30);
      // ...and the clipping replica's DDP does (the trainer's). Not torch's clip_grad_norm_:
      // since LibTorch 2.x it computes the clip coefficient in float32 (1.13: double), an
      // ulp that AdamW magnifies past 1e-5 in 20 steps; both engines share distributed::clip_grad_norm.
      const double dn = ddp.clip_grad_norm(max_grad_norm).item<double>();
      if (std::abs(zn - dn) > 1e-4 * std::max(1.0, dn)) fail("step {}: global norm {} vs DDP {}", step, zn, dn);
      if (std::abs(zn - torch_norm) > 1e-4 * std::max(1.0, torch_norm)) {
        fail("step {}: global norm {} vs PyTorch's {}", step, zn, torch_norm);
      }
    }
    zero_opt->step();
    zero->after_step();
    ddp_opt->step();
  }
  zero->gather_all();
  const double diff = max_abs_diff(*zero_model, *ddp_model);
  if (keep) {
    *keep = std::move(zero);
    if (zero_model_out) *zero_model_out = zero_model;
    if (zero_opt_out) *zero_opt_out = std::move(zero_opt);
  } else {
    zero->release_all();
  }
  return diff;
}

Setup mlp_setup() {
  Setup s;
  // 20 -> 37 -> 29 -> 10: no layer's element count divides by 2 or 3.
  s.make = [] { return replica::models::MLP(20, {37, 29}, 10).ptr(); };
  s.loss = [](torch::nn::Module& m, int step, int64_t begin, int64_t end) {
    torch::manual_seed(1000 + step);
    auto x = torch::randn({8, 20});
    auto y = torch::randint(0, 10, {8});
    auto out = dynamic_cast<replica::models::MLPImpl&>(m).forward(x.slice(0, begin, end));
    return torch::nn::functional::cross_entropy(out, y.slice(0, begin, end));
  };
  return s;
}

Setup llama_setup(bool lora, bool tied) {
  Setup s;
  s.make = [lora, tied] {
    replica::models::LlamaConfig c;
    c.vocab_size = 50;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.tie_word_embeddings = tied;
    auto model = replica::models::LlamaForCausalLM(c);
    if (lora) {
      replica::models::LoraConfig lc;
      lc.r = 4;
      lc.lora_dropout = 0;
      replica::models::apply_lora(*model, lc);
      // LoRA B starts at zero; random B makes the base weights matter for A's gradient.
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters()) {
        if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.02);
      }
    }
    return std::static_pointer_cast<torch::nn::Module>(model.ptr());
  };
  s.loss = [](torch::nn::Module& m, int step, int64_t begin, int64_t end) {
    torch::manual_seed(2000 + step);
    auto ids = torch::randint(0, 50, {8, 12});
    auto rows = ids.slice(0, begin, end);
    auto logits = dynamic_cast<replica::models::LlamaForCausalLMImpl&>(m).forward(rows);
    return replica::models::causal_lm_loss(logits, rows);
  };
  return s;
}

std::shared_ptr<replica::distributed::ProcessGroup> group() {
  auto world = replica::distributed::world_from_env();
  if (!world) fail("not started by a launcher");
  return replica::distributed::init_process_group(*world);
}

void expect_close(double diff, const std::string& what, int rank) {
  if (!(diff <= 1e-5)) fail("rank {}: {}: ZeRO-3 differs from DDP by {} (max abs)", rank, what, diff);
  std::cout << "rank " << rank << " " << what << ": max abs diff " << diff << "\n";
}

Zero3Options sharded_everything() {
  Zero3Options o;
  o.stage3_param_persistence_threshold = 0;  // gather and free every layer, however small
  o.stage3_max_reuse_distance = 0;           // and gather it again for its backward
  return o;
}

int mlp_equals_ddp() {
  auto pg = group();
  expect_close(train_both(mlp_setup(), pg, "adamw", 20, 1, 0, sharded_everything()), "mlp adamw", pg->rank());
  // SGD with momentum, gradient accumulation over 2 micro-batches and global-norm clipping.
  expect_close(train_both(mlp_setup(), pg, "sgd", 20, 2, 0.5, sharded_everything()), "mlp sgd+accum+clip",
               pg->rank());
  // Every layer sharded but kept gathered from its forward to its backward (DeepSpeed's
  // default reuse distance).
  Zero3Options kept;
  kept.stage3_param_persistence_threshold = 0;
  expect_close(train_both(mlp_setup(), pg, "adamw", 20, 2, 1.0, kept), "mlp kept for backward", pg->rank());
  // Defaults: the small layers are persistent (never freed); no prefetch.
  Zero3Options persistent;
  persistent.overlap_comm = false;
  expect_close(train_both(mlp_setup(), pg, "adamw", 20, 1, 1.0, persistent), "mlp persistent", pg->rank());
  return 0;
}

int tied_and_padding() {
  auto pg = group();
  Setup s;
  s.make = [] { return TiedNet().ptr(); };
  s.loss = [](torch::nn::Module& m, int step, int64_t begin, int64_t end) {
    torch::manual_seed(3000 + step);
    auto x = torch::randn({6, 5});
    auto out = dynamic_cast<TiedNetImpl&>(m).forward(x.slice(0, begin, end));
    return (out - x.slice(0, begin, end)).pow(2).mean();
  };
  s.global_batch = 6;
  std::unique_ptr<Zero3> zero;
  std::shared_ptr<torch::nn::Module> model;
  const double diff = train_both(s, pg, "adamw", 20, 1, 0, sharded_everything(), &zero, &model);
  expect_close(diff, "tied weights", pg->rank());
  // The tied weight is one parameter in one group; the one-element scale bias leaves the last
  // worker a shard of padding only.
  int64_t owned = 0;
  for (const auto& g : zero->groups()) {
    const int64_t first = pg->rank() * g.shard;
    owned += std::max<int64_t>(0, std::min(g.numel, first + g.shard) - first);
    if (g.shard * pg->size() < g.numel) fail("group {} is not covered by its shards", g.name);
  }
  bool found_tied = false, found_padding_only = false;
  for (const auto& g : zero->groups()) {
    for (const auto& p : g.params) found_tied |= p.name == "embed.weight";
    found_padding_only |= pg->rank() * g.shard >= g.numel;
  }
  if (!found_tied) fail("embed.weight is in no group");
  if (pg->rank() == pg->size() - 1 && !found_padding_only) fail("the last worker owns no padding-only shard");
  std::cout << "rank " << pg->rank() << " owns " << owned << " elements\n";
  return 0;
}

int llama_equals_ddp() {
  auto pg = group();
  expect_close(train_both(llama_setup(false, true), pg, "adamw", 20, 1, 1.0, sharded_everything()),
               "llama full (tied)", pg->rank());
  expect_close(train_both(llama_setup(true, false), pg, "sgd", 20, 1, 1.0, sharded_everything()),
               "llama lora", pg->rank());
  return 0;
}

// Trains, then every rank writes its shard; rank 0 also writes the DDP reference model.
int save_shards() {
  auto pg = group();
  const std::string dir = replica::env("ZERO_TEST_DIR").value_or("");
  if (dir.empty()) fail("ZERO_TEST_DIR is not set");
  std::unique_ptr<Zero3> zero;
  std::shared_ptr<torch::nn::Module> model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  const double diff = train_both(mlp_setup(), pg, "adamw", 5, 1, 0, sharded_everything(), &zero, &model, &opt);
  expect_close(diff, "mlp before save", pg->rank());
  auto state = adam_state(*opt, zero->shard_parameters(), zero->shard_names());
  replica::zero::save_shards(dir + "/zero", *zero, state);
  if (pg->rank() == 0) {
    replica::io::NamedTensors full;
    for (auto& item : model->named_parameters()) full.emplace_back(item.key(), item.value().detach().clone());
    replica::io::save_safetensors(dir + "/gathered.safetensors", full);
  }
  zero->release_all();
  pg->barrier();
  return 0;
}

}  // namespace

int run_test_worker(const std::string& name) {
  try {
    if (name == "mlp_equals_ddp") return mlp_equals_ddp();
    if (name == "tied_and_padding") return tied_and_padding();
    if (name == "llama_equals_ddp") return llama_equals_ddp();
    if (name == "save_shards") return save_shards();
    std::cerr << "unknown worker scenario " << name << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "worker failed: " << e.what() << "\n";
    return 1;
  }
}

namespace {

double max_abs(const replica::io::NamedTensors& a, const replica::io::NamedTensors& b) {
  std::map<std::string, torch::Tensor> by_name(b.begin(), b.end());
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = by_name.find(name);
    if (it == by_name.end()) fail("tensor {} missing", name);
    if (it->second.sizes() != t.sizes()) fail("tensor {} has another shape", name);
    worst = std::max(worst, (t - it->second).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

TEST(Zero3MultiProcess, MlpWorld2EqualsDdpAfter20Steps) { EXPECT_EQ(launch_scenario("mlp_equals_ddp", 2), 0); }
TEST(Zero3MultiProcess, MlpWorld3EqualsDdpAfter20Steps) { EXPECT_EQ(launch_scenario("mlp_equals_ddp", 3), 0); }
TEST(Zero3MultiProcess, TiedWeightsAndPaddingOnlyShard) { EXPECT_EQ(launch_scenario("tied_and_padding", 2), 0); }
TEST(Zero3MultiProcess, LlamaFullAndLoraWorld2EqualDdp) { EXPECT_EQ(launch_scenario("llama_equals_ddp", 2), 0); }

TEST(Zero3MultiProcess, ShardsConsolidateAndReshard) {
  const fs::path dir = fs::temp_directory_path() / ("replica-zero-test-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  ASSERT_EQ(launch_scenario("save_shards", 2, {{"ZERO_TEST_DIR", dir.string()}}), 0);
  const auto gathered = replica::io::load_safetensors((dir / "gathered.safetensors").string()).tensors;
  const auto full = replica::zero::consolidate((dir / "zero").string());
  EXPECT_EQ(full.size(), gathered.size());
  EXPECT_EQ(max_abs(full, gathered), 0.0);  // consolidation is exact
  EXPECT_EQ(replica::zero::zero_dir_of(dir.string()), (dir / "zero").string());
  EXPECT_EQ(replica::zero::zero_dir_of((dir / "zero").string()), (dir / "zero").string());

  // Re-shard for 1 and 3 workers: the slices, joined, are the same flat contents (and
  // AdamW's moments travel with them); the world-of-one engine gathers the same model.
  for (int world : {1, 3}) {
    std::map<std::string, std::vector<torch::Tensor>> parts;
    for (int r = 0; r < world; ++r) {
      auto slice = replica::zero::load_shards((dir / "zero").string(), r, world);
      EXPECT_EQ(slice.saved_world_size, 2);
      for (auto& [name, t] : slice.masters) parts[name].push_back(t);
      for (auto& [name, t] : slice.optimizer) {
        if (name.find("exp_avg") != std::string::npos) parts[name].push_back(t);
      }
    }
    auto two = replica::zero::load_shards((dir / "zero").string(), 0, 1);
    for (auto& [name, t] : two.masters) {
      auto joined = torch::cat(parts[name]);
      EXPECT_TRUE(joined.narrow(0, 0, t.numel()).equal(t)) << name << " at world " << world;
    }
  }
  torch::manual_seed(0);
  auto model = replica::models::MLP(20, {37, 29}, 10).ptr();
  auto pg = std::make_shared<replica::distributed::ProcessGroup>(replica::distributed::WorldInfo{});
  Zero3 zero(model, pg, sharded_everything());
  auto slice = replica::zero::load_shards((dir / "zero").string(), 0, 1);
  zero.load_shards(slice.masters, "test");
  zero.gather_all();
  replica::io::NamedTensors now;
  for (auto& item : model->named_parameters()) now.emplace_back(item.key(), item.value().detach().clone());
  EXPECT_EQ(max_abs(now, gathered), 0.0);
  EXPECT_EQ(slice.optimizer.size(), 2 * zero.shard_parameters().size());
  zero.release_all();

  EXPECT_THROW(replica::zero::zero_dir_of(dir.string() + "/nowhere"), replica::Error);
  fs::remove(dir / "zero" / "rank-1.safetensors");
  try {
    replica::zero::consolidate((dir / "zero").string());
    ADD_FAILURE() << "a missing rank file was not noticed";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank-1.safetensors"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
