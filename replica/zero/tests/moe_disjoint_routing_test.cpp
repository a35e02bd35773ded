// Mixture of experts under data parallelism when the ranks route to disjoint experts (issue
// 19; Note [experts under data parallelism] in models/moe.h), with real worker processes at
// world 2: a tiny gpt_oss model (2 layers, 4 experts, top-2) whose router sends every token of
// rank 0 to experts {0, 1} and every token of rank 1 to experts {2, 3}.
//
// How the routing is forced: hidden dimension 0 of a token's embedding is +3 for ids below 32
// and -3 for the others (rank 0 draws its batch from ids [0, 32), rank 1 from [32, 64)); nothing
// writes to dimension 0 of the residual stream (row 0 of every o_proj and column 0 of every
// expert's down_proj are zero), and the routers read it with weight +1 for experts 0 and 1 and
// -1 for experts 2 and 3, so the sign decides the top-2 in both layers, by a margin of ~8
// logits against ~0.1 from the other dimensions.
//
// Under DDP (find_unused_parameters off) and under ZeRO-3 (every layer released after its
// forward and gathered again in backward), over the shared-memory transport and over Gloo's
// own collectives, for 3 SGD steps on every rank:
//   - the routing really is disjoint: last_router_scores() of both layers is non-zero exactly
//     at the rank's two experts for every token (and the single-process run on the
//     concatenated batch uses all four);
//   - every expert tensor gets a gradient in every backward on every rank (a hook on each
//     parameter sees it before any reduction), zero in the rows of the experts the rank did not
//     route to and non-zero in the others;
//   - the reduced gradients (DDP: every parameter's; ZeRO-3: every master shard's) equal one
//     process's gradients on the concatenated batch within 1e-6, DDP's bit for bit the same
//     on both ranks, and after the steps the weights equal that process's within 1e-6 and each
//     other bit for bit.
// A hang fails the test instead of stalling CI: collectives time out after 60 s and each
// worker has a 120 s deadline after which it exits 124 (the launcher then stops its peer).
#include "replica/core/error.h"
#include "replica/ddp/ddp.h"
#include "replica/distributed/process_group.h"
#include "replica/models/llama.h"
#include "replica/testing/launch_scenario.h"
#include "replica/testing/worker_scenarios.h"
#include "replica/zero/zero3.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using replica::fail;
using replica::models::LlamaForCausalLM;
using replica::testing::launch_scenario;
using replica::testing::WorkerScenario;

