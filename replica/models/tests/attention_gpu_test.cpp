// Attention on CUDA (CTest label `gpu`; skips, saying why, where no GPU is visible): a
// grouped-query Llama in fp32 and with packed segments, where ATen's kernels refuse grouped
// key/value heads, must not fall back to the math path's [B, heads, T, T] scores
// (Note [grouped-query attention and the math kernel] in llama.cpp), and must compute what the
// CPU computes.
#include "replica/testing/gpu_skip.h"
#include "replica/models/llama.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

using namespace replica::models;

namespace {

const torch::Device kCuda(torch::kCUDA, 0);

// One decoder layer, 16 query heads over 8 key/value heads of 16: its scores at T = 2048 would be
// 16 x 2048 x 2048 x 4 bytes = 256 MiB per tensor on the math path.
constexpr const char* kGroupedLlama = R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 256,
  "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096})";

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64).cpu(), y = b.to(torch::kFloat64).cpu();
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

// The gradient of the one weight that only attention's backward reaches through the scores.
torch::Tensor q_proj_grad(LlamaForCausalLM& model) {
  return model->named_parameters()["model.layers.0.self_attn.q_proj.weight"].grad();
}

}  // namespace

TEST(AttentionGpu, GroupedQueryAttentionInFp32AndPackedNeverHoldsTheScoreMatrix) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(11);
  LlamaForCausalLM model(parse_llama_config(kGroupedLlama, "grouped llama"));
  const int64_t T = 2048;
  auto ids = torch::randint(0, 64, {1, T});
  auto segments = torch::cat({torch::zeros({1, 700}, torch::kInt64), torch::ones({1, T - 700}, torch::kInt64)}, 1);
  const double scores_mib = 16.0 * T * T * 4 / (1024.0 * 1024.0);
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed segments" : "causal");
    const auto seg = packed ? segments : torch::Tensor();
    model->to(torch::kCPU);
    model->zero_grad();
    auto cpu_logits = model->forward(ids, {}, seg);
    cpu_logits.sum().backward();
    const auto cpu_grad = q_proj_grad(model).clone();

    model->to(kCuda);
    model->zero_grad();
    auto ids_gpu = ids.to(kCuda);
    auto seg_gpu = packed ? seg.to(kCuda) : torch::Tensor();
    torch::cuda::synchronize();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
    auto logits = model->forward(ids_gpu, {}, seg_gpu);
    logits.sum().backward();
    torch::cuda::synchronize();
    const auto peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
    const double step_mib = static_cast<double>(peak - before) / (1024.0 * 1024.0);
    std::printf("%s: forward + backward peak %.1f MiB over the model (one score matrix: %.0f MiB)\n",
                packed ? "packed" : "causal", step_mib, scores_mib);
    EXPECT_LT(step_mib, scores_mib / 2);
    EXPECT_LT(rel_diff(logits, cpu_logits), 1e-5);
    EXPECT_LT(rel_diff(q_proj_grad(model), cpu_grad), 1e-4);
  }
}
