// The fused CPU paths of models/fused_ops.h (fp32, AVX2 + FMA) against the composite ops they
// replace (HF's formulas, ATen's kernels), forward and backward: RMSNorm (with and without a
// weight gradient, several threads), rotary embedding (odd head sizes: the vector loop and the
// scalar tail; a batch-broadcast cos), SwiGLU (a tail, values where exp under- and
// overflows), cross-entropy (ignored rows, several threads, a vocabulary that is not a
// multiple of 8), the decision, and a whole Llama whose logits and gradients with the kernels
// equal those without. Each test says why where the CPU has no AVX2 + FMA.
#include "replica/models/fused_ops.h"
#include "replica/models/llama.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

using namespace replica::models;

namespace {

#define SKIP_WITHOUT_CPU_KERNELS()                                                              \
  if (!fused_cpu_kernels_available()) GTEST_SKIP() << "this CPU has no AVX2 + FMA: the fused " \
                                                      "CPU kernels do not run here"

// The largest difference relative to the reference's largest magnitude.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

constexpr double kTol = 1e-6;  // float rounding (fp32 epsilon 1.2e-7, a few roundings)

struct Restore {
  bool was = set_fused_kernels(true);
  int threads = at::get_num_threads();
  ~Restore() {
    set_fused_kernels(was);
    at::set_num_threads(threads);
  }
};

torch::Tensor hf_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  auto rot = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(2) + rot * sin.unsqueeze(2);
}

}  // namespace

TEST(FusedCpu, TakenForFp32CpuTensorsOnlyAndSwitchedOffByTheSwitch) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  EXPECT_TRUE(fused_kernels_for(torch::zeros({1})));
  EXPECT_FALSE(fused_kernels_for(torch::zeros({1}, torch::kBFloat16)));
  EXPECT_FALSE(fused_kernels_for(torch::zeros({1}, torch::kFloat64)));
  EXPECT_FALSE(fused_kernels_for(torch::Tensor()));
  set_fused_kernels(false);
  EXPECT_FALSE(fused_kernels_for(torch::zeros({1})));
}

TEST(FusedCpu, RmsNormEqualsTheCompositeForwardAndBackward) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  torch::manual_seed(2);
  // 96: the vector loop only; 100: a scalar tail. Two threads: the per-thread weight gradients.
  for (const int64_t H : {int64_t{96}, int64_t{100}}) {
    for (const int threads : {1, 2}) {
      for (const bool weight_grad : {true, false}) {
        SCOPED_TRACE("H=" + std::to_string(H) + " threads=" + std::to_string(threads) +
                     (weight_grad ? " weight grad" : " frozen weight"));
        at::set_num_threads(threads);
        auto x = (torch::randn({3, 700, H}) * 3).requires_grad_();
        auto w = (1 + 0.1 * torch::randn({H})).requires_grad_(weight_grad);
        auto fused = fused_rms_norm(x, w, 1e-6);
        auto x2 = x.detach().requires_grad_(), w2 = w.detach().requires_grad_(weight_grad);
        auto ref = w2 * (x2 * torch::rsqrt(x2.pow(2).mean(-1, true) + 1e-6));
        EXPECT_LT(rel_diff(fused, ref), kTol);
        auto dy = torch::randn(x.sizes());
        fused.backward(dy);
        ref.backward(dy);
        EXPECT_LT(rel_diff(x.grad(), x2.grad()), kTol);
        if (weight_grad) {
          // A sum over 2,100 rows, in another order than the composite's: 1e-5.
          EXPECT_LT(rel_diff(w.grad(), w2.grad()), 10 * kTol);
        } else {
          EXPECT_FALSE(w.grad().defined());
        }
      }
    }
  }
}

TEST(FusedCpu, RotaryEqualsHfsFormulaForwardAndBackward) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  torch::manual_seed(0);
  struct Case {
    int64_t B, T, H, D, cos_batch;
  };
  // D 64 and 128: the vector loop; 6 and 20: a scalar tail only / after one vector.
  for (const Case c : {Case{2, 5, 3, 64, 2}, Case{2, 7, 4, 6, 1}, Case{3, 33, 5, 128, 3}, Case{2, 9, 2, 20, 1}}) {
    SCOPED_TRACE(std::to_string(c.B) + "x" + std::to_string(c.T) + "x" + std::to_string(c.H) + "x" + std::to_string(c.D));
    auto x = torch::randn({c.B, c.T, c.H, c.D}).requires_grad_();
    auto angles = torch::rand({c.cos_batch, c.T, c.D / 2}) * 10;
    angles = torch::cat({angles, angles}, -1);
    auto cos = angles.cos(), sin = angles.sin();
    auto fused = fused_rotary(x, cos, sin, torch::kFloat32);
    ASSERT_EQ(fused.sizes(), x.sizes());
    auto x2 = x.detach().requires_grad_();
    auto ref = hf_rotary(x2, cos, sin);
    EXPECT_LT(rel_diff(fused, ref), kTol);
    auto dy = torch::randn(x.sizes());
    fused.backward(dy);
    ref.backward(dy);
    EXPECT_LT(rel_diff(x.grad(), x2.grad()), kTol);
  }
}