namespace {

using Named = std::map<std::string, torch::Tensor>;
constexpr double kTolerance = 1e-6;
constexpr int kSteps = 3;
constexpr double kLr = 0.05;
constexpr int64_t kVocab = 64, kHidden = 32, kExperts = 4, kLayers = 2;
constexpr int64_t kRowsPerRank = 2, kLength = 8;

// Ends the process (exit 124) when a scenario is not done by its deadline: a deadlock between
// the ranks fails the test rather than hanging it. Not a synchronisation: it only ever waits
// for the scenario to finish.
class Watchdog {
 public:
  Watchdog(std::string what, std::chrono::seconds limit)
      : thread_([this, what = std::move(what), limit] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!done_cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "%s: not finished after %lld s: hung\n", what.c_str(),
                         static_cast<long long>(limit.count()));
            std::fflush(stderr);
            std::_Exit(124);
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

std::shared_ptr<replica::distributed::ProcessGroup> group() {
  auto world = replica::distributed::world_from_env();
  if (!world) fail("not started by a launcher");
  replica::distributed::ProcessGroupOptions options;
  options.rdzv_timeout = std::chrono::seconds(60);
  options.collective_timeout = std::chrono::seconds(60);
  auto pg = replica::distributed::init_process_group(*world, options);
  if (pg->rank() == 0) std::printf("transport %s\n", pg->transport().c_str());
  return pg;
}

replica::models::LlamaConfig moe_config() {
  const nlohmann::json c = {{"model_type", "gpt_oss"},
                            {"architectures", {"GptOssForCausalLM"}},
                            {"vocab_size", kVocab},
                            {"hidden_size", kHidden},
                            {"intermediate_size", 32},
                            {"num_hidden_layers", kLayers},
                            {"num_attention_heads", 4},
                            {"num_key_value_heads", 2},
                            {"head_dim", 8},
                            {"num_local_experts", kExperts},
                            {"num_experts_per_tok", 2},
                            {"sliding_window", 4},
                            {"layer_types", {"sliding_attention", "full_attention"}},
                            {"rope_theta", 150000.0},
                            {"rope_scaling",
                             {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", false},
                              {"original_max_position_embeddings", 16}}},
                            {"max_position_embeddings", 64},
                            {"attention_bias", true},
                            {"tie_word_embeddings", false},
                            {"torch_dtype", "float32"}};
  return replica::models::parse_llama_config(c.dump(), "moe_disjoint_routing config");
}

// The experts rank `rank` routes to: {0, 1} or {2, 3}.
std::vector<int64_t> experts_of(int rank) { return rank == 0 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{2, 3}; }

// The same model on every rank and in the reference: random init, then steered (see the top).
LlamaForCausalLM make_model() {
  torch::manual_seed(17);
  LlamaForCausalLM model(moe_config());
  torch::NoGradGuard no_grad;
  auto p = model->named_parameters();
  auto embed = p["model.embed_tokens.weight"];
  embed.narrow(1, 1, kHidden - 1).normal_(0.0, 0.5);
  embed.narrow(0, 0, kVocab / 2).select(1, 0).fill_(3.0);
  embed.narrow(0, kVocab / 2, kVocab / 2).select(1, 0).fill_(-3.0);
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    p[layer + "self_attn.o_proj.weight"].select(0, 0).zero_();
    p[layer + "self_attn.o_proj.bias"].select(0, 0).zero_();
    p[layer + "mlp.experts.gate_up_proj"].normal_(0.0, 0.2);
    p[layer + "mlp.experts.down_proj"].normal_(0.0, 0.2);
    p[layer + "mlp.experts.down_proj"].select(2, 0).zero_();
    p[layer + "mlp.experts.down_proj_bias"].normal_(0.0, 0.05);
    p[layer + "mlp.experts.down_proj_bias"].select(1, 0).zero_();
    p[layer + "mlp.experts.gate_up_proj_bias"].normal_(0.0, 0.05);
    p[layer + "mlp.router.weight"].select(1, 0).copy_(torch::tensor({1.0f, 1.0f, -1.0f, -1.0f}));
  }
  model->train();
  return model;
}

// Rank `rank`'s rows of step `step`: ids from its own half of the vocabulary.
torch::Tensor batch(int step, int rank) {
  torch::manual_seed(1000 + 10 * step + rank);
  return torch::randint(rank * kVocab / 2, (rank + 1) * kVocab / 2, {kRowsPerRank, kLength}, torch::kLong);
}

torch::Tensor loss_of(LlamaForCausalLM& model, const torch::Tensor& ids) {
  return replica::models::causal_lm_loss(model->forward(ids), ids);
}

replica::models::MoeMlpImpl& moe(LlamaForCausalLM& model, int64_t layer) {
  return *model->model->layers[layer]->as<replica::models::LlamaDecoderLayerImpl>()->moe;
}

// Every token of `rows` [first, last) went exactly to `experts` in every layer.
void expect_routing(LlamaForCausalLM& model, int64_t first_row, int64_t rows, const std::vector<int64_t>& experts,
                    const std::string& what) {
  for (int64_t l = 0; l < kLayers; ++l) {
    auto scores = moe(model, l).last_router_scores().view({-1, kLength, kExperts}).narrow(0, first_row, rows);
    scores = scores.reshape({-1, kExperts});
    for (int64_t e = 0; e < kExperts; ++e) {
      const bool routed = std::find(experts.begin(), experts.end(), e) != experts.end();
      const auto column = scores.select(1, e);
      const bool ok = routed ? (column > 0).all().item<bool>() : (column == 0).all().item<bool>();
      if (!ok) {
        fail("{}: layer {}: expert {} should be chosen by {} token; scores {}", what, l, e, routed ? "every" : "no",
             c10::str(scores));
      }
    }
  }
}

// Hooks on every expert tensor: the gradient autograd computed for it on this rank, before any
// reduction (DDP's and ZeRO-3's own hooks run after these, on the gradient accumulator).
struct LocalExpertGrads {
  std::mutex mutex;
  Named grads;
  void attach(LlamaForCausalLM& model) {
    for (auto& item : model->named_parameters()) {
      if (item.key().find(".mlp.experts.") == std::string::npos) continue;
      const std::string name = item.key();
      item.value().register_hook([this, name](const torch::Tensor& g) {
        std::lock_guard<std::mutex> lock(mutex);
        grads[name] = g.detach().clone();
      });
    }
  }
  // All 4 tensors x 2 layers arrived; rows of the rank's experts non-zero, the others zero.
  void check(const std::vector<int64_t>& own, const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (grads.size() != static_cast<size_t>(4 * kLayers)) {
      fail("{}: {} of {} expert tensors got a gradient on this rank", what, grads.size(), 4 * kLayers);
    }
    for (const auto& [name, g] : grads) {
      if (g.size(0) != kExperts) fail("{}: {} gradient of shape {}", what, name, c10::str(g.sizes()));
      for (int64_t e = 0; e < kExperts; ++e) {
        const bool routed = std::find(own.begin(), own.end(), e) != own.end();
        const double largest = g.select(0, e).abs().max().item<double>();
        if (routed && !(largest > 0)) fail("{}: {} rows of expert {} (routed here) are zero", what, name, e);
        if (!routed && largest != 0) fail("{}: {} rows of expert {} (not routed here) are {}, not zero", what, name, e, largest);
      }
    }
    grads.clear();
  }
};

// The single-process run on the concatenated batch, stepped alongside.
struct Reference {
  LlamaForCausalLM model = make_model();
  Named grads;
  void backward(int step, int world) {
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(batch(step, r));
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    loss_of(model, torch::cat(parts, 0)).backward();
    for (int r = 0; r < world; ++r) expect_routing(model, r * kRowsPerRank, kRowsPerRank, experts_of(r), "reference");
    grads.clear();
    for (auto& item : model->named_parameters()) grads[item.key()] = item.value().grad().clone();
  }
  void step() {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.sub_(p.grad(), kLr);
  }
};

double max_diff(const Named& got, const Named& want, const std::string& what) {
  if (got.size() != want.size()) fail("{}: {} tensors against the reference's {}", what, got.size(), want.size());
  double worst = 0;
  for (const auto& [name, t] : got) {
    auto it = want.find(name);
    if (it == want.end()) fail("{}: {} is not in the reference", what, name);
    if (t.sizes() != it->second.sizes()) fail("{}: {} has shape {}, the reference {}", what, name, c10::str(t.sizes()), c10::str(it->second.sizes()));
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

double largest(const Named& tensors) {
  double out = 0;
  for (const auto& [name, t] : tensors) out = std::max(out, t.abs().max().item<double>());
  return out;
}

void expect_close(const Named& got, const Named& want, const std::string& what, int rank) {
  const double d = max_diff(got, want, what);
  if (!(d <= kTolerance)) fail("rank {}: {}: differs from the single-process run by {} (max abs)", rank, what, d);
  std::printf("rank %d %s: max abs diff vs single process %.3g (largest %.3g)\n", rank, what.c_str(), d, largest(want));
  std::fflush(stdout);
}

// Rank 0's tensors (flattened, concatenated) against this rank's: bit for bit.
void expect_same_on_ranks(const Named& mine, replica::distributed::ProcessGroup& pg, const std::string& what) {
  std::vector<torch::Tensor> flat;
  for (const auto& [name, t] : mine) flat.push_back(t.reshape(-1).to(torch::kFloat32));
  auto all = torch::cat(flat);
  std::vector<torch::Tensor> msg{all.clone()};
  pg.broadcast(msg, 0);
  if (!torch::equal(msg[0], all)) {
    fail("rank {}: {} differ from rank 0's by {}", pg.rank(), what, (msg[0] - all).abs().max().item<double>());
  }
}

Named params_of(LlamaForCausalLM& model) {
  Named out;
  for (auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

int ddp_scenario() {
  Watchdog watchdog("moe_disjoint_ddp", std::chrono::seconds(120));
  auto pg = group();
  const int rank = pg->rank();
  auto model = make_model();
  LocalExpertGrads local;
  local.attach(model);
  replica::ddp::DDPOptions options;
  options.find_unused_parameters = false;  // what a disjoint routing must not need
  replica::ddp::DistributedDataParallel ddp(model.ptr(), pg, options);
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    const std::string what = fmt::format("ddp step {}", step);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    loss_of(model, batch(step, rank)).backward();
    expect_routing(model, 0, kRowsPerRank, experts_of(rank), what);
    local.check(experts_of(rank), what);
    ref.backward(step, pg->size());
    Named grads;
    for (auto& item : model->named_parameters()) {
      if (!item.value().grad().defined()) fail("{}: {} has no gradient after DDP's backward", what, item.key());
      grads[item.key()] = item.value().grad().clone();
    }
    expect_close(grads, ref.grads, what + " averaged gradients", rank);
    expect_same_on_ranks(grads, *pg, what + " averaged gradients");
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ddp.shard_parameters()) p.sub_(p.grad(), kLr);
    }
    ref.step();
  }
  const auto weights = params_of(model);
  expect_close(weights, params_of(ref.model), fmt::format("ddp weights after {} steps", kSteps), rank);
  expect_same_on_ranks(weights, *pg, "ddp weights");
  return 0;
}

int zero3_scenario() {
  Watchdog watchdog("moe_disjoint_zero3", std::chrono::seconds(120));
  auto pg = group();
  const int rank = pg->rank();
  const int64_t world = pg->size();
  auto model = make_model();
  LocalExpertGrads local;
  local.attach(model);
  replica::zero::Zero3Options options;
  options.stage3_param_persistence_threshold = 0;  // every layer's group gathered and freed
  options.stage3_max_reuse_distance = 0;           // freed after its forward, gathered in backward
  replica::zero::Zero3 zero(model.ptr(), pg, options);
  const auto groups = zero.groups();
  const auto shards = zero.shard_parameters();
  const auto names = zero.shard_names();
  // Which group holds the experts: it must be a released (not persistent) one for the test
  // to mean what it says.
  bool experts_released = false;
  for (const auto& g : groups) {
    for (const auto& slot : g.params) {
      if (slot.name.find(".mlp.experts.") != std::string::npos && !g.persistent) experts_released = true;
    }
  }
  if (!experts_released) fail("zero3: the experts are in a persistent group");
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    const std::string what = fmt::format("zero3 step {}", step);
    for (auto& s : shards) s.mutable_grad() = torch::Tensor();
    loss_of(model, batch(step, rank)).backward();
    expect_routing(model, 0, kRowsPerRank, experts_of(rank), what);
    local.check(experts_of(rank), what);
    ref.backward(step, static_cast<int>(world));
    // The reference's gradients laid out as the groups' flat buffers, this rank's slice.
    Named got, want;
    for (const auto& g : groups) {
      if (!g.trainable) continue;
      auto flat = torch::zeros({g.shard * world});
      for (const auto& slot : g.params) {
        const auto& r = ref.grads.at(slot.name);
        flat.narrow(0, slot.offset, r.numel()).copy_(r.reshape(-1));
      }
      want[g.name] = flat.narrow(0, rank * g.shard, g.shard);
    }
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!shards[i].grad().defined()) fail("{}: shard {} got no gradient", what, names[i]);
      got[names[i]] = shards[i].grad().clone();
    }
    expect_close(got, want, what + " shard gradients", rank);
    {
      torch::NoGradGuard no_grad;
      for (auto& s : shards) s.sub_(s.grad(), kLr);
    }
    zero.after_step();
    ref.step();
  }
  zero.gather_all();
  const auto weights = params_of(model);
  zero.release_all();
  expect_close(weights, params_of(ref.model), fmt::format("zero3 weights after {} steps", kSteps), rank);
  expect_same_on_ranks(weights, *pg, "zero3 weights");
  return 0;
}

const WorkerScenario ddp_disjoint("moe_disjoint_ddp", ddp_scenario);
const WorkerScenario zero3_disjoint("moe_disjoint_zero3", zero3_scenario);

}  // namespace

TEST(MoeDisjointRouting, DdpWorld2RanksOnDisjointExpertsMatchSingleProcess) {
  EXPECT_EQ(launch_scenario("moe_disjoint_ddp", 2), 0);
}
TEST(MoeDisjointRouting, Zero3World2RanksOnDisjointExpertsMatchSingleProcess) {
  EXPECT_EQ(launch_scenario("moe_disjoint_zero3", 2), 0);
}
// Without the shared-memory transport: DDP's buckets and ZeRO-3's gathers and reduce-scatters
// through Gloo's own collectives.
TEST(MoeDisjointRouting, DdpAndZero3OverGlooWorld2RanksOnDisjointExpertsMatchSingleProcess) {
  EXPECT_EQ(launch_scenario("moe_disjoint_ddp", 2, {{"REPLICA_TRANSPORT", "gloo"}}), 0);
  EXPECT_EQ(launch_scenario("moe_disjoint_zero3", 2, {{"REPLICA_TRANSPORT", "gloo"}}), 0);
}
