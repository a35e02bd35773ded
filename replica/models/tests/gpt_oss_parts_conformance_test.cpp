// Conformance: GPT-OSS's parts (moe.h, attention_sinks.h, mxfp4.h, rope_yarn.h) against transformers' own
// GptOssMLP, load_balancing_loss_func, eager attention with sinks, YaRN frequencies and MXFP4
// dequantization
// (referee/gpt_oss_parts_referee.py): outputs and gradients within 1e-5 in fp32.
#include "replica/models/tests/hf_conformance.h"

#include "replica/core/error.h"
#include "replica/models/attention_sinks.h"
#include "replica/models/moe.h"
#include "replica/models/mxfp4.h"
#include "replica/models/rope_yarn.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace replica::models;
using namespace replica::models::conformance;

namespace {

constexpr double kTolerance = 1e-5;

class GptOssParts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("replica-gpt-oss-parts");
    const std::string file = (*dir_) / "reference.safetensors";
    ASSERT_TRUE(run_referee("gpt_oss_parts_referee.py", {"--out", file}));
    ref_ = new std::map<std::string, torch::Tensor>(load_tensors(file));
  }
  static void TearDownTestSuite() {
    delete ref_;
    delete dir_;
  }
  const torch::Tensor& ref(const std::string& name) {
    auto it = ref_->find(name);
    if (it == ref_->end()) throw std::runtime_error("the referee wrote no " + name);
    return it->second;
  }
  static ScratchDir* dir_;
  static std::map<std::string, torch::Tensor>* ref_;
};
ScratchDir* GptOssParts::dir_ = nullptr;
std::map<std::string, torch::Tensor>* GptOssParts::ref_ = nullptr;

TEST_F(GptOssParts, MixtureOfExpertsMatchesTransformersForwardAndBackward) {
  ASSERT_NE(ref_, nullptr);
  MoeConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 12;
  c.num_experts = 5;
  c.top_k = 2;
  MoeMlp mlp(c, torch::kFloat32, /*init=*/false);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : mlp->named_parameters()) p.value().copy_(ref("mlp." + p.key()));
  }
  auto x = ref("mlp.x").clone().set_requires_grad(true);
  auto y = mlp(x);
  EXPECT_LE(max_abs_diff(y, ref("mlp.y")), kTolerance);
  EXPECT_LE(max_abs_diff(mlp->last_router_scores(), ref("mlp.scores")), kTolerance);
  (y * ref("mlp.dy")).sum().backward();
  EXPECT_LE(max_abs_diff(x.grad(), ref("mlp.grad.x")), kTolerance);
  for (auto& p : mlp->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LE(max_abs_diff(p.value().grad(), ref("mlp.grad." + p.key())), kTolerance) << p.key();
  }
  // Every expert tensor has a gradient whatever the routing (Note [experts under data
  // parallelism]): here 14 tokens x 2 of 5 experts.
  EXPECT_EQ(mlp->experts->gate_up_proj.grad().sizes(), mlp->experts->gate_up_proj.sizes());
}

TEST_F(GptOssParts, LoadBalancingLossMatchesTransformers) {
  ASSERT_NE(ref_, nullptr);
  const std::vector<torch::Tensor> scores = {ref("mlp.scores"), ref("aux.scores2")};
  EXPECT_NEAR(load_balancing_loss(scores, 5, 2).item<double>(), ref("aux.loss").item<double>(), 1e-6);
  EXPECT_NEAR(load_balancing_loss(scores, 5, 2, ref("aux.mask")).item<double>(), ref("aux.loss_masked").item<double>(),
              1e-6);
}

TEST_F(GptOssParts, SinkAttentionMatchesTransformersEager) {
  ASSERT_NE(ref_, nullptr);
  auto q = ref("attn.q").clone().set_requires_grad(true);
  auto sinks = ref("attn.sinks").clone().set_requires_grad(true);
  auto out = attention_with_sinks(q, ref("attn.k"), ref("attn.v"), ref("attn.mask"), sinks, std::pow(8.0, -0.5), 0.0,
                                  /*training=*/false);
  EXPECT_LE(max_abs_diff(out, ref("attn.out")), kTolerance);
  (out * ref("attn.dout")).sum().backward();
  EXPECT_LE(max_abs_diff(sinks.grad(), ref("attn.grad.sinks")), kTolerance);
  EXPECT_LE(max_abs_diff(q.grad(), ref("attn.grad.q")), kTolerance);
}

TEST_F(GptOssParts, YarnFrequenciesMatchTransformers) {
  ASSERT_NE(ref_, nullptr);
  // GPT-OSS's default: factor 32, beta 32/1, no truncation, 4096 original positions, theta 150000.
  YarnScaling gpt_oss;
  gpt_oss.factor = 32.0;
  gpt_oss.truncate = false;
  gpt_oss.original_max_position_embeddings = 4096;
  auto [inv_freq, attention] = yarn_inv_freq(gpt_oss, 150000.0, 8, 131072);
  EXPECT_LE(max_abs_diff(inv_freq, ref("yarn.gpt_oss.inv_freq")), 1e-9);
  EXPECT_NEAR(attention, ref("yarn.gpt_oss.attention").item<double>(), 1e-12);
  YarnScaling m;
  m.factor = 4.0;
  m.mscale = 0.707;
  m.mscale_all_dim = 1.0;
  m.original_max_position_embeddings = 1024;
  auto [inv_freq2, attention2] = yarn_inv_freq(m, 10000.0, 16, 4096);
  EXPECT_LE(max_abs_diff(inv_freq2, ref("yarn.mscale.inv_freq")), 1e-9);
  EXPECT_NEAR(attention2, ref("yarn.mscale.attention").item<double>(), 1e-12);
}

TEST_F(GptOssParts, Mxfp4DequantizesAsTransformersDoes) {
  ASSERT_NE(ref_, nullptr);
  auto w = dequantize_mxfp4(ref("mxfp4.blocks"), ref("mxfp4.scales"), torch::kFloat32, "experts.gate_up_proj");
  EXPECT_EQ(w.sizes(), ref("mxfp4.weight").sizes());
  EXPECT_TRUE(torch::equal(w, ref("mxfp4.weight")));
  EXPECT_THROW(dequantize_mxfp4(ref("mxfp4.blocks"), ref("mxfp4.scales").narrow(-1, 0, 1), torch::kFloat32, "w"),
               replica::Error);
}

}  // namespace
