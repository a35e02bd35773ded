// Activation checkpointing (models/recompute.h) changes memory, not numbers: a Llama with every
// decoder layer recomputed in backward gives the gradients of the same model without it, for a
// full fine-tune, for LoRA with dropout (the recomputation draws the same masks), with packed
// segments, and under bf16 autocast; and the RNG stream the run continues with is the same.
// A ResNet-18 with every stage recomputed gives the same gradients and leaves BatchNorm's
// running statistics as the run without it (updated once per forward, not again in backward).
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/resnet.h"
#include "replica/models/tests/test_util.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>
#include <string>

using namespace replica::models;
using replica::models::testing::for_each_bf16_gemm_path;

namespace {

LlamaConfig tiny_config() {
  return parse_llama_config(R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5})",
                            "tiny config");
}

struct Pass {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
  double next_draw = 0;  // the global RNG after backward
};

// One forward and backward of a fresh model (seed 7) on fixed data, with or without
// checkpointing; `lora`: adapters with dropout 0.3, only they train; `bf16`: under autocast.
Pass run(bool checkpointing, bool lora, bool bf16, bool packed) {
  torch::manual_seed(7);
  LlamaForCausalLM model(tiny_config());
  if (lora) {
    LoraConfig c;
    c.r = 4;
    c.lora_dropout = 0.3;
    c.target_modules = {"all-linear"};
    apply_lora(*model, c);
    // lora_B starts at zero (PEFT): give it values, so that A's gradients are not all zero.
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.1);
    }
  }
  model->model->set_gradient_checkpointing(checkpointing);
  model->train();
  torch::manual_seed(11);
  auto ids = torch::randint(0, 50, {2, 12}, torch::kLong);
  torch::Tensor segments;
  if (packed) segments = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, torch::kLong).repeat({2, 1});
  at::autocast::set_autocast_enabled(at::kCPU, bf16);
  if (bf16) at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  auto logits = model->forward(ids, {}, segments);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  if (bf16) at::autocast::clear_cache();
  auto loss = causal_lm_loss(logits, ids, segments);
  loss.backward();
  Pass r;
  r.loss = loss.item<double>();
  for (auto& item : model->named_parameters()) {
    if (item.value().grad().defined()) r.grads[item.key()] = item.value().grad().clone();
  }
  r.next_draw = torch::rand({1}).item<double>();
  return r;
}

void expect_same(const Pass& a, const Pass& b, double tolerance) {
  EXPECT_DOUBLE_EQ(a.loss, b.loss);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  ASSERT_FALSE(a.grads.empty());
  for (const auto& [name, g] : a.grads) {
    ASSERT_TRUE(b.grads.count(name)) << name;
    EXPECT_LE((g - b.grads.at(name)).abs().max().item<double>(), tolerance) << name;
  }
  EXPECT_EQ(a.next_draw, b.next_draw) << "the RNG stream after backward differs";
}

TEST(Recompute, FullFineTuneGradientsAreThoseWithoutIt) {
  expect_same(run(true, false, false, false), run(false, false, false, false), 1e-6);
}

TEST(Recompute, LoraWithDropoutDrawsTheSameMasks) {
  const Pass with = run(true, true, false, false);
  expect_same(with, run(false, true, false, false), 1e-6);
  for (const auto& [name, g] : with.grads) EXPECT_NE(name.find("lora_"), std::string::npos) << name << " trains";
}

TEST(Recompute, PackedSegmentsAndBf16Autocast) {
  expect_same(run(true, false, false, true), run(false, false, false, true), 1e-6);
  for_each_bf16_gemm_path([] { expect_same(run(true, true, true, true), run(false, true, true, true), 1e-6); });
}

// Two SGD steps of a bf16-autocast LoRA model, the trainer's way (autocast on for the forward
// only, its cache cleared after it): the second step's loss and gradients.
Pass two_bf16_lora_steps(bool checkpointing) {
  torch::manual_seed(7);
  LlamaForCausalLM model(tiny_config());
  LoraConfig c;
  c.r = 4;
  c.target_modules = {"all-linear"};
  apply_lora(*model, c);
  model->model->set_gradient_checkpointing(checkpointing);
  model->train();
  auto ids = torch::randint(0, 50, {2, 12}, torch::kLong);
  Pass r;
  for (int step = 0; step < 2; ++step) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto logits = model->forward(ids);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    auto loss = causal_lm_loss(logits, ids);
    loss.backward();
    r.loss = loss.item<double>();
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (!item.value().grad().defined()) continue;
      if (step == 1) r.grads[item.key()] = item.value().grad().clone();
      item.value().sub_(item.value().grad() * 0.5);
      item.value().grad().zero_();
    }
  }
  return r;
}

