// Two-tower recommender (task two-tower) on MDS shards or JSONL.
//
// Data: data.path holds one MDS data set per split (data.path/<split>/index.json), or is the
// training split itself (data.path/index.json); or it holds <split>.jsonl (or .csv) per split,
// or is one .jsonl file (the training split only). Each sample is one interaction: a user id
// column (column_mapping.user_column, default user_id) and an item id column
// (column_mapping.item_column, default item_id), both integers; every other integer column
// (MDS: an integer encoding; JSONL: an integer in the first record) whose name starts with
// "user_" or "item_" is a categorical feature of that tower (its value is the embedding row).
// Ids and feature values are 0-based; the tables are sized by the largest value in the
// training and validation splits. Both sources load into the same in-memory columns, so
// everything after loading (sharding by the sampler, resume) is one code path.
//
// Training: in-batch negatives softmax loss with a temperature. With more than one worker,
// item embeddings are gathered from every rank (with gradient) so that the negatives of each
// row are the whole global batch: world W with batch B/W trains exactly as world 1 with B.
// Evaluation: each validation interaction is a query (its user) with one relevant item,
// ranked against every item of the catalogue: eval_recall_at_K, eval_ndcg_at_K, eval_accuracy
// (the relevant item ranked first) and eval_loss (full-softmax cross-entropy).
#include "replica/tasks/two_tower/two_tower.h"
#include "replica/train/task.h"
#include "replica/train/workload.h"

#include "replica/core/error.h"
#include "replica/core/json.h"
#include "replica/data/mds.h"
#include "replica/data/records.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/models/two_tower.h"

#include <torch/torch.h>

#include <filesystem>
#include <limits>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

// Ids and feature values index embedding tables: a larger one would ask for a table no
// machine holds, so it is refused with the line that holds it instead.
constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();

std::string column_or(const RunConfig& config, const char* key, const char* fallback) {
  auto it = config.data.column_mapping.find(key);
  return it == config.data.column_mapping.end() ? fallback : it->second;
}

bool is_integer_encoding(const std::string& e) {
  return e == "int" || e.rfind("int", 0) == 0 || e.rfind("uint", 0) == 0;
}

bool is_feature_of_a_tower(const std::string& name) {
  return name.rfind("user_", 0) == 0 || name.rfind("item_", 0) == 0;
}

// Where a split's interactions are: an MDS data set directory, or a JSONL/CSV file.
struct SplitSource {
  bool mds = false;
  std::string path;
};

SplitSource find_split(const RunConfig& config, const std::string& split) {
  const fs::path base(config.data.path);
  const bool is_train = split == config.data.train_split;
  std::error_code ec;
  if (fs::is_regular_file(base, ec)) {
    if (base.filename() == "index.json") return {true, base.parent_path().string()};
    if (!is_train) {
      fail("data.path '{}' is one file, which holds only the training split; set data.valid_split: null or make "
           "data.path a directory holding {}.jsonl (or {}/index.json)",
           config.data.path, split, split);
    }
    return {false, base.string()};
  }
  if (!fs::is_directory(base, ec)) fail("data.path '{}' does not exist", config.data.path);
  if (fs::exists(base / split / "index.json")) return {true, (base / split).string()};
  if (is_train && fs::exists(base / "index.json")) return {true, base.string()};
  for (const char* ext : {".jsonl", ".json", ".csv"}) {
    if (fs::is_regular_file(base / (split + ext), ec)) return {false, (base / (split + ext)).string()};
  }
  fail("data.path '{}': no data for split '{}' (expected MDS {}/{}/index.json or {}/{}.jsonl; write one with "
       "`replica mds synthetic [--format jsonl]` or `replica mds convert`)",
       config.data.path, split, config.data.path, split, config.data.path, split);
}

// The columns the workload reads: the ids, then the features of each tower (sorted by name,
// as MDS stores columns, so both sources build the same model).
struct ColumnNames {
  std::string user, item;
  std::vector<std::string> user_features, item_features;
  std::vector<std::string> all() const {
    std::vector<std::string> out = {user, item};
    out.insert(out.end(), user_features.begin(), user_features.end());
    out.insert(out.end(), item_features.begin(), item_features.end());
    return out;
  }
  void add_feature(const std::string& name) {
    if (name == user || name == item || !is_feature_of_a_tower(name)) return;
    (name.rfind("user_", 0) == 0 ? user_features : item_features).push_back(name);
  }
  void sort_features() {
    std::sort(user_features.begin(), user_features.end());
    std::sort(item_features.begin(), item_features.end());
  }
};

