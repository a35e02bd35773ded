// Two-tower recommender (task two-tower) on MDS shards.
//
// Data: data.path holds one MDS data set per split (data.path/<split>/index.json), or is the
// training split itself (data.path/index.json). Each sample is one interaction: a user id
// column (column_mapping.user_column, default user_id) and an item id column
// (column_mapping.item_column, default item_id), both integer-encoded; every other
// integer-encoded column whose name starts with "user_" or "item_" is a categorical feature of
// that tower (its value is the embedding row). Ids and feature values are 0-based; the tables
// are sized by the largest value in the training and validation splits.
//
// Training: in-batch negatives softmax loss with a temperature. With more than one worker,
// item embeddings are gathered from every rank (with gradient) so that the negatives of each
// row are the whole global batch: world W with batch B/W trains exactly as world 1 with B.
// Evaluation: each validation interaction is a query (its user) with one relevant item,
// ranked against every item of the catalogue: eval_recall_at_K, eval_ndcg_at_K, eval_accuracy
// (the relevant item ranked first) and eval_loss (full-softmax cross-entropy).
#include "replica/train/two_tower.h"

#include "replica/core/error.h"
#include "replica/data/mds.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/models/two_tower.h"

#include <torch/torch.h>

#include <filesystem>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

std::string split_dir(const io::RunConfig& config, const std::string& split) {
  const fs::path base(config.data.path);
  if (fs::exists(base / split / "index.json")) return (base / split).string();
  if (split == config.data.train_split && fs::exists(base / "index.json")) return base.string();
  fail("data.path '{}': no MDS data set for split '{}' (expected {}/{}/index.json; write one with `replica mds "
       "convert` or `replica mds synthetic`)",
       config.data.path, split, config.data.path, split);
}

std::string column_or(const io::RunConfig& config, const char* key, const char* fallback) {
  auto it = config.data.column_mapping.find(key);
  return it == config.data.column_mapping.end() ? fallback : it->second;
}

bool is_integer_encoding(const std::string& e) {
  return e == "int" || e.rfind("int", 0) == 0 || e.rfind("uint", 0) == 0;
}

// The integer columns of a split, read into memory: [N] per column.
struct Interactions {
  std::map<std::string, torch::Tensor> columns;
  int64_t size = 0;
};

Interactions read_interactions(const data::MdsDataset& ds, const std::vector<std::string>& names) {
  Interactions out;
  out.size = ds.size();
  std::vector<torch::Tensor> cols;
  for (size_t c = 0; c < names.size(); ++c) cols.push_back(torch::empty({ds.size()}, torch::kLong));
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto sample = ds.get(i);
    for (size_t c = 0; c < names.size(); ++c) {
      const int64_t v = std::get<int64_t>(sample.at(names[c]));
      if (v < 0) fail("MDS '{}': sample {} has negative {} {}", ds.path(), i, names[c], v);
      cols[c].data_ptr<int64_t>()[i] = v;
    }
  }
  for (size_t c = 0; c < names.size(); ++c) out.columns[names[c]] = cols[c];
  return out;
}

class TwoTowerWorkload final : public Workload {
 public:
  TwoTowerWorkload(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg)
      : pg_(std::move(pg)), temperature_(config.params.temperature), top_k_(config.params.top_k) {
    user_column_ = column_or(config, "user_column", "user_id");
    item_column_ = column_or(config, "item_column", "item_id");
    const data::MdsDataset train(split_dir(config, config.data.train_split));
    for (const auto& [name, label] : {std::pair{user_column_, "user_column"}, std::pair{item_column_, "item_column"}}) {
      if (!train.has_column(name)) {
        fail("{}: column '{}' (data.column_mapping.{}) is not in the data set (columns: {})", train.path(), name, label,
             column_list(train));
      }
    }
    std::vector<std::string> names = {user_column_, item_column_};
    for (const auto& c : train.columns()) {
      if (!is_integer_encoding(c.encoding) || c.name == user_column_ || c.name == item_column_) continue;
      if (c.name.rfind("user_", 0) == 0) user_features_.push_back(c.name);
      if (c.name.rfind("item_", 0) == 0) item_features_.push_back(c.name);
    }
    for (const auto& f : user_features_) names.push_back(f);
    for (const auto& f : item_features_) names.push_back(f);
    for (const auto& n : names) {
      const auto& cols = train.columns();
      auto it = std::find_if(cols.begin(), cols.end(), [&](const auto& c) { return c.name == n; });
      if (!is_integer_encoding(it->encoding)) fail("{}: column '{}' is {}, not an integer encoding", train.path(), n, it->encoding);
    }
    train_ = read_interactions(train, names);
    if (config.data.valid_split) {
      const data::MdsDataset valid(split_dir(config, *config.data.valid_split));
      for (const auto& n : names) {
        if (!valid.has_column(n)) fail("{}: column '{}' of the training split is missing", valid.path(), n);
      }
      valid_ = read_interactions(valid, names);
    }

    auto vocab = [&](const std::string& column) {
      int64_t top = train_.columns[column].max().item<int64_t>();
      if (valid_.size > 0) top = std::max(top, valid_.columns[column].max().item<int64_t>());
      return top + 1;
    };
    models::TwoTowerOptions o;
    o.num_users = vocab(user_column_);
    o.num_items = vocab(item_column_);
    for (const auto& f : user_features_) o.user_feature_vocab.push_back(vocab(f));
    for (const auto& f : item_features_) o.item_feature_vocab.push_back(vocab(f));
    o.embedding_dim = config.params.embedding_dim;
    o.output_dim = config.params.embedding_dim;
    o.hidden_sizes = config.params.hidden_sizes;
    model_ = models::TwoTower(o);

    // The catalogue: every item's features (the last value seen; items never seen keep 0).
    catalogue_ = torch::zeros({o.num_items, static_cast<int64_t>(item_features_.size())}, torch::kLong);
    for (Interactions* part : {&train_, &valid_}) {
      if (part->size == 0 || item_features_.empty()) continue;
      catalogue_.index_copy_(0, part->columns[item_column_], features(*part, item_features_, torch::Tensor()));
    }
  }

