// Activation checkpointing (models/recompute.h) under the parallel engines, with real worker
// processes at world 2. On every rank a model with checkpointing and the same model without it
// (same seed, same data, same dropout draws) train side by side, each under its own engine;
// after every step (two micro-batches: the first one without communication under DDP's
// no_sync, ZeRO-3 reducing both) the gradients the engine leaves for the optimizer must be the
// same (max abs difference <= 1e-6, fp32), then both take the same SGD step.
//
//   DDP:    Llama full fine-tune and LoRA (dropout 0.1); ResNet-18 with BatchNorm and with
//           SyncBatchNorm, whose running statistics must match too (updated once per forward,
//           not again by the recomputation).
//   ZeRO-3: Llama full (tied embeddings) and LoRA, every layer released after its forward and
//           gathered again for the recomputation in backward (reuse distance 0), and every
//           layer kept gathered from its forward to its backward.
//
// A gradient delivered twice (DDP's "marked ready twice"), a reduction run in a nested
// backward, or a recomputation on released parameters fails these checks or the run.
#include "replica/core/error.h"
#include "replica/ddp/ddp.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/distributed/process_group.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/resnet.h"
#include "replica/testing/launch_scenario.h"
#include "replica/testing/worker_scenarios.h"
#include "replica/zero/zero3.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <map>
#include <set>

using replica::fail;
using replica::testing::launch_scenario;
using replica::testing::WorkerScenario;

namespace {

using Named = std::map<std::string, torch::Tensor>;
constexpr double kTolerance = 1e-6;
constexpr int kSteps = 2;

std::shared_ptr<replica::distributed::ProcessGroup> group() {
  auto world = replica::distributed::world_from_env();
  if (!world) fail("not started by a launcher");
  return replica::distributed::init_process_group(*world);
}

double max_diff(const Named& a, const Named& b, const std::string& what) {
  if (a.size() != b.size() || a.empty()) fail("{}: {} tensors against {}", what, a.size(), b.size());
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) fail("{}: {} missing without checkpointing", what, name);
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

void expect_same(const Named& with, const Named& without, const std::string& what, int rank) {
  const double d = max_diff(with, without, what);
  if (!(d <= kTolerance)) fail("rank {}: {}: with checkpointing differs by {} (max abs)", rank, what, d);
  double largest = 0;
  for (const auto& [name, t] : without) largest = std::max(largest, t.abs().max().item<double>());
  if (!(largest > 0)) fail("rank {}: {}: all zero, nothing compared", rank, what);
  std::cout << "rank " << rank << " " << what << ": max abs diff " << d << " (largest " << largest << ")\n";
}

// Recompute nodes in the graph behind `loss`: one per checkpointed layer, none without.
int recompute_nodes(const torch::Tensor& loss) {
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int found = 0;
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (node->name().find("RecomputeBackward") != std::string::npos) ++found;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return found;
}

void expect_recompute_nodes(const torch::Tensor& loss, bool checkpointing, int expected, const std::string& what) {
  const int n = recompute_nodes(loss);
  if (n != (checkpointing ? expected : 0)) {
    fail("{}: {} recompute nodes in the graph {} checkpointing", what, n, checkpointing ? "with" : "without");
  }
}

// A model, its checkpointing switch, and the loss of rows [begin, end) of a step's global batch.
struct Setup {
  std::function<std::shared_ptr<torch::nn::Module>(bool checkpointing)> make;
  std::function<torch::Tensor(torch::nn::Module&, int step, int micro, int64_t begin, int64_t end)> loss;
  int64_t global_batch = 4;  // rows per micro-batch, over all ranks
  int checkpointed_layers = 0;  // recompute nodes per forward with checkpointing
};

Setup llama_setup(bool lora, bool tied) {
  Setup s;
  s.checkpointed_layers = 3;
  s.make = [lora, tied](bool checkpointing) {
    replica::models::LlamaConfig c;
    c.vocab_size = 50;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.tie_word_embeddings = tied;
    torch::manual_seed(7);
    auto model = replica::models::LlamaForCausalLM(c);
    if (lora) {
      replica::models::LoraConfig lc;
      lc.r = 4;
      lc.lora_dropout = 0.1;  // the recomputation must draw the same masks
      replica::models::apply_lora(*model, lc);
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters()) {
        if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
      }
    }
    model->model->set_gradient_checkpointing(checkpointing);
    model->train();
    return std::static_pointer_cast<torch::nn::Module>(model.ptr());
  };
  s.loss = [](torch::nn::Module& m, int step, int micro, int64_t begin, int64_t end) {
    torch::manual_seed(2000 + 10 * step + micro);
    auto ids = torch::randint(0, 50, {4, 12});
    // Two packed samples per row, as llm-sft's rows.
    auto segments = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, torch::kLong).repeat({4, 1});
    auto rows = ids.slice(0, begin, end), seg = segments.slice(0, begin, end);
    torch::manual_seed(3000 + 10 * step + micro);  // the dropout draws, the same with and without
    auto logits = dynamic_cast<replica::models::LlamaForCausalLMImpl&>(m).forward(rows, {}, seg);
    return replica::models::causal_lm_loss(logits, rows, seg);
  };
  return s;
}