// The integer columns of a split, read into memory: [N] per column.
struct Interactions {
  std::map<std::string, torch::Tensor> columns;
  int64_t size = 0;
};

std::string mds_column_list(const data::MdsDataset& ds) {
  std::string out;
  for (const auto& c : ds.columns()) out += (out.empty() ? "" : ", ") + c.name;
  return out;
}

// `discover`: this is the training split; its feature columns are added to `names`.
// Otherwise every column of `names` must be there.
Interactions read_mds_split(const std::string& dir, ColumnNames& names, bool discover, bool read_values = true) {
  const data::MdsDataset ds(dir);
  for (const auto& [name, label] : {std::pair{names.user, "user_column"}, std::pair{names.item, "item_column"}}) {
    if (!ds.has_column(name)) {
      fail("{}: column '{}' (data.column_mapping.{}) is not in the data set (columns: {})", ds.path(), name, label,
           mds_column_list(ds));
    }
  }
  if (discover) {
    for (const auto& c : ds.columns()) {
      if (is_integer_encoding(c.encoding)) names.add_feature(c.name);
    }
    names.sort_features();
  }
  const std::vector<std::string> wanted = names.all();
  for (const auto& n : wanted) {
    const auto& cols = ds.columns();
    auto it = std::find_if(cols.begin(), cols.end(), [&](const auto& c) { return c.name == n; });
    if (it == cols.end()) fail("{}: column '{}' of the training split is missing", ds.path(), n);
    if (!is_integer_encoding(it->encoding)) fail("{}: column '{}' is {}, not an integer encoding", ds.path(), n, it->encoding);
  }
  Interactions out;
  if (!read_values) return out;
  out.size = ds.size();
  std::vector<torch::Tensor> cols;
  for (size_t c = 0; c < wanted.size(); ++c) cols.push_back(torch::empty({ds.size()}, torch::kLong));
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto sample = ds.get(i);
    for (size_t c = 0; c < wanted.size(); ++c) {
      const int64_t v = std::get<int64_t>(sample.at(wanted[c]));
      if (v < 0 || v > kMaxId) {
        fail("MDS '{}': sample {}: {} {} is out of range (0 to {})", ds.path(), i, wanted[c], v, kMaxId);
      }
      cols[c].data_ptr<int64_t>()[i] = v;
    }
  }
  for (size_t c = 0; c < wanted.size(); ++c) out.columns[wanted[c]] = cols[c];
  return out;
}

// A JSONL value of an id or feature column: a JSON integer; in a CSV file, whose cells are
// text, a decimal integer. nullopt for anything else.
std::optional<int64_t> integer_value(const nlohmann::json& v, bool csv) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::numeric_limits<int64_t>::max();
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (csv && v.is_string()) {
    const std::string text = v.get<std::string>();
    try {
      size_t used = 0;
      const long long parsed = std::stoll(text, &used);
      if (used == text.size()) return parsed;
    } catch (const std::out_of_range&) {
      return text.front() == '-' ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
    } catch (const std::exception&) {
    }
  }
  return std::nullopt;
}

// The same as read_mds_split for a JSONL (or CSV) file: the features are the integer
// user_*/item_* fields of its first record; every record must hold every column.
Interactions read_records_split(const std::string& file, ColumnNames& names, bool discover) {
  const auto records = data::read_numbered_records(file);
  if (records.empty()) fail("{}: no records", file);
  const bool csv = file.size() >= 4 && file.compare(file.size() - 4, 4, ".csv") == 0;
  if (discover) {
    for (const auto& [key, value] : records.front().value.items()) {
      if (integer_value(value, csv)) names.add_feature(key);
    }
    names.sort_features();
  }
  const std::vector<std::string> wanted = names.all();
  Interactions out;
  out.size = static_cast<int64_t>(records.size());
  std::vector<torch::Tensor> cols;
  for (size_t c = 0; c < wanted.size(); ++c) cols.push_back(torch::empty({out.size}, torch::kLong));
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& [record, line] = records[i];
    for (size_t c = 0; c < wanted.size(); ++c) {
      const std::string& key = wanted[c];
      const char* role = key == names.user ? " (data.column_mapping.user_column)"
                         : key == names.item ? " (data.column_mapping.item_column)"
                                             : " (a feature column of the training split)";
      auto it = record.find(key);
      if (it == record.end()) fail("{}:{}: key '{}'{} is missing", file, line, key, role);
      const std::optional<int64_t> v = integer_value(*it, csv);
      if (!v) fail("{}:{}: key '{}': {} is not an integer id", file, line, key, json_excerpt(*it));
      if (*v < 0 || *v > kMaxId) {
        fail("{}:{}: key '{}': id {} is out of range (0 to {})", file, line, key, json_excerpt(*it), kMaxId);
      }
      cols[c].data_ptr<int64_t>()[i] = *v;
    }
  }
  for (size_t c = 0; c < wanted.size(); ++c) out.columns[wanted[c]] = cols[c];
  return out;
}

