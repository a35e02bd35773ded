// The two-tower recommender workload (task two-tower) on MDS shards.
#pragma once

#include "replica/train/workload.h"

namespace replica::train {

std::unique_ptr<Workload> make_two_tower(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg = nullptr);

// Checks made before any worker starts: the split directories hold MDS indexes with the id
// columns the configuration names.
void check_two_tower_config(const io::RunConfig& config);

}  // namespace replica::train
