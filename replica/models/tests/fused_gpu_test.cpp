// The fused CUDA paths of models/fused_ops.h (CTest label `gpu`; every test skips, saying why,
// where no GPU is visible) against the composite ops they replace (HF's formulas, ATen's
// kernels), forward and backward, in fp32 and bf16: RMSNorm, rotary embedding (odd sizes,
// a batch-broadcast cos, bf16 in / fp32 out), SwiGLU and cross-entropy (packed and scalar
// paths), and a whole Llama whose logits and gradients with the fused kernels equal those
// without (fp32, bf16 autocast, bf16 weights).
#include "replica/testing/gpu_skip.h"
#include "replica/models/fused_ops.h"
#include "replica/models/llama.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

using namespace replica::models;

namespace {

const torch::Device kCuda(torch::kCUDA, 0);

// The largest difference relative to the reference's largest magnitude.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64).cpu(), y = b.to(torch::kFloat64).cpu();
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

// fp32: float rounding; bf16: a couple of bf16 ulps (2^-8 relative each).
double tolerance(torch::ScalarType t) { return t == torch::kFloat32 ? 1e-5 : 2e-2; }

torch::Tensor hf_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // x [B, T, H, D]; cos/sin [B or 1, T, D]: x * cos + rotate_half(x) * sin, per head.
  const int64_t half = x.size(-1) / 2;
  auto rot = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(2) + rot * sin.unsqueeze(2);
}

struct Restore {
  bool was = set_fused_kernels(true);
  ~Restore() { set_fused_kernels(was); }
};

}  // namespace

TEST(FusedGpu, TheKernelsAreBuiltAndTakenForCudaTensors) {
  REPLICA_SKIP_WITHOUT_GPU();
  Restore restore;
  ASSERT_TRUE(fused_kernels_compiled());
  EXPECT_TRUE(fused_kernels_for(torch::zeros({1}, torch::device(kCuda))));
  EXPECT_FALSE(fused_kernels_for(torch::zeros({1}, torch::kBFloat16)));  // the CPU's kernels: fp32 only
  set_fused_kernels(false);
  EXPECT_FALSE(fused_kernels_for(torch::zeros({1}, torch::device(kCuda))));
}

TEST(FusedGpu, RotaryEqualsHfsFormulaForwardAndBackward) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(0);
  struct Case {
    int64_t B, T, H, D, cos_batch;
    torch::ScalarType in, out;
  };
  for (const Case c : {Case{2, 5, 3, 8, 2, torch::kFloat32, torch::kFloat32}, Case{2, 7, 4, 6, 1, torch::kFloat32, torch::kFloat32},
                       Case{3, 33, 5, 128, 3, torch::kBFloat16, torch::kBFloat16},
                       Case{2, 9, 2, 64, 1, torch::kBFloat16, torch::kFloat32},
                       Case{1, 4, 2, 640, 1, torch::kFloat32, torch::kBFloat16}}) {
    SCOPED_TRACE(std::to_string(c.B) + "x" + std::to_string(c.T) + "x" + std::to_string(c.H) + "x" + std::to_string(c.D) +
                 " " + c10::toString(c.in) + " -> " + c10::toString(c.out));
    auto x = torch::randn({c.B, c.T, c.H, c.D}, torch::device(kCuda)).to(c.in).requires_grad_();
    auto angles = torch::rand({c.cos_batch, c.T, c.D / 2}, torch::device(kCuda)) * 10;
    angles = torch::cat({angles, angles}, -1);
    auto cos = angles.cos(), sin = angles.sin();
    auto fused = fused_rotary(x, cos, sin, c.out);
    ASSERT_EQ(fused.scalar_type(), c.out);
    ASSERT_EQ(fused.sizes(), x.sizes());
    // The reference in fp32 from the same inputs, rounded as the fused output is.
    auto x32 = x.detach().to(torch::kFloat32).requires_grad_();
    auto ref = hf_rotary(x32, cos, sin);
    EXPECT_LT(rel_diff(fused, ref.to(c.out)), tolerance(c.out == torch::kFloat32 ? c.in : c.out));
    auto dy = torch::randn(x.sizes(), torch::device(kCuda)).to(c.out);
    fused.backward(dy);
    ref.backward(dy.to(torch::kFloat32));
    ASSERT_EQ(x.grad().scalar_type(), c.in);
    EXPECT_LT(rel_diff(x.grad(), x32.grad()), tolerance(c.in == torch::kFloat32 && c.out == torch::kFloat32 ? torch::kFloat32 : torch::kBFloat16));
  }
}

TEST(FusedGpu, SwigluEqualsSiluTimesUpForwardAndBackward) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(1);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    // 4096 x 7 (vector path), 1001 (a scalar tail), and a view one element in (unaligned: the
    // scalar path).
    for (const int64_t n : {int64_t{4096 * 7}, int64_t{1001}, int64_t{-1}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " n=" + std::to_string(n));
      torch::Tensor g, u;
      if (n > 0) {
        g = (torch::randn({n}, torch::device(kCuda)) * 4).to(dtype);
        u = torch::randn({n}, torch::device(kCuda)).to(dtype);
      } else {
        g = (torch::randn({2049}, torch::device(kCuda)) * 4).to(dtype).narrow(0, 1, 2048);
        u = torch::randn({2049}, torch::device(kCuda)).to(dtype).narrow(0, 1, 2048);
      }
      g.requires_grad_();
      u.requires_grad_();
      auto fused = fused_swiglu(g, u);
      ASSERT_EQ(fused.scalar_type(), dtype);
      auto g32 = g.detach().to(torch::kFloat32).requires_grad_(), u32 = u.detach().to(torch::kFloat32).requires_grad_();
      auto ref = torch::silu(g32) * u32;
      EXPECT_LT(rel_diff(fused, ref), tolerance(dtype));
      auto dy = torch::randn(fused.sizes(), torch::device(kCuda)).to(dtype);
      fused.backward(dy);
      ref.backward(dy.to(torch::kFloat32));
      EXPECT_LT(rel_diff(g.grad(), g32.grad()), tolerance(dtype));
      EXPECT_LT(rel_diff(u.grad(), u32.grad()), tolerance(dtype));
    }
  }
}

