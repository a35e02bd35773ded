#include "replica/data/synthetic_recsys.h"

#include "replica/core/error.h"
#include "replica/data/mds.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

namespace replica::data {

void write_synthetic_recsys(const std::string& out_dir, const SyntheticRecsysOptions& o) {
  if (o.users < 1 || o.items < 1 || o.clusters < 1 || o.clusters > o.items || o.clusters > o.users) {
    fail("synthetic recommender data: need users >= clusters >= 1 and items >= clusters (users {}, items {}, "
         "clusters {})",
         o.users, o.items, o.clusters);
  }
  if (o.train_samples < 1 || o.valid_samples < 0) fail("synthetic recommender data: train must be >= 1, valid >= 0");
  if (o.affinity < 0 || o.affinity > 1) fail("synthetic recommender data: affinity {} is not in [0, 1]", o.affinity);
  if (o.format != "mds" && o.format != "jsonl") fail("synthetic recommender data: format '{}' is not mds or jsonl", o.format);
  if (o.format == "jsonl" && !o.compression.empty()) fail("synthetic recommender data: compression is for format mds");
  std::mt19937_64 rng(o.seed);
  auto uniform = [&](int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); };
  std::uniform_real_distribution<double> coin(0.0, 1.0);

  // Items: cluster k holds a shuffled, near-equal share; users: a random cluster each.
  std::vector<int64_t> item_cluster(o.items), user_cluster(o.users), user_segment(o.users);
  std::vector<std::vector<int64_t>> members(o.clusters);
  std::vector<int64_t> perm(o.items);
  for (int64_t i = 0; i < o.items; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t i = 0; i < o.items; ++i) {
    item_cluster[perm[i]] = i % o.clusters;
    members[i % o.clusters].push_back(perm[i]);
  }
  for (int64_t u = 0; u < o.users; ++u) {
    user_cluster[u] = uniform(o.clusters);
    user_segment[u] = coin(rng) < 0.7 ? user_cluster[u] : uniform(o.clusters);
  }

  const std::vector<MdsColumn> columns = {
      {"user_id", "int64"}, {"item_id", "int64"}, {"user_segment", "int32"}, {"item_category", "int32"}};
  MdsWriterOptions options;
  options.compression = o.compression;
  options.size_limit = int64_t{1} << 20;  // a few shards, as a real data set has
  for (const auto& [split, count] : {std::pair<std::string, int64_t>{"train", o.train_samples},
                                     std::pair<std::string, int64_t>{"valid", o.valid_samples}}) {
    if (count == 0) continue;
    // Both formats take the same draws, so either holds the same interactions.
    std::vector<MdsSample> samples;
    samples.reserve(static_cast<size_t>(count));
    for (int64_t n = 0; n < count; ++n) {
      const int64_t user = uniform(o.users);
      const auto& own = members[user_cluster[user]];
      const int64_t item = coin(rng) < o.affinity ? own[uniform(static_cast<int64_t>(own.size()))] : uniform(o.items);
      samples.push_back({{"user_id", user}, {"item_id", item}, {"user_segment", user_segment[user]},
                         {"item_category", item_cluster[item]}});
    }
    if (o.format == "jsonl") {
      std::filesystem::create_directories(out_dir);
      const std::string file = (std::filesystem::path(out_dir) / (split + ".jsonl")).string();
      std::ofstream out(file, std::ios::trunc);
      for (const auto& sample : samples) {
        nlohmann::json j;
        for (const auto& [name, value] : sample) j[name] = std::get<int64_t>(value);
        out << j.dump() << '\n';
      }
      out.close();
      if (!out) fail("cannot write {}", file);
      continue;
    }
    const std::string dir = (std::filesystem::path(out_dir) / split).string();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    MdsWriter writer(dir, columns, options);
    for (const auto& sample : samples) writer.write(sample);
    writer.finish();
  }
}

}  // namespace replica::data
