// Packed rows without a mask (models/varlen_attention.h, Note [packed attention]): the layout
// from host segment ids; the decision; the loop over segments (the varlen path's CPU fallback)
// against the [B, 1, T, T] mask path, outputs and input gradients, fp32 and bf16, grouped
// key/value heads, padding on either side, one-token segments, a row of one segment; a Llama's
// logits and gradients on both paths (also sliding windows, recomputed layers, bf16 autocast);
// and the token-id check (Note [token ids checked on the host]). The flash kernel's own test
// is varlen_attention_gpu_test.cpp.
#include "replica/core/error.h"
#include "replica/models/llama.h"
#include "replica/models/varlen_attention.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace replica::models;

namespace {

// The largest difference relative to the reference's largest magnitude.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

struct ModeGuard {
  PackedAttentionMode was;
  explicit ModeGuard(PackedAttentionMode mode) : was(set_packed_attention_mode(mode)) {}
  ~ModeGuard() { set_packed_attention_mode(was); }
};

// Three rows of 16: left padding, then segments of 5, 1 (one token) and 7; segments of 10 and
// 1, then right padding; one segment over the whole row.
torch::Tensor segment_rows() {
  std::vector<int64_t> r0 = {-1, -1, -1, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2};
  std::vector<int64_t> r1 = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, -1, -1, -1, -1, -1};
  std::vector<int64_t> r2(16, 0);
  std::vector<int64_t> all;
  for (const auto* r : {&r0, &r1, &r2}) all.insert(all.end(), r->begin(), r->end());
  return torch::tensor(all, torch::kInt64).view({3, 16});
}

// The block-diagonal causal mask the model builds from segment ids: [B, 1, T, T].
torch::Tensor mask_of(const torch::Tensor& segments) {
  const int64_t T = segments.size(1);
  auto idx = torch::arange(T);
  auto same = segments.unsqueeze(2) == segments.unsqueeze(1);
  return (idx.view({T, 1}) >= idx.view({1, T})).unsqueeze(0).logical_and(same).unsqueeze(1);
}

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

// Attention of q [B, H, T, D], k, v [B, Hkv, T, D] on one path, with the gradient of
// sum(out * dy) in q, k and v.
Grads attend(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0, const torch::Tensor& segments,
             const torch::Tensor& dy, bool varlen) {
  auto q = q0.detach().requires_grad_(), k = k0.detach().requires_grad_(), v = v0.detach().requires_grad_();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  torch::Tensor out;
  if (varlen) {
    const auto layout = packed_layout(segments, q.device());
    auto stream = [&](const torch::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), D}); };
    out = varlen_attention(stream(q), stream(k), stream(v), layout, scale, PackedAttention::kSegmentLoop)
              .view({B, T, H, D})
              .transpose(1, 2);
  } else {
    out = at::scaled_dot_product_attention(q, k, v, mask_of(segments), 0.0, false, scale, H != k.size(1));
  }
  (out.to(torch::kFloat32) * dy).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

constexpr const char* kTinyLlama = R"({"model_type": "llama", "vocab_size": 97, "hidden_size": 64,
  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 64})";

// Mistral's sliding window on every layer, narrower than the rows.
constexpr const char* kSlidingLlama = R"({"model_type": "mistral", "vocab_size": 97, "hidden_size": 64,
  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "sliding_window": 6})";

// Whether autograd's graph behind t has a node named `name`: which path the forward took (the
// loop splits q, k and v by segment; the mask path never splits).
bool graph_has(const torch::Tensor& t, const std::string& name) {
  std::vector<torch::autograd::Node*> stack{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name() == name) return true;
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  return false;
}

struct ModelRun {
  torch::Tensor logits;
  std::map<std::string, torch::Tensor> grads;
};

ModelRun run_model(LlamaForCausalLM& model, const torch::Tensor& ids, const torch::Tensor& segments,
                   const BatchFacts& facts = {}) {
  model->zero_grad();
  auto logits = model->forward(ids, {}, segments, facts);
  // The loop where it was forced and the layer allows it (not the sliding layers); a
  // recomputed layer's own graph is made in the backward, out of sight here.
  const bool loop = packed_attention_mode() != PackedAttentionMode::kMask && !model->config().sliding_window &&
                    !model->model->gradient_checkpointing();
  EXPECT_EQ(graph_has(logits, "SplitWithSizesBackward0"), loop) << to_string(packed_attention_mode());
  (logits.to(torch::kFloat32) * torch::linspace(-1, 1, logits.numel()).view(logits.sizes())).sum().backward();
  ModelRun r{logits.detach().to(torch::kFloat32), {}};
  for (const auto& p : model->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  return r;
}

void expect_equal_runs(const ModelRun& a, const ModelRun& b, double tol) {
  EXPECT_LT(rel_diff(a.logits, b.logits), tol) << "logits";
  for (const auto& [name, g] : a.grads) EXPECT_LT(rel_diff(g, b.grads.at(name)), tol) << name;
}

}  // namespace

