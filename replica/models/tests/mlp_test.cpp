#include "replica/models/mlp.h"

#include "replica/core/error.h"
#include "replica/core/gradient_home.h"
#include "replica/models/fused_linear.h"
#include "replica/models/linear.h"

#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

using replica::models::MLP;

TEST(MLP, OutputShapeForImagesAndFlatInput) {
  torch::manual_seed(0);
  MLP model(784, {256, 128}, 10);
  EXPECT_EQ(model->forward(torch::rand({4, 1, 28, 28})).sizes(), (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(model->forward(torch::rand({3, 784})).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(model->forward(torch::rand({0, 1, 28, 28})).sizes(), (std::vector<int64_t>{0, 10}));
}

TEST(MLP, ParameterNamesShapesAndCount) {
  MLP model(784, {256, 128}, 10);
  const auto named = model->named_parameters();
  std::vector<std::string> names;
  for (const auto& item : named) names.push_back(item.key());
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.2.weight",
                                             "layers.2.bias", "layers.4.weight", "layers.4.bias"}));
  EXPECT_EQ(named["layers.0.weight"].sizes(), (std::vector<int64_t>{256, 784}));
  EXPECT_EQ(named["layers.2.weight"].sizes(), (std::vector<int64_t>{128, 256}));
  EXPECT_EQ(named["layers.4.weight"].sizes(), (std::vector<int64_t>{10, 128}));
  EXPECT_EQ(named["layers.4.bias"].sizes(), (std::vector<int64_t>{10}));

  int64_t count = 0;
  for (const auto& parameter : model->parameters()) count += parameter.numel();
  EXPECT_EQ(count, 235146);
}

TEST(MLP, NoHiddenLayersIsLinear) {
  MLP model(6, {}, 3);
  EXPECT_EQ(model->named_parameters().size(), 2u);
  EXPECT_TRUE(model->named_parameters().contains("layers.0.weight"));
  const torch::Tensor x = torch::rand({5, 2, 3});
  const auto& params = model->named_parameters();
  const torch::Tensor expected =
      torch::addmm(params["layers.0.bias"], x.flatten(1), params["layers.0.weight"].t());
  EXPECT_TRUE(torch::allclose(model->forward(x), expected));
}

TEST(MLP, ComputesReluStack) {
  MLP model(4, {5}, 2);
  const auto& p = model->named_parameters();
  const torch::Tensor x = torch::randn({7, 4});
  const torch::Tensor hidden = torch::relu(torch::addmm(p["layers.0.bias"], x, p["layers.0.weight"].t()));
  const torch::Tensor expected = torch::addmm(p["layers.2.bias"], hidden, p["layers.2.weight"].t());
  EXPECT_TRUE(torch::allclose(model->forward(x), expected));
}

TEST(MLP, DefaultInitIsPyTorchs) {
  // nn.Linear: weights and biases uniform in +-1/sqrt(fan_in) (kaiming_uniform with a=sqrt(5)).
  torch::manual_seed(1);
  MLP model(784, {256}, 10);
  const auto& p = model->named_parameters();
  const double bound0 = 1.0 / std::sqrt(784.0);
  EXPECT_LE(p["layers.0.weight"].abs().max().item<double>(), bound0 + 1e-7);
  EXPECT_LE(p["layers.0.bias"].abs().max().item<double>(), bound0 + 1e-7);
  EXPECT_GT(p["layers.0.weight"].abs().max().item<double>(), 0.9 * bound0);  // spread, not zero
  const double bound2 = 1.0 / std::sqrt(256.0);
  EXPECT_LE(p["layers.2.weight"].abs().max().item<double>(), bound2 + 1e-7);
}

TEST(MLP, RejectsBadSizesAndInputs) {
  EXPECT_THROW(MLP(0, {4}, 2), replica::Error);
  EXPECT_THROW(MLP(4, {4, 0}, 2), replica::Error);
  EXPECT_THROW(MLP(4, {4}, 0), replica::Error);
  MLP model(784, {16}, 10);
  try {
    model->forward(torch::rand({2, 1, 28, 27}));
    FAIL() << "no replica::Error";
  } catch (const replica::Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("756"), std::string::npos) << message;
    EXPECT_NE(message.find("784"), std::string::npos) << message;
  }
}