Interactions read_split(const RunConfig& config, const std::string& split, ColumnNames& names, bool discover) {
  const SplitSource source = find_split(config, split);
  Interactions out =
      source.mds ? read_mds_split(source.path, names, discover) : read_records_split(source.path, names, discover);
  if (out.size == 0) fail("{}: split '{}' holds no interactions", source.path, split);
  return out;
}

// The tables are sized by the data's largest ids and the towers by the keys: their parameters
// together are bounded before anything is allocated (models/mlp.h: Note [model size bounds]),
// naming what sized them.
void check_model_size(const models::TwoTowerOptions& o, const std::string& where) {
  int64_t rows = 0;
  for (int64_t v : o.user_feature_vocab) rows += v;  // each <= 2^31: no overflow
  for (int64_t v : o.item_feature_vocab) rows += v;
  const int64_t table_rows = o.num_users + o.num_items + rows;
  const int64_t in_features = o.embedding_dim * static_cast<int64_t>(1 + std::max(o.user_feature_vocab.size(),
                                                                                     o.item_feature_vocab.size()));
  const int64_t towers = models::mlp_parameter_count(in_features, o.hidden_sizes, o.output_dim);
  int64_t total = 0;
  if (__builtin_mul_overflow(table_rows, o.embedding_dim, &total) || __builtin_add_overflow(total, towers, &total) ||
      __builtin_add_overflow(total, towers, &total) || total > models::kMaxModelParameters) {
    fail("{}: the two-tower model would hold more than {} parameters: {} embedding rows (num_users {} and num_items "
         "{} from the largest ids in the data, plus the feature tables) of key 'params.embedding_dim' {}, and towers "
         "of key 'params.hidden_sizes' [{}]",
         where, models::kMaxModelParameters, table_rows, o.num_users, o.num_items, o.embedding_dim,
         fmt::join(o.hidden_sizes, ", "));
  }
}

ColumnNames id_columns(const RunConfig& config) {
  ColumnNames names;
  names.user = column_or(config, "user_column", "user_id");
  names.item = column_or(config, "item_column", "item_id");
  return names;
}

