#include "replica/models/two_tower.h"

#include "replica/core/error.h"

#include <torch/torch.h>

#include <cmath>

namespace replica::models {
namespace {

torch::nn::ModuleList make_tables(const std::vector<int64_t>& vocab, int64_t dim, const char* side) {
  torch::nn::ModuleList tables;
  for (size_t k = 0; k < vocab.size(); ++k) {
    if (vocab[k] < 1) fail("two-tower: {} feature {} has an empty vocabulary", side, k);
    tables->push_back(torch::nn::Embedding(torch::nn::EmbeddingOptions(vocab[k], dim)));
  }
  return tables;
}

void check_range(const torch::Tensor& values, int64_t size, const std::string& table) {
  if (values.numel() == 0) return;
  const int64_t lo = values.min().item<int64_t>(), hi = values.max().item<int64_t>();
  if (lo < 0 || hi >= size) fail("two-tower: value {} is outside table {} (size {})", lo < 0 ? lo : hi, table, size);
}

}  // namespace

TwoTowerImpl::TwoTowerImpl(TwoTowerOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (o.num_users < 1 || o.num_items < 1) fail("two-tower: num_users {} and num_items {} must be >= 1", o.num_users, o.num_items);
  if (o.embedding_dim < 1 || o.output_dim < 1) fail("two-tower: embedding_dim and output_dim must be >= 1");
  user_id_ = register_module("user_id", torch::nn::Embedding(torch::nn::EmbeddingOptions(o.num_users, o.embedding_dim)));
  item_id_ = register_module("item_id", torch::nn::Embedding(torch::nn::EmbeddingOptions(o.num_items, o.embedding_dim)));
  user_features_ = register_module("user_features", make_tables(o.user_feature_vocab, o.embedding_dim, "user"));
  item_features_ = register_module("item_features", make_tables(o.item_feature_vocab, o.embedding_dim, "item"));
  const auto user_in = o.embedding_dim * static_cast<int64_t>(1 + o.user_feature_vocab.size());
  const auto item_in = o.embedding_dim * static_cast<int64_t>(1 + o.item_feature_vocab.size());
  user_mlp_ = register_module("user_mlp", MLP(user_in, o.hidden_sizes, o.output_dim));
  item_mlp_ = register_module("item_mlp", MLP(item_in, o.hidden_sizes, o.output_dim));
}

torch::Tensor TwoTowerImpl::tower(const char* side, torch::nn::Embedding& id_table, torch::nn::ModuleList& tables,
                                  const std::vector<int64_t>& vocab, MLP& mlp, const torch::Tensor& ids,
                                  const torch::Tensor& features) {
  check_range(ids, id_table->options.num_embeddings(), fmt::format("{}_id", side));
  std::vector<torch::Tensor> parts{id_table->forward(ids)};
  if (!vocab.empty()) {
    if (!features.defined() || features.dim() != 2 || features.size(1) != static_cast<int64_t>(vocab.size()) ||
        features.size(0) != ids.size(0)) {
      fail("two-tower: {} features must be [{}, {}]", side, ids.size(0), vocab.size());
    }
    for (size_t k = 0; k < vocab.size(); ++k) {
      torch::Tensor column = features.select(1, static_cast<int64_t>(k));
      check_range(column, vocab[k], fmt::format("{}_features.{}", side, k));
      parts.push_back(tables[k]->as<torch::nn::Embedding>()->forward(column));
    }
  }
  return torch::nn::functional::normalize(mlp->forward(torch::cat(parts, 1)),
                                          torch::nn::functional::NormalizeFuncOptions().dim(1));
}

torch::Tensor TwoTowerImpl::user_embedding(const torch::Tensor& ids, const torch::Tensor& features) {
  return tower("user", user_id_, user_features_, options_.user_feature_vocab, user_mlp_, ids, features);
}

torch::Tensor TwoTowerImpl::item_embedding(const torch::Tensor& ids, const torch::Tensor& features) {
  return tower("item", item_id_, item_features_, options_.item_feature_vocab, item_mlp_, ids, features);
}

torch::Tensor in_batch_softmax_loss(const torch::Tensor& users, const torch::Tensor& items, double temperature,
                                    int64_t first_row) {
  if (!(temperature > 0)) fail("two-tower: temperature must be > 0, got {}", temperature);
  if (users.size(0) + first_row > items.size(0)) fail("two-tower: {} rows from {} exceed {} items", users.size(0), first_row, items.size(0));
  torch::Tensor scores = torch::matmul(users, items.t()) / temperature;
  torch::Tensor targets =
      torch::arange(first_row, first_row + users.size(0), torch::TensorOptions(torch::kLong).device(users.device()));
  return torch::nn::functional::cross_entropy(scores, targets);
}

RetrievalSums retrieval_sums(const torch::Tensor& scores, const torch::Tensor& targets, int64_t k) {
  RetrievalSums sums;
  if (scores.size(0) == 0) return sums;
  // Rank of the target = number of items scoring strictly higher (ties in the target's favour).
  torch::Tensor target_scores = scores.gather(1, targets.unsqueeze(1));
  torch::Tensor ranks = scores.gt(target_scores).sum(1).cpu();  // read on the host below
  auto r = ranks.accessor<int64_t, 1>();
  for (int64_t q = 0; q < ranks.size(0); ++q) {
    if (r[q] < k) {
      sums.recall += 1;
      sums.ndcg += 1.0 / std::log2(static_cast<double>(r[q]) + 2.0);
    }
    if (r[q] == 0) sums.hit1 += 1;
  }
  return sums;
}

}  // namespace replica::models