TEST(FusedCpu, SwigluEqualsSiluTimesUpForwardAndBackward) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  torch::manual_seed(1);
  for (const int64_t n : {int64_t{4096 * 7}, int64_t{1001}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    auto g = torch::randn({n}) * 4;
    // Where exp(-g) overflows and underflows: silu is 0 and g there.
    g.index_put_({0}, -120.0);
    g.index_put_({1}, 120.0);
    g.index_put_({n - 1}, -95.0);
    g.requires_grad_();
    auto u = torch::randn({n}).requires_grad_();
    auto fused = fused_swiglu(g, u);
    auto g2 = g.detach().requires_grad_(), u2 = u.detach().requires_grad_();
    auto ref = torch::silu(g2) * u2;
    EXPECT_LT(rel_diff(fused, ref), kTol);
    EXPECT_TRUE(torch::isfinite(fused).all().item<bool>());
    auto dy = torch::randn({n});
    fused.backward(dy);
    ref.backward(dy);
    EXPECT_LT(rel_diff(g.grad(), g2.grad()), kTol);
    EXPECT_LT(rel_diff(u.grad(), u2.grad()), kTol);
  }
}

TEST(FusedCpu, CrossEntropyEqualsTheCompositeForwardAndBackward) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  torch::manual_seed(4);
  // 1000 columns: the vector loop; 1003: a scalar tail. Two threads split the rows.
  for (const int64_t V : {int64_t{1000}, int64_t{1003}}) {
    for (const int threads : {1, 2}) {
      SCOPED_TRACE("V=" + std::to_string(V) + " threads=" + std::to_string(threads));
      at::set_num_threads(threads);
      auto logits = (torch::randn({370, V}) * 3);
      logits.index_put_({1, 7}, 60.0);  // a dominant logit: exp of the others' differences underflows
      logits.requires_grad_();
      auto targets = torch::randint(0, V, {370}, torch::kInt64);
      targets.index_put_({torch::arange(0, 370, 5)}, -100);  // some ignored
      auto fused = fused_cross_entropy_sum(logits, targets);
      auto l2 = logits.detach().requires_grad_();
      auto ref = torch::nn::functional::cross_entropy(
          l2, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
      EXPECT_NEAR(fused.item<double>(), ref.item<double>(), kTol * std::abs(ref.item<double>()));
      auto scale = torch::full({}, 0.37);
      (fused * scale).backward();
      (ref * scale).backward();
      EXPECT_LT(rel_diff(logits.grad(), l2.grad()), kTol);
      EXPECT_EQ(logits.grad()[0].abs().max().item<double>(), 0.0);  // an ignored row
    }
  }
}

TEST(FusedCpu, CrossEntropyOfATargetOutsideTheVocabularyIsNaN) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  auto targets = torch::tensor({int64_t{1}, int64_t{9}});
  EXPECT_TRUE(std::isnan(fused_cross_entropy_sum(torch::randn({2, 8}), targets).item<double>()));
}

namespace {

const char* kTinyLlama = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "vocab_size": 130, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu",
  "torch_dtype": "float32"})";

struct Pass {
  torch::Tensor loss, logits;
  std::vector<torch::Tensor> grads;
};

Pass run(LlamaForCausalLM& model, const torch::Tensor& ids, bool fused) {
  set_fused_kernels(fused);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  auto logits = model->forward(ids);
  auto loss = causal_lm_loss(logits, ids);
  loss.backward();
  Pass p{loss.detach(), logits.detach(), {}};
  for (auto& q : model->parameters()) p.grads.push_back(q.grad().clone());
  return p;
}

}  // namespace

TEST(FusedCpu, ALlamaComputesWithTheFusedKernelsWhatItComputesWithout) {
  SKIP_WITHOUT_CPU_KERNELS();
  Restore restore;
  torch::manual_seed(3);
  LlamaForCausalLM model(parse_llama_config(kTinyLlama, "tiny llama"));
  auto ids = torch::randint(0, 130, {2, 24});
  const auto on = run(model, ids, true);
  const auto off = run(model, ids, false);
  EXPECT_NEAR(on.loss.item<double>(), off.loss.item<double>(), 1e-6 * off.loss.item<double>());
  EXPECT_LT(rel_diff(on.logits, off.logits), 1e-5);
  ASSERT_EQ(on.grads.size(), off.grads.size());
  for (size_t i = 0; i < on.grads.size(); ++i) EXPECT_LT(rel_diff(on.grads[i], off.grads[i]), 1e-5) << i;
}
