// `replica mds convert` (JSONL/CSV -> MDS shards) and `replica mds synthetic` (the planted
// recommender data set of the two-tower demo).
#pragma once

#include <CLI/CLI.hpp>

#include <memory>

namespace replica::cli {

struct MdsCommand;

// Registers `mds convert` and `mds synthetic` under `mds`; run_mds_command runs whichever was given.
std::shared_ptr<MdsCommand> add_mds_command(CLI::App& mds);
int run_mds_command(const MdsCommand& command);

}  // namespace replica::cli
