// The two-tower recommender workload (task two-tower) on MDS shards or JSONL.
#pragma once

#include "replica/train/workload.h"

namespace replica::train {

std::unique_ptr<Workload> make_two_tower(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg = nullptr);

// Checks made before any worker starts: every split has data (an MDS index with the id
// columns the configuration names, or a JSONL/CSV file whose every line holds valid ids).
void check_two_tower_config(const io::RunConfig& config);

}  // namespace replica::train
