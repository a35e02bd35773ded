#include "replica/core/error.h"
#include "replica/models/resnet.h"
#include "replica/models/two_tower.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>

using namespace replica::models;

TEST(TwoTower, InBatchLossIsCrossEntropyOverTheBatch) {
  torch::manual_seed(0);
  torch::Tensor u = torch::randn({4, 3}), v = torch::randn({4, 3});
  const double t = 0.1;
  torch::Tensor logits = torch::matmul(u, v.t()) / t;
  double expected = 0;
  for (int r = 0; r < 4; ++r) expected -= torch::log_softmax(logits[r], 0)[r].item<double>();
  EXPECT_NEAR(in_batch_softmax_loss(u, v, t).item<double>(), expected / 4, 1e-5);
  // Rows 2..3 against a larger (gathered) item set: positives at columns 2 and 3.
  double shifted = 0;
  for (int r = 0; r < 2; ++r) shifted -= torch::log_softmax(logits[r + 2], 0)[r + 2].item<double>();
  EXPECT_NEAR(in_batch_softmax_loss(u.slice(0, 2, 4), v, t, 2).item<double>(), shifted / 2, 1e-5);
  EXPECT_THROW(in_batch_softmax_loss(u, v, 0.0), replica::Error);
}

TEST(TwoTower, RetrievalMetricsRankAgainstEveryItem) {
  // Query 0: target 2 ranks first; query 1: target 0 ranks third; query 2: target 1 ranks last.
  torch::Tensor scores = torch::tensor({{0.1f, 0.2f, 0.9f, 0.0f}, {0.1f, 0.5f, 0.4f, 0.0f}, {0.5f, 0.0f, 0.6f, 0.7f}});
  torch::Tensor targets = torch::tensor({2, 0, 1}, torch::kLong);
  auto at3 = retrieval_sums(scores, targets, 3);
  EXPECT_DOUBLE_EQ(at3.recall, 2);
  EXPECT_DOUBLE_EQ(at3.hit1, 1);
  EXPECT_NEAR(at3.ndcg, 1.0 + 1.0 / std::log2(4.0), 1e-12);
  EXPECT_DOUBLE_EQ(retrieval_sums(scores, targets, 1).recall, 1);
}

TEST(TwoTower, TowersGiveUnitVectorsAndNameTheirTables) {
  TwoTowerOptions o;
  o.num_users = 10;
  o.num_items = 7;
  o.user_feature_vocab = {3};
  o.item_feature_vocab = {4, 2};
  o.embedding_dim = 8;
  o.output_dim = 8;
  TwoTower model(o);
  auto u = model->user_embedding(torch::tensor({1, 9}, torch::kLong), torch::tensor({{0}, {2}}, torch::kLong));
  auto v = model->item_embedding(torch::tensor({6}, torch::kLong), torch::tensor({{3, 1}}, torch::kLong));
  EXPECT_EQ(u.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_TRUE(torch::allclose(u.norm(2, 1), torch::ones({2}), 1e-5, 1e-5));
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{1, 8}));
  std::set<std::string> names;
  for (const auto& p : model->named_parameters()) names.insert(p.key());
  for (const char* n : {"user_id.weight", "item_id.weight", "user_features.0.weight", "item_features.1.weight",
                        "user_mlp.layers.0.weight", "item_mlp.layers.2.bias"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  try {
    model->item_embedding(torch::tensor({7}, torch::kLong), torch::tensor({{0, 0}}, torch::kLong));
    ADD_FAILURE() << "an item id past the table must be an error";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("item_id"), std::string::npos) << e.what();
  }
}

TEST(ResNet18, TorchvisionNamesAndShapesForEveryStem) {
  for (const char* stem : {"imagenet", "pooled", "small"}) {
    ResNetOptions o;
    o.stem = stem;
    ResNet18 model(o);
    int64_t count = 0;
    std::set<std::string> names;
    for (const auto& p : model->named_parameters()) {
      count += p.value().numel();
      names.insert(p.key());
    }
    // torchvision resnet18 with a 1-channel conv1 and a 10-class fc.
    EXPECT_EQ(count, std::string(stem) == "imagenet" ? 11175370 : 11172810) << stem;
    for (const char* n : {"conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
                          "layer2.0.downsample.1.bias", "layer4.1.bn2.weight", "fc.weight"}) {
      EXPECT_TRUE(names.count(n)) << n;
    }
    std::set<std::string> buffers;
    for (const auto& b : model->named_buffers()) buffers.insert(b.key());
    EXPECT_TRUE(buffers.count("layer3.1.bn1.running_var"));
    auto out = model->forward(torch::randn({2, 1, 28, 28}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 10}));
  }
  EXPECT_THROW(ResNet18(ResNetOptions{3}).ptr()->forward(torch::randn({1, 1, 28, 28})), replica::Error);
}