TEST(FusedGpu, RmsNormEqualsTheCompositeForwardAndBackward) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(2);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto x = torch::randn({3, 17, 96}, torch::device(kCuda)).to(dtype).requires_grad_();
    auto w = (1 + 0.1 * torch::randn({96}, torch::device(kCuda))).to(dtype).requires_grad_();
    auto fused = fused_rms_norm(x, w, 1e-6);
    ASSERT_EQ(fused.scalar_type(), dtype);
    auto x32 = x.detach().to(torch::kFloat32).requires_grad_(), w32 = w.detach().to(torch::kFloat32).requires_grad_();
    auto ref = w32 * (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-6));
    EXPECT_LT(rel_diff(fused, ref), tolerance(dtype));
    auto dy = torch::randn(x.sizes(), torch::device(kCuda)).to(dtype);
    fused.backward(dy);
    ref.backward(dy.to(torch::kFloat32));
    EXPECT_LT(rel_diff(x.grad(), x32.grad()), tolerance(dtype));
    EXPECT_LT(rel_diff(w.grad(), w32.grad()), tolerance(dtype));
  }
}

TEST(FusedGpu, CrossEntropyEqualsTheCompositeOverFp32LogitsForwardAndBackward) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(4);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    // 1000 columns: the packed path; 1001: the scalar one.
    for (const int64_t V : {int64_t{1000}, int64_t{1001}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " V=" + std::to_string(V));
      auto logits = (torch::randn({37, V}, torch::device(kCuda)) * 3).to(dtype).requires_grad_();
      auto targets = torch::randint(0, V, {37}, torch::device(kCuda).dtype(torch::kInt64));
      targets.index_put_({torch::arange(0, 37, 5, torch::device(kCuda))}, -100);  // some ignored
      auto fused = fused_cross_entropy_sum(logits, targets);
      auto l32 = logits.detach().to(torch::kFloat32).requires_grad_();
      auto ref = torch::nn::functional::cross_entropy(
          l32, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
      EXPECT_NEAR(fused.item<double>(), ref.item<double>(), 1e-5 * std::abs(ref.item<double>()));
      auto scale = torch::full({}, 0.37, torch::device(kCuda));
      (fused * scale).backward();
      (ref * scale).backward();
      ASSERT_EQ(logits.grad().scalar_type(), dtype);
      EXPECT_LT(rel_diff(logits.grad(), l32.grad()), tolerance(dtype));
      // Ignored rows get no gradient.
      EXPECT_EQ(logits.grad()[0].abs().max().item<double>(), 0.0);
    }
  }
}

namespace {

const char* kTinyLlama = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu",
  "torch_dtype": "float32"})";

struct Pass {
  torch::Tensor logits;
  std::vector<torch::Tensor> grads;
};

Pass run(LlamaForCausalLM& model, const torch::Tensor& ids, bool fused, bool autocast) {
  set_fused_kernels(fused);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  at::autocast::set_autocast_enabled(torch::kCUDA, autocast);
  if (autocast) at::autocast::set_autocast_dtype(torch::kCUDA, at::kBFloat16);
  auto logits = model->forward(ids);
  auto loss = causal_lm_loss(logits, ids);
  at::autocast::set_autocast_enabled(torch::kCUDA, false);
  at::autocast::clear_cache();
  loss.backward();
  Pass p{logits.detach().to(torch::kFloat32), {}};
  for (auto& q : model->parameters()) p.grads.push_back(q.grad().to(torch::kFloat32));
  return p;
}

}  // namespace

TEST(FusedGpu, ALlamaComputesWithTheFusedKernelsWhatItComputesWithout) {
  REPLICA_SKIP_WITHOUT_GPU();
  Restore restore;
  torch::manual_seed(3);
  LlamaForCausalLM model(parse_llama_config(kTinyLlama, "tiny llama"));
  model->to(kCuda);
  auto ids = torch::randint(0, 128, {2, 24}).to(kCuda);
  // fp32: float rounding. bf16 autocast and a bf16 model: a few bf16 ulps.
  for (const std::string mode : {"fp32", "bf16 autocast", "bf16 weights"}) {
    SCOPED_TRACE(mode);
    if (mode == "bf16 weights") model->to(torch::kBFloat16);
    const bool autocast = mode == "bf16 autocast";
    const auto on = run(model, ids, true, autocast);
    const auto off = run(model, ids, false, autocast);
    const double tol = mode == "fp32" ? 1e-5 : 3e-2;
    EXPECT_LT(rel_diff(on.logits, off.logits), tol);
    ASSERT_EQ(on.grads.size(), off.grads.size());
    for (size_t i = 0; i < on.grads.size(); ++i) EXPECT_LT(rel_diff(on.grads[i], off.grads[i]), mode == "fp32" ? 1e-4 : 5e-2) << i;
  }
}
