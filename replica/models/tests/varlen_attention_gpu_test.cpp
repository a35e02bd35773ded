// FlashAttention-2's varlen kernel on packed rows (CTest label `gpu`; skips, saying why, where
// no GPU is visible): against the [B, 1, T, T] mask path in bf16, outputs and input gradients,
// with grouped key/value heads, padding on either side and one-token segments; a bf16 Llama's
// logits and gradients on both paths; and the decision taking the kernel where it applies
// (Note [packed attention] in varlen_attention.cpp). The CPU tests of the same paths are
// varlen_attention_test.cpp.
#include "replica/testing/gpu_skip.h"
#include "replica/models/llama.h"
#include "replica/models/varlen_attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace replica::models;

namespace {

const torch::Device kCuda(torch::kCUDA, 0);

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64).cpu(), y = b.to(torch::kFloat64).cpu();
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

struct ModeGuard {
  PackedAttentionMode was;
  explicit ModeGuard(PackedAttentionMode mode) : was(set_packed_attention_mode(mode)) {}
  ~ModeGuard() { set_packed_attention_mode(was); }
};

// Rows of 256: left padding, segments of 100, 1 and 120; segments of 200 and 1, right padding;
// one segment.
torch::Tensor segment_rows() {
  auto rows = torch::empty({3, 256}, torch::kInt64);
  rows[0].narrow(0, 0, 35).fill_(-1);
  rows[0].narrow(0, 35, 100).fill_(0);
  rows[0].narrow(0, 135, 1).fill_(1);
  rows[0].narrow(0, 136, 120).fill_(2);
  rows[1].narrow(0, 0, 200).fill_(0);
  rows[1].narrow(0, 200, 1).fill_(1);
  rows[1].narrow(0, 201, 55).fill_(-1);
  rows[2].fill_(0);
  return rows;
}

torch::Tensor mask_of(const torch::Tensor& segments) {
  const int64_t T = segments.size(1);
  auto idx = torch::arange(T, segments.options());
  auto same = segments.unsqueeze(2) == segments.unsqueeze(1);
  return (idx.view({T, 1}) >= idx.view({1, T})).unsqueeze(0).logical_and(same).unsqueeze(1);
}

constexpr const char* kTinyLlama = R"({"model_type": "llama", "vocab_size": 97, "hidden_size": 256,
  "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 512})";

// Whether autograd's graph behind t has a node named `name` (which kernel the forward ran).
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

}  // namespace

TEST(VarlenAttentionGpu, FlashVarlenEqualsTheMaskInBf16ForwardAndBackward) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(5);
  const auto segments = segment_rows();
  const auto layout = packed_layout(segments, kCuda);  // from the host copy
  for (const int64_t kv_heads : {int64_t{8}, int64_t{2}}) {
    SCOPED_TRACE("kv_heads " + std::to_string(kv_heads));
    const int64_t B = 3, H = 8, T = 256, D = 64;
    auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(kCuda);
    auto q0 = torch::randn({B, H, T, D}, opts), k0 = torch::randn({B, kv_heads, T, D}, opts);
    auto v0 = torch::randn({B, kv_heads, T, D}, opts);
    auto dy = torch::randn({B, H, T, D}, opts.dtype(torch::kFloat32));
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    if (!flash_varlen_takes(q0, k0, v0, scale)) {
      GTEST_SKIP() << "ATen's flash kernel does not take bf16 attention on this GPU (before Ampere?)";
    }
    std::map<std::string, torch::Tensor> got[2];
    for (const bool varlen : {false, true}) {
      auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
      torch::Tensor out;
      if (varlen) {
        auto stream = [&](const torch::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), D}); };
        out = varlen_attention(stream(q), stream(k), stream(v), layout, scale, PackedAttention::kFlashVarlen)
                  .view({B, T, H, D})
                  .transpose(1, 2);
      } else {
        out = at::scaled_dot_product_attention(q, k, v, mask_of(segments.to(kCuda)), 0.0, false, scale,
                                               kv_heads != H);
      }
      (out.to(torch::kFloat32) * dy).sum().backward();
      got[varlen] = {{"out", out.detach()}, {"dq", q.grad()}, {"dk", k.grad()}, {"dv", v.grad()}};
    }
    for (const auto& [name, t] : got[1]) EXPECT_LT(rel_diff(t, got[0].at(name)), 2e-2) << name;
  }
}

TEST(VarlenAttentionGpu, ABf16LlamaTakesTheFlashKernelAndComputesWhatTheMaskDoes) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(6);
  LlamaForCausalLM model(parse_llama_config(kTinyLlama, "tiny"), torch::kBFloat16);
  model->to(kCuda);
  const auto segments = segment_rows();
  auto ids = torch::randint(0, 97, {3, 256});
  {
    auto q = torch::randn({3, 4, 256, 64}, torch::TensorOptions().dtype(torch::kBFloat16).device(kCuda));
    auto k = torch::randn({3, 2, 256, 64}, q.options());
    if (!flash_varlen_takes(q, k, k, 0.125)) GTEST_SKIP() << "ATen's flash kernel does not take bf16 here";
  }
  auto run = [&](PackedAttentionMode mode) {
    ModeGuard g(mode);
    model->zero_grad();
    const auto facts = host_batch_facts(ids, segments, 97, kCuda, "test input_ids");
    auto logits = model->forward(ids.to(kCuda), {}, segments.to(kCuda), facts).to(torch::kFloat32);
    EXPECT_EQ(graph_has(logits, "FlashAttentionBackward0"), mode == PackedAttentionMode::kAuto) << to_string(mode);
    logits.sum().backward();
    std::map<std::string, torch::Tensor> out{{"logits", logits.detach().cpu()}};
    for (const auto& p : model->named_parameters()) out[p.key()] = p.value().grad().to(torch::kFloat32).cpu();
    return out;
  };
  const auto masked = run(PackedAttentionMode::kMask);
  const auto flash = run(PackedAttentionMode::kAuto);
  for (const auto& [name, t] : flash) EXPECT_LT(rel_diff(t, masked.at(name)), 3e-2) << name;
}