TEST(VarlenAttention, LayoutCountsRunsWithinRowsOnTheHost) {
  const auto layout = packed_layout(segment_rows(), torch::kCPU);
  // Row 0: pads 0..2, 3..7, 8, 9..15; row 1: 16..25, 26, 27..31; row 2: 32..47.
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 3, 8, 9, 16, 26, 27, 32, 48}));
  EXPECT_EQ(layout.segments(), 8);
  EXPECT_EQ(layout.max_seqlen, 16);
  ASSERT_TRUE(layout.defined());
  EXPECT_EQ(layout.cu_seqlens.scalar_type(), torch::kInt32);
  EXPECT_EQ(layout.cu_seqlens.to(torch::kInt64).equal(torch::tensor(layout.offsets)), true);
  // Equal ids in consecutive rows are two segments; int32 ids are taken too.
  const auto two = packed_layout(torch::zeros({2, 3}, torch::kInt32), torch::kCPU);
  EXPECT_EQ(two.offsets, (std::vector<int64_t>{0, 3, 6}));
  EXPECT_THROW(packed_layout(torch::zeros({6}), torch::kCPU), replica::Error);
}

TEST(VarlenAttention, DecisionKeepsTheMaskForSlidingSinksDropoutAndCudaWithoutFlash) {
  using M = PackedAttentionMode;
  using P = PackedAttention;
  PackedAttentionCall cpu;
  PackedAttentionCall gpu;
  gpu.cuda = gpu.flash_takes = true;
  PackedAttentionCall gpu_fp32 = gpu;
  gpu_fp32.flash_takes = false;
  // auto: the flash kernel where it takes the call; the loop on the CPU; else the mask.
  EXPECT_EQ(choose_packed_attention(cpu, M::kAuto), P::kSegmentLoop);
  EXPECT_EQ(choose_packed_attention(gpu, M::kAuto), P::kFlashVarlen);
  EXPECT_EQ(choose_packed_attention(gpu_fp32, M::kAuto), P::kMask);
  // varlen: the loop where the flash kernel does not take it.
  EXPECT_EQ(choose_packed_attention(cpu, M::kVarlen), P::kSegmentLoop);
  EXPECT_EQ(choose_packed_attention(gpu, M::kVarlen), P::kFlashVarlen);
  EXPECT_EQ(choose_packed_attention(gpu_fp32, M::kVarlen), P::kSegmentLoop);
  // mask: always.
  EXPECT_EQ(choose_packed_attention(gpu, M::kMask), P::kMask);
  EXPECT_EQ(choose_packed_attention(cpu, M::kMask), P::kMask);
  // Sliding windows, sinks and dropout keep the mask in every mode, on every device.
  for (const M mode : {M::kAuto, M::kVarlen, M::kMask}) {
    for (PackedAttentionCall base : {cpu, gpu}) {
      SCOPED_TRACE(std::string(to_string(mode)) + (base.cuda ? " cuda" : " cpu"));
      auto sliding = base, sinks = base, dropout = base;
      sliding.sliding = true;
      sinks.sinks = true;
      dropout.dropout = 0.1;
      EXPECT_EQ(choose_packed_attention(sliding, mode), P::kMask);
      EXPECT_EQ(choose_packed_attention(sinks, mode), P::kMask);
      EXPECT_EQ(choose_packed_attention(dropout, mode), P::kMask);
    }
  }
  // CPU tensors never take the flash kernel.
  auto q = torch::randn({1, 4, 8, 16}, torch::kBFloat16);
  EXPECT_FALSE(flash_varlen_takes(q, q, q, 0.25));
  // The switch is the process's until set back.
  {
    ModeGuard g(M::kMask);
    EXPECT_EQ(packed_attention_mode(), M::kMask);
  }
  EXPECT_STREQ(to_string(M::kVarlen), "varlen");
}

