#include "replica/models/mlp.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
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