Setup resnet_setup(std::shared_ptr<replica::distributed::ProcessGroup> sync_bn) {
  Setup s;
  s.checkpointed_layers = 4;  // the four stages
  s.global_batch = 8;         // 4 images per rank: BatchNorm's batch statistics over more than 2
  s.make = [sync_bn](bool checkpointing) {
    replica::models::ResNetOptions o;
    if (sync_bn) {
      o.norm_layer = [sync_bn](int64_t c) { return torch::nn::AnyModule(replica::ddp::SyncBatchNorm2d(c, sync_bn)); };
    }
    torch::manual_seed(5);
    auto model = replica::models::ResNet18(o);
    model->set_gradient_checkpointing(checkpointing);
    model->train();
    return std::static_pointer_cast<torch::nn::Module>(model.ptr());
  };
  s.loss = [](torch::nn::Module& m, int step, int micro, int64_t begin, int64_t end) {
    torch::manual_seed(4000 + 10 * step + micro);
    auto x = torch::randn({8, 1, 28, 28});
    auto y = torch::randint(0, 10, {8});
    auto out = dynamic_cast<replica::models::ResNet18Impl&>(m).forward(x.slice(0, begin, end));
    return torch::nn::functional::cross_entropy(out, y.slice(0, begin, end));
  };
  return s;
}

Named grads_of(torch::nn::Module& m) {
  Named out;
  for (auto& item : m.named_parameters()) {
    if (item.value().requires_grad()) {
      const auto& g = item.value().grad();
      out[item.key()] = g.defined() ? g.clone() : torch::zeros_like(item.value());
    }
  }
  return out;
}

Named buffers_of(torch::nn::Module& m) {
  Named out;
  for (auto& item : m.named_buffers()) out[item.key()] = item.value().clone();
  return out;
}

void sgd_step(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.sub_(p.grad(), 0.01);
  }
}