TEST(VarlenAttention, SegmentLoopEqualsTheMaskInFp32AndBf16WithGroupedHeads) {
  torch::manual_seed(7);
  const auto segments = segment_rows();
  for (const int64_t kv_heads : {int64_t{4}, int64_t{2}, int64_t{1}}) {
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE("kv_heads " + std::to_string(kv_heads) + " " + c10::toString(dtype));
      auto q = torch::randn({3, 4, 16, 32}).to(dtype);
      auto k = torch::randn({3, kv_heads, 16, 32}).to(dtype);
      auto v = torch::randn({3, kv_heads, 16, 32}).to(dtype);
      auto dy = torch::randn({3, 4, 16, 32});
      const auto mask = attend(q, k, v, segments, dy, /*varlen=*/false);
      const auto loop = attend(q, k, v, segments, dy, /*varlen=*/true);
      // fp32: float rounding; bf16: both round q k^T's softmax and the product to bf16, in
      // different blocks: within a couple of bf16 ulps (2^-8 relative each).
      const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
      EXPECT_LT(rel_diff(loop.out, mask.out), tol) << "output";
      EXPECT_LT(rel_diff(loop.dq, mask.dq), tol) << "dq";
      EXPECT_LT(rel_diff(loop.dk, mask.dk), tol) << "dk";
      EXPECT_LT(rel_diff(loop.dv, mask.dv), tol) << "dv";
      EXPECT_EQ(loop.out.scalar_type(), dtype);
    }
  }
}

TEST(VarlenAttention, ALlamaOnPackedRowsComputesTheSameOnBothPaths) {
  torch::manual_seed(3);
  auto ids = torch::randint(0, 97, {3, 16});
  const auto segments = segment_rows();
  for (const char* json : {kTinyLlama, kSlidingLlama}) {
    SCOPED_TRACE(json == kTinyLlama ? "llama, grouped heads" : "mistral, sliding window 6");
    LlamaForCausalLM model(parse_llama_config(json, "tiny"));
    ModelRun masked, looped, given;
    {
      ModeGuard g(PackedAttentionMode::kMask);
      masked = run_model(model, ids, segments);
    }
    {
      ModeGuard g(PackedAttentionMode::kVarlen);
      looped = run_model(model, ids, segments);
      // The layout from the caller's host copy instead of the model's own.
      given = run_model(model, ids, segments, host_batch_facts(ids, segments, 97, torch::kCPU, "test input_ids"));
    }
    ModelRun automatic;
    {
      ModeGuard g(PackedAttentionMode::kAuto);  // the CPU's default: the loop
      automatic = run_model(model, ids, segments);
    }
    expect_equal_runs(looped, masked, 1e-5);
    expect_equal_runs(given, looped, 1e-12);
    expect_equal_runs(automatic, looped, 1e-12);
  }
}

TEST(VarlenAttention, RecomputedLayersAndBf16AutocastOnBothPaths) {
  torch::manual_seed(4);
  auto ids = torch::randint(0, 97, {3, 16});
  const auto segments = segment_rows();
  LlamaForCausalLM model(parse_llama_config(kTinyLlama, "tiny"));
  for (const bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recomputed layers, bf16 autocast" : "bf16 autocast");
    model->model->set_gradient_checkpointing(recompute);
    auto run = [&](PackedAttentionMode mode) {
      ModeGuard g(mode);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      auto r = run_model(model, ids, segments);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      return r;
    };
    const auto masked = run(PackedAttentionMode::kMask);
    const auto looped = run(PackedAttentionMode::kVarlen);
    // bf16 activations: the two paths round attention differently (a few bf16 ulps of a logit).
    expect_equal_runs(looped, masked, 3e-2);
  }
}

TEST(TokenIds, TheModelChecksIdsItWasNotToldWereChecked) {
  LlamaForCausalLM model(parse_llama_config(kTinyLlama, "tiny"));
  auto ids = torch::randint(0, 97, {2, 8});
  ids[1][3] = 97;
  auto expect_message = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error; wanted: " << want;
    } catch (const replica::Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  // Direct calls: the model's own check names the id and the vocabulary.
  expect_message([&] { model->forward(ids); }, "LlamaForCausalLM input_ids: token id 97 is out of range for vocab_size 97");
  expect_message([&] { model->loss_sum(ids, ids); }, "token id 97 is out of range for vocab_size 97");
  // A workload's host check names its input.
  expect_message([&] { host_batch_facts(ids, {}, 97, torch::kCPU, "llm-sft batch input_ids"); },
                 "llm-sft batch input_ids: token id 97 is out of range for vocab_size 97");
  ids[1][3] = -2;
  expect_message([&] { check_token_ids(ids, 97, "rows"); }, "rows: token id -2 is out of range for vocab_size 97");
  // Ids the caller checked are not checked again: the same logits as the model's own check.
  ids[1][3] = 5;
  const auto facts = host_batch_facts(ids, {}, 97, torch::kCPU, "ids");
  EXPECT_TRUE(facts.ids_checked);
  EXPECT_FALSE(facts.packed.defined());
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(model->forward(ids, {}, {}, facts).equal(model->forward(ids)));
}