// Note [model size bounds]: a width from a mistyped key (hidden_sizes: [2147483647]) is
// refused before anything is allocated (before: LibTorch was asked for 6.7 TB).
TEST(MLP, SizesBeyondTheBoundsAreRefusedBeforeAllocating) {
  EXPECT_EQ(replica::models::layer_widths_problem({256, 128}), "");
  EXPECT_EQ(replica::models::layer_widths_problem({256, 2147483647}), "must list widths from 1 to 65536, got 2147483647");
  EXPECT_EQ(replica::models::layer_widths_problem({0}), "must list widths from 1 to 65536, got 0");
  EXPECT_EQ(replica::models::mlp_parameter_count(784, {256, 128}, 10), 235146);  // mlp.h's example
  EXPECT_EQ(replica::models::mlp_parameter_count(INT64_MAX / 2, {4}, 2), INT64_MAX);  // saturates, never wraps
  try {
    MLP(784, {2147483647}, 10);
    FAIL() << "no replica::Error";
  } catch (const replica::Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "MLP: 784 -> [2147483647] -> 10 has 1707249499375 parameters, more than the 4294967296 replica builds");
  }
}

// FusedLinear is torch::nn::Linear: same initialisation, outputs and gradients. With a
// gradient home registered (what DDP does), the first backward writes the weight gradient
// into the home itself (the same memory, not a copy), and a second one adds to it.
TEST(FusedLinear, EqualsLinearAndWritesTheWeightGradientIntoItsHome) {
  torch::manual_seed(3);
  replica::models::FusedLinear fused(7, 5);
  torch::manual_seed(3);
  torch::nn::Linear plain(7, 5);
  ASSERT_TRUE(torch::equal(fused->weight, plain->weight));
  ASSERT_TRUE(torch::equal(fused->bias, plain->bias));

  const torch::Tensor x0 = torch::randn({4, 7});
  const torch::Tensor w = torch::randn({4, 5});
  auto run = [&](auto& layer, torch::Tensor& x_grad) {
    torch::Tensor x = x0.clone().requires_grad_(true);
    torch::Tensor y = layer->forward(x);
    (y * w).sum().backward();
    x_grad = x.grad();
    return y;
  };
  torch::Tensor gx_fused, gx_plain;
  EXPECT_TRUE(torch::equal(run(fused, gx_fused), run(plain, gx_plain)));
  EXPECT_TRUE(torch::equal(gx_fused, gx_plain));
  EXPECT_TRUE(torch::equal(fused->weight.grad(), plain->weight.grad()));
  EXPECT_TRUE(torch::equal(fused->bias.grad(), plain->bias.grad()));

  // A home inside a larger flat buffer, like a DDP bucket.
  torch::Tensor bucket = torch::full({100}, -1.0f);
  torch::Tensor home = bucket.slice(0, 10, 45).view({5, 7});
  replica::set_gradient_home(fused->weight, home);
  for (auto* p : {&fused->weight, &fused->bias, &plain->weight, &plain->bias}) p->mutable_grad() = torch::Tensor();
  run(fused, gx_fused);
  run(plain, gx_plain);
  EXPECT_EQ(fused->weight.grad().data_ptr(), home.data_ptr()) << "written in place, not copied";
  EXPECT_TRUE(torch::equal(home, plain->weight.grad()));
  EXPECT_TRUE(torch::equal(fused->bias.grad(), plain->bias.grad()));
  EXPECT_TRUE(torch::equal(gx_fused, gx_plain));
  EXPECT_EQ(bucket.slice(0, 0, 10).eq(-1).all().item<bool>(), true) << "the rest of the bucket is untouched";
  EXPECT_EQ(bucket.slice(0, 45).eq(-1).all().item<bool>(), true);
  // Gradient accumulation: the second backward adds into the home.
  run(fused, gx_fused);
  run(plain, gx_plain);
  EXPECT_EQ(fused->weight.grad().data_ptr(), home.data_ptr());
  EXPECT_TRUE(torch::allclose(home, plain->weight.grad(), 1e-6, 1e-6));
  replica::set_gradient_home(fused->weight, torch::Tensor());
  EXPECT_FALSE(replica::gradient_home(fused->weight).defined());

  // Other than 2-D inputs take Linear's own path.
  torch::Tensor x3 = torch::randn({2, 3, 7});
  EXPECT_TRUE(torch::equal(fused->forward(x3), plain->forward(x3)));
}

