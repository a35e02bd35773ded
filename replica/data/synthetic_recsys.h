// Synthetic recommender interactions with planted structure, written as MDS or JSONL.
//
// Every user and every item belongs to one of `clusters` taste clusters (drawn at random).
// An interaction picks a user uniformly; with probability `affinity` its item is drawn
// uniformly from the user's cluster, else uniformly from all items. A model that learns the
// clusters reaches recall@10 of about affinity * 10 / (items / clusters), far above the
// 10 / items of random ranking (0.18 against 0.01 with the defaults).
// Columns: user_id (int64), item_id (int64), user_segment (int32: the user's cluster, replaced
// by a random one with probability 0.3, a noisy categorical feature) and item_category (int32:
// the item's cluster). The same seed gives the same interactions in either format.
#pragma once

#include <cstdint>
#include <string>

namespace replica::data {

struct SyntheticRecsysOptions {
  int64_t users = 2000;
  int64_t items = 1000;
  int64_t clusters = 20;
  int64_t train_samples = 50000;
  int64_t valid_samples = 2000;
  double affinity = 0.9;
  uint64_t seed = 0;
  std::string compression;  // "" or zstd[:LEVEL] (MDS only)
  std::string format = "mds";  // mds: OUT/train/ and OUT/valid/ (index.json + shards);
                               // jsonl: OUT/train.jsonl and OUT/valid.jsonl, one object a line
};

// Writes OUT/train and OUT/valid in `options.format`. replica::Error for bad sizes or format.
void write_synthetic_recsys(const std::string& out_dir, const SyntheticRecsysOptions& options);

}  // namespace replica::data