// Note [the recomputation clears autocast's cast cache]: the recomputation in step 1's backward
// must not leave bf16 copies of the adapters for step 2's forward, on either bf16 GEMM path
// (ATen's casts through autocast's cache; the fp32-through path casts explicitly). Failed before
// the fix on the ATen path: step 2 computed with step 1's adapters.
TEST(Recompute, UnderBf16AutocastTheNextStepComputesWithTheUpdatedWeights) {
  for_each_bf16_gemm_path([] {
    const Pass with = two_bf16_lora_steps(true);
    const Pass without = two_bf16_lora_steps(false);
    EXPECT_DOUBLE_EQ(with.loss, without.loss);
    ASSERT_EQ(with.grads.size(), without.grads.size());
    for (const auto& [name, g] : with.grads) {
      EXPECT_LE((g - without.grads.at(name)).abs().max().item<double>(), 1e-6) << name;
    }
  });
}

// The graph holds one recompute node per decoder layer, and none without checkpointing.
int recompute_nodes(bool checkpointing) {
  torch::manual_seed(7);
  LlamaForCausalLM model(tiny_config());
  model->model->set_gradient_checkpointing(checkpointing);
  auto logits = model->forward(torch::randint(0, 50, {1, 5}, torch::kLong));
  std::vector<torch::autograd::Node*> todo{logits.grad_fn().get()};
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

TEST(Recompute, OneNodePerDecoderLayer) {
  EXPECT_EQ(recompute_nodes(true), 3);
  EXPECT_EQ(recompute_nodes(false), 0);
}

TEST(Recompute, NothingIsRecordedWithoutGrad) {
  torch::manual_seed(7);
  LlamaForCausalLM model(tiny_config());
  model->model->set_gradient_checkpointing(true);
  torch::NoGradGuard no_grad;
  auto logits = model->forward(torch::randint(0, 50, {1, 5}, torch::kLong));
  EXPECT_FALSE(logits.requires_grad());
}

// Two training steps' forward and backward (no optimizer step, gradients accumulate) of a
// fresh ResNet-18 in train mode; the parameters' gradients and every buffer afterwards.
struct ResnetPass {
  std::map<std::string, torch::Tensor> grads, buffers;
  double next_draw = 0;
};

ResnetPass run_resnet(bool checkpointing) {
  torch::manual_seed(5);
  ResNet18 model(ResNetOptions{});
  model->set_gradient_checkpointing(checkpointing);
  model->train();
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({6, 1, 28, 28});
    auto y = torch::randint(0, 10, {6});
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
  }
  ResnetPass r;
  for (auto& item : model->named_parameters()) r.grads[item.key()] = item.value().grad().clone();
  for (auto& item : model->named_buffers()) r.buffers[item.key()] = item.value().clone();
  r.next_draw = torch::rand({1}).item<double>();
  return r;
}

TEST(Recompute, ResnetStagesGiveTheSameGradientsAndRunningStats) {
  const ResnetPass with = run_resnet(true), without = run_resnet(false);
  ASSERT_EQ(with.grads.size(), without.grads.size());
  for (const auto& [name, g] : without.grads) {
    EXPECT_LE((with.grads.at(name) - g).abs().max().item<double>(), 1e-6) << name;
  }
  ASSERT_EQ(with.buffers.size(), without.buffers.size());
  ASSERT_GT(without.buffers.count("layer3.1.bn2.running_var"), 0u);
  for (const auto& [name, b] : without.buffers) {
    if (b.scalar_type() == torch::kLong) {
      EXPECT_TRUE(with.buffers.at(name).equal(b)) << name << ": " << with.buffers.at(name).item<int64_t>()
                                                  << " batches tracked, not " << b.item<int64_t>();
    } else {
      EXPECT_LE((with.buffers.at(name) - b).abs().max().item<double>(), 1e-6) << name;
    }
  }
  EXPECT_EQ(without.buffers.at("layer4.1.bn2.num_batches_tracked").item<int64_t>(), 2);
  EXPECT_EQ(with.next_draw, without.next_draw);
}

// One recompute node per stage; without grad a plain forward.
TEST(Recompute, OneNodePerResnetStage) {
  torch::manual_seed(5);
  ResNet18 model(ResNetOptions{});
  model->set_gradient_checkpointing(true);
  auto out = model->forward(torch::randn({2, 1, 28, 28}));
  std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int found = 0;
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (node->name().find("RecomputeBackward") != std::string::npos) ++found;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  EXPECT_EQ(found, 4);
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(model->forward(torch::randn({2, 1, 28, 28})).requires_grad());
}

}  // namespace
