// A two-tower retrieval model: a user tower and an item tower, each an embedding table for
// the id plus one per categorical feature, concatenated and mapped by an MLP to a shared
// space; the score of (user, item) is the dot product of the L2-normalised tower outputs.
//
// Parameter names (stable; checkpoints key on them):
//   user_id.weight [num_users, embedding_dim]   user_features.K.weight [vocab_K, embedding_dim]
//   item_id.weight [num_items, embedding_dim]   item_features.K.weight [vocab_K, embedding_dim]
//   user_mlp.layers.*   item_mlp.layers.*       (models::MLP)
// An id or feature value outside its table is a replica::Error naming the table.
#pragma once

#include "replica/models/mlp.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/types.h>

#include <vector>

namespace replica::models {

struct TwoTowerOptions {
  int64_t num_users = 0;
  int64_t num_items = 0;
  std::vector<int64_t> user_feature_vocab;  // one table per user categorical feature
  std::vector<int64_t> item_feature_vocab;
  int64_t embedding_dim = 32;
  std::vector<int64_t> hidden_sizes = {64};
  int64_t output_dim = 32;
};

class TwoTowerImpl : public torch::nn::Module {
 public:
  explicit TwoTowerImpl(TwoTowerOptions options);
  // ids [B] int64, features [B, F] int64 (F = number of that tower's feature tables; may be
  // undefined when F is 0). Returns unit vectors [B, output_dim].
  torch::Tensor user_embedding(const torch::Tensor& ids, const torch::Tensor& features);
  torch::Tensor item_embedding(const torch::Tensor& ids, const torch::Tensor& features);
  const TwoTowerOptions& options() const { return options_; }

 private:
  torch::Tensor tower(const char* side, torch::nn::Embedding& id_table, torch::nn::ModuleList& tables,
                      const std::vector<int64_t>& vocab, MLP& mlp, const torch::Tensor& ids,
                      const torch::Tensor& features);
  TwoTowerOptions options_;
  torch::nn::Embedding user_id_{nullptr}, item_id_{nullptr};
  torch::nn::ModuleList user_features_{nullptr}, item_features_{nullptr};
  MLP user_mlp_{nullptr}, item_mlp_{nullptr};
};
TORCH_MODULE(TwoTower);

// In-batch negatives softmax loss (sampled softmax as in YouTube/Google two-tower papers):
// row r's positive is column r of scores = users @ items^T / temperature; every other item of
// the batch is a negative. Mean over rows. `first_row` shifts the positive column when
// `items` holds a larger (gathered) batch than `users`: row r's positive is first_row + r.
torch::Tensor in_batch_softmax_loss(const torch::Tensor& users, const torch::Tensor& items, double temperature,
                                    int64_t first_row = 0);

// Retrieval metrics of queries against a full catalogue: `scores` [Q, num_items], `targets`
// [Q] the one relevant item of each query. Sums over queries (the caller divides):
struct RetrievalSums {
  double recall = 0;  // queries whose target ranks within the top k
  double ndcg = 0;    // sum of 1 / log2(rank + 2) for targets within the top k (rank from 0)
  double hit1 = 0;    // queries whose target is the top item
};
RetrievalSums retrieval_sums(const torch::Tensor& scores, const torch::Tensor& targets, int64_t k);

}  // namespace replica::models
