// Task two-tower: a two-tower recommender on MDS shards; its own `params:` keys and its
// registration (the key table and the workload: two_tower.cpp).
#pragma once

#include "replica/train/run_config.h"
#include "replica/train/task.h"

#include <cstdint>
#include <vector>

namespace replica::train {

struct TwoTowerParams {
  std::vector<int64_t> hidden_sizes = {64};  // tower MLP
  int64_t embedding_dim = 32;
  double temperature = 0.05;
  int64_t top_k = 10;
};

inline const TwoTowerParams& two_tower_params(const RunConfig& config) { return config.task_params.get<TwoTowerParams>(); }
inline TwoTowerParams& two_tower_params(RunConfig& config) { return config.task_params.get<TwoTowerParams>(); }

// The task's registration (replica/tasks/registry.cpp).
TaskSpec two_tower_task();

}  // namespace replica::train