class TwoTowerWorkload final : public Workload {
 public:
  TwoTowerWorkload(const RunConfig& config, const WorkloadContext& context)
      : context_(context), pg_(context.pg), temperature_(two_tower_params(config).temperature), top_k_(two_tower_params(config).top_k) {
    ColumnNames names = id_columns(config);
    train_ = read_split(config, config.data.train_split, names, /*discover=*/true);
    if (config.data.valid_split) valid_ = read_split(config, *config.data.valid_split, names, /*discover=*/false);
    user_column_ = names.user;
    item_column_ = names.item;
    user_features_ = names.user_features;
    item_features_ = names.item_features;

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
    o.embedding_dim = two_tower_params(config).embedding_dim;
    o.output_dim = two_tower_params(config).embedding_dim;
    o.hidden_sizes = two_tower_params(config).hidden_sizes;
    check_model_size(o, config.source.empty() ? "config" : config.source);
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
    const auto& c = context_;
    torch::Tensor users = model_->user_embedding(c.on_device(train_.columns[user_column_].index_select(0, rows)),
                                                 c.on_device(features(train_, user_features_, rows)));
    torch::Tensor items = model_->item_embedding(c.on_device(train_.columns[item_column_].index_select(0, rows)),
                                                 c.on_device(features(train_, item_features_, rows)));
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
    const auto& c = context_;
    torch::Tensor all_items = model_->item_embedding(c.on_device(torch::arange(num_items, torch::kLong)),
                                                     item_features_.empty() ? torch::Tensor() : c.on_device(catalogue_));
    const std::string k = std::to_string(top_k_);
    sums.extra["recall_at_" + k] = 0;
    sums.extra["ndcg_at_" + k] = 0;
    const size_t chunk = 512;
    for (size_t begin = 0; begin < indices.size(); begin += chunk) {
      std::vector<int64_t> part(indices.begin() + begin, indices.begin() + std::min(indices.size(), begin + chunk));
      const torch::Tensor rows = torch::tensor(part, torch::kLong);
      torch::Tensor users = model_->user_embedding(c.on_device(valid_.columns[user_column_].index_select(0, rows)),
                                                   c.on_device(features(valid_, user_features_, rows)));
      torch::Tensor targets = c.on_device(valid_.columns[item_column_].index_select(0, rows));
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
  // [rows, F] feature values of the given rows (all rows when `rows` is undefined); undefined when F is 0.
  static torch::Tensor features(Interactions& part, const std::vector<std::string>& names, const torch::Tensor& rows) {
    if (names.empty()) return {};
    std::vector<torch::Tensor> cols;
    for (const auto& n : names) cols.push_back(rows.defined() ? part.columns[n].index_select(0, rows) : part.columns[n]);
    return torch::stack(cols, 1);
  }

  WorkloadContext context_;
  std::shared_ptr<distributed::ProcessGroup> pg_;
  double temperature_;
  int64_t top_k_;
  std::string user_column_, item_column_;
  std::vector<std::string> user_features_, item_features_;
  Interactions train_, valid_;
  torch::Tensor catalogue_;
  models::TwoTower model_{nullptr};
};

}  // namespace

// Checks made before any worker starts: every split has data (an MDS index with the id
// columns the configuration names, or a JSONL/CSV file whose every line holds valid ids).
void check_two_tower_config(const RunConfig& config) {
  // MDS: the index and the id columns (reading every sample is left to the workers); JSONL:
  // every line, so that a bad value is reported with its line before any worker starts.
  ColumnNames names = id_columns(config);
  for (const auto& split : {std::optional<std::string>(config.data.train_split), config.data.valid_split}) {
    if (!split) continue;
    const SplitSource source = find_split(config, *split);
    const bool discover = *split == config.data.train_split;
    if (source.mds) {
      read_mds_split(source.path, names, discover, /*read_values=*/false);
    } else {
      read_records_split(source.path, names, discover);
    }
  }
}

TaskSpec two_tower_task() {
  TaskSpec t;
  t.name = "two-tower";
  t.params = TaskParams(TwoTowerParams{});
  t.columns = {"user_column", "item_column"};
  t.summary = "a two-tower recommender (user and item towers, in-batch softmax) on MDS shards or JSONL";
  t.models = {"two-tower"};
  using T = TwoTowerParams;
  t.keys = {
      key("hidden_sizes", &T::hidden_sizes, "widths of each tower's hidden layers")
          .group("Model")
          .check(models::layer_widths_problem),
      key("embedding_dim", &T::embedding_dim, "id and feature embeddings; also each tower's output")
          .group("Model")
          .at_least(1)
          .check([](const int64_t& d) {
            return d > models::kMaxLayerWidth ? fmt::format("must be <= {}, got {}", models::kMaxLayerWidth, d)
                                              : std::string();
          }),
      key("temperature", &T::temperature, "in-batch softmax temperature").group("Model").positive(),
      key("top_k", &T::top_k, "k of eval_recall_at_k and eval_ndcg_at_k").group("Model").at_least(1),
  };
  t.defaults = [](RunConfig& c) {
    c.data.valid_split = "valid";  // the split directories `replica mds synthetic` writes
    c.params.batch_size = 128;     // in-batch negatives: a larger batch, more negatives
  };
  t.check = check_two_tower_config;
  t.make = [](const RunConfig& config, const WorkloadContext& context) -> std::unique_ptr<Workload> {
    return std::make_unique<TwoTowerWorkload>(config, context);
  };
  return t;
}

}  // namespace replica::train