// Under CPU autocast (mixed_precision: bf16 or fp16) FusedLinear computes what torch::nn::Linear
// does: half-type operands and output, fp32 gradients for the fp32 parameters and input. On
// ATen's half-type kernels exactly; through the fp32 GEMM (models/linear.h: CPUs without the
// type's arithmetic) within two roundings of the type. Both paths forced, on every machine.
TEST(FusedLinear, UnderHalfAutocastEqualsLinearOnBothGemmPaths) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto set = dtype == at::kHalf ? replica::models::set_cpu_fp16_through_fp32
                                        : replica::models::set_cpu_bf16_through_fp32;
    const double ulp = dtype == at::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    for (const bool through_fp32 : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (through_fp32 ? " through the fp32 GEMM" : " ATen's kernels"));
      struct Restore {
        decltype(set) set_;
        bool was;
        ~Restore() { set_(was); }
      } restore{set, set(through_fp32)};
      torch::manual_seed(4);
      replica::models::FusedLinear fused(16, 8);
      torch::manual_seed(4);
      torch::nn::Linear plain(16, 8);
      const torch::Tensor x0 = torch::randn({6, 16});
      const torch::Tensor w = torch::randn({6, 8});
      auto run = [&](auto& layer, torch::Tensor& x_grad) {
        torch::Tensor x = x0.clone().requires_grad_(true);
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, dtype);
        torch::Tensor y = layer->forward(x);
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();
        (y.to(torch::kFloat) * w).sum().backward();
        x_grad = x.grad();
        return y;
      };
      torch::Tensor gx_fused, gx_plain;
      const torch::Tensor y_fused = run(fused, gx_fused), y_plain = run(plain, gx_plain);
      EXPECT_EQ(y_fused.scalar_type(), dtype);
      EXPECT_EQ(gx_fused.scalar_type(), torch::kFloat);
      EXPECT_EQ(fused->weight.grad().scalar_type(), torch::kFloat);
      const std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs = {
          {y_fused, y_plain}, {gx_fused, gx_plain}, {fused->weight.grad(), plain->weight.grad()},
          {fused->bias.grad(), plain->bias.grad()}};
      for (const auto& [got, want] : pairs) {
        if (!through_fp32) {
          EXPECT_TRUE(torch::equal(got, want));
          continue;
        }
        const auto g = got.to(torch::kFloat64), e = want.to(torch::kFloat64);
        const auto bound = e.abs() * (2 * ulp) + 1e-3 * e.abs().max().item<double>();
        EXPECT_TRUE(((g - e).abs() <= bound).all().item<bool>()) << (g - e).abs().max().item<double>();
      }
    }
  }
}

// fp16 parameters with an fp16 gradient home (no autocast) through the fp32 GEMM: the weight
// gradient is written into the home and accumulated there, the sum of home and product rounded
// once, within fp16 rounding of LibTorch's fp16 Linear.
TEST(FusedLinear, Fp16ParametersThroughFp32WriteAndAccumulateTheirHome) {
  struct Restore {
    bool was = replica::models::set_cpu_fp16_through_fp32(true);
    ~Restore() { replica::models::set_cpu_fp16_through_fp32(was); }
  } restore;
  torch::manual_seed(5);
  replica::models::FusedLinear fused(16, 8);
  torch::manual_seed(5);
  torch::nn::Linear plain(16, 8);
  fused->to(torch::kHalf);
  plain->to(torch::kHalf);
  torch::Tensor home = torch::zeros({8, 16}, torch::kHalf);
  replica::set_gradient_home(fused->weight, home);
  const torch::Tensor x = torch::randn({6, 16}).to(torch::kHalf);
  for (int i = 0; i < 2; ++i) {
    fused->forward(x).to(torch::kFloat).sum().backward();
    plain->forward(x).to(torch::kFloat).sum().backward();
  }
  EXPECT_EQ(fused->weight.grad().data_ptr(), home.data_ptr());
  const auto g = home.to(torch::kFloat64), e = plain->weight.grad().to(torch::kFloat64);
  EXPECT_LE((g - e).abs().max().item<double>(), 4 * std::ldexp(1.0, -11) * e.abs().max().item<double>());
  replica::set_gradient_home(fused->weight, torch::Tensor());
}