  std::shared_ptr<torch::nn::Module> model() override { return model_.ptr(); }
  int64_t train_size() const override { return train_.size; }
  int64_t valid_size() const override { return valid_.size; }

  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    const torch::Tensor rows = torch::tensor(indices, torch::kLong);
    torch::Tensor users = model_->user_embedding(train_.columns[user_column_].index_select(0, rows),
                                                 features(train_, user_features_, rows));
    torch::Tensor items = model_->item_embedding(train_.columns[item_column_].index_select(0, rows),
                                                 features(train_, item_features_, rows));
    if (pg_ && pg_->size() > 1) {
      // Negatives from the whole global batch; every rank holds the same number of rows.
      torch::Tensor all_items = ddp::all_gather_with_grad(items, *pg_);
      return models::in_batch_softmax_loss(users, all_items, temperature_, pg_->rank() * users.size(0));
    }
    return models::in_batch_softmax_loss(users, items, temperature_);
  }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    const int64_t num_items = model_->options().num_items;
    torch::Tensor all_items =
        model_->item_embedding(torch::arange(num_items, torch::kLong), item_features_.empty() ? torch::Tensor() : catalogue_);
    const std::string k = std::to_string(top_k_);
    sums.extra["recall_at_" + k] = 0;
    sums.extra["ndcg_at_" + k] = 0;
    const size_t chunk = 512;
    for (size_t begin = 0; begin < indices.size(); begin += chunk) {
      std::vector<int64_t> part(indices.begin() + begin, indices.begin() + std::min(indices.size(), begin + chunk));
      const torch::Tensor rows = torch::tensor(part, torch::kLong);
      torch::Tensor users = model_->user_embedding(valid_.columns[user_column_].index_select(0, rows),
                                                   features(valid_, user_features_, rows));
      torch::Tensor targets = valid_.columns[item_column_].index_select(0, rows);
      torch::Tensor scores = torch::matmul(users, all_items.t());
      sums.loss_sum += torch::nn::functional::cross_entropy(
                           scores / temperature_, targets,
                           torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                           .item<double>();
      const auto r = models::retrieval_sums(scores, targets, top_k_);
      sums.correct += r.hit1;
      sums.extra["recall_at_" + k] += r.recall;
      sums.extra["ndcg_at_" + k] += r.ndcg;
      sums.count += static_cast<double>(part.size());
    }
    return sums;
  }

  nlohmann::json model_config() const override {
    const auto& o = model_->options();
    return {{"model_type", "two-tower"},
            {"num_users", o.num_users},
            {"num_items", o.num_items},
            {"user_column", user_column_},
            {"item_column", item_column_},
            {"user_features", user_features_},
            {"item_features", item_features_},
            {"user_feature_vocab", o.user_feature_vocab},
            {"item_feature_vocab", o.item_feature_vocab},
            {"embedding_dim", o.embedding_dim},
            {"hidden_sizes", o.hidden_sizes},
            {"temperature", temperature_},
            {"library", "replica"}};
  }

 private:
  static std::string column_list(const data::MdsDataset& ds) {
    std::string out;
    for (const auto& c : ds.columns()) out += (out.empty() ? "" : ", ") + c.name;
    return out;
  }

  // [rows, F] feature values of the given rows (all rows when `rows` is undefined); undefined when F is 0.
  static torch::Tensor features(Interactions& part, const std::vector<std::string>& names, const torch::Tensor& rows) {
    if (names.empty()) return {};
    std::vector<torch::Tensor> cols;
    for (const auto& n : names) cols.push_back(rows.defined() ? part.columns[n].index_select(0, rows) : part.columns[n]);
    return torch::stack(cols, 1);
  }

  std::shared_ptr<dist::ProcessGroup> pg_;
  double temperature_;
  int64_t top_k_;
  std::string user_column_, item_column_;
  std::vector<std::string> user_features_, item_features_;
  Interactions train_, valid_;
  torch::Tensor catalogue_;
  models::TwoTower model_{nullptr};
};

}  // namespace

std::unique_ptr<Workload> make_two_tower(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg) {
  return std::make_unique<TwoTowerWorkload>(config, std::move(pg));
}

void check_two_tower_config(const io::RunConfig& config) {
  for (const auto& split : {std::optional<std::string>(config.data.train_split), config.data.valid_split}) {
    if (!split) continue;
    const data::MdsDataset ds(split_dir(config, *split));
    for (const auto& [key, fallback] : {std::pair{"user_column", "user_id"}, std::pair{"item_column", "item_id"}}) {
      const std::string name = column_or(config, key, fallback);
      if (!ds.has_column(name)) {
        fail("{}: column '{}' (data.column_mapping.{}) is not in the data set (columns: {})", ds.path(), name, key,
             [&] {
               std::string out;
               for (const auto& c : ds.columns()) out += (out.empty() ? "" : ", ") + c.name;
               return out;
             }());
      }
    }
  }
}

}  // namespace replica::train