int ddp_scenario(const Setup& s, const std::string& what, std::shared_ptr<replica::distributed::ProcessGroup> pg) {
  auto with_model = s.make(true), without_model = s.make(false);
  replica::ddp::DistributedDataParallel with(with_model, pg), without(without_model, pg);
  const int64_t per_rank = s.global_batch / pg->size();
  const int64_t begin = pg->rank() * per_rank, end = begin + per_rank;
  for (int step = 0; step < kSteps; ++step) {
    for (auto* ddp : {&with, &without}) {
      for (auto& p : ddp->module().parameters()) p.mutable_grad() = torch::Tensor();
      for (int micro = 0; micro < 2; ++micro) {
        ddp->pre_forward();
        auto loss = s.loss(ddp->module(), step, micro, begin, end) / 2;
        expect_recompute_nodes(loss, ddp == &with, s.checkpointed_layers, what);
        if (micro == 0) {
          auto guard = ddp->no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
    }
    expect_same(grads_of(*with_model), grads_of(*without_model), fmt::format("ddp {} step {} gradients", what, step),
                pg->rank());
    if (!with_model->buffers().empty()) {
      expect_same(buffers_of(*with_model), buffers_of(*without_model), fmt::format("ddp {} step {} buffers", what, step),
                  pg->rank());
    }
    sgd_step(with.shard_parameters());
    sgd_step(without.shard_parameters());
  }
  return 0;
}

int zero3_scenario(const Setup& s, const std::string& what, std::shared_ptr<replica::distributed::ProcessGroup> pg,
                   replica::zero::Zero3Options options) {
  auto with_model = s.make(true), without_model = s.make(false);
  replica::zero::Zero3 with(with_model, pg, options), without(without_model, pg, options);
  const int64_t per_rank = s.global_batch / pg->size();
  const int64_t begin = pg->rank() * per_rank, end = begin + per_rank;
  auto shard_grads = [](replica::zero::Zero3& z) {
    Named out;
    const auto params = z.shard_parameters();
    const auto names = z.shard_names();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].grad().defined()) fail("ZeRO-3 shard {} got no gradient", names[i]);
      out[names[i]] = params[i].grad().clone();
    }
    return out;
  };
  for (int step = 0; step < kSteps; ++step) {
    for (auto [zero, model] : {std::pair{&with, with_model}, std::pair{&without, without_model}}) {
      for (auto& p : zero->shard_parameters()) p.mutable_grad() = torch::Tensor();
      for (int micro = 0; micro < 2; ++micro) {
        auto loss = s.loss(*model, step, micro, begin, end) / 2;
        expect_recompute_nodes(loss, zero == &with, s.checkpointed_layers, what);
        loss.backward();
      }
    }
    expect_same(shard_grads(with), shard_grads(without), fmt::format("zero3 {} step {} shard gradients", what, step),
                pg->rank());
    for (auto* zero : {&with, &without}) {
      sgd_step(zero->shard_parameters());
      zero->after_step();
    }
  }
  with.release_all();
  without.release_all();
  return 0;
}

const WorkerScenario ddp_llama("recompute_ddp_llama", [] {
  auto pg = group();
  ddp_scenario(llama_setup(false, false), "llama full", pg);
  return ddp_scenario(llama_setup(true, false), "llama lora", pg);
});

const WorkerScenario ddp_resnet("recompute_ddp_resnet", [] {
  auto pg = group();
  ddp_scenario(resnet_setup(nullptr), "resnet18 batchnorm", pg);
  return ddp_scenario(resnet_setup(pg), "resnet18 sync-batchnorm", pg);
});

const WorkerScenario zero3_llama("recompute_zero3_llama", [] {
  auto pg = group();
  replica::zero::Zero3Options released;
  released.stage3_param_persistence_threshold = 0;  // every layer sharded, gathered and freed
  released.stage3_max_reuse_distance = 0;           // freed after its forward, gathered again
  replica::zero::Zero3Options kept;
  kept.stage3_param_persistence_threshold = 0;      // sharded, kept from forward to backward
  zero3_scenario(llama_setup(false, true), "llama full (tied), released", pg, released);
  zero3_scenario(llama_setup(true, false), "llama lora, released", pg, released);
  zero3_scenario(llama_setup(false, true), "llama full (tied), kept", pg, kept);
  return zero3_scenario(llama_setup(true, false), "llama lora, kept", pg, kept);
});

}  // namespace

TEST(RecomputeMultiProcess, DdpLlamaFullAndLoraWorld2GradientsEqualWithout) {
  EXPECT_EQ(launch_scenario("recompute_ddp_llama", 2), 0);
}
TEST(RecomputeMultiProcess, DdpResnetBatchNormAndSyncBatchNormWorld2EqualWithout) {
  EXPECT_EQ(launch_scenario("recompute_ddp_resnet", 2), 0);
}
TEST(RecomputeMultiProcess, Zero3LlamaFullAndLoraWorld2GradientsEqualWithout) {
  EXPECT_EQ(launch_scenario("recompute_zero3_llama", 2), 0);
}
