// Conformance: replica::data::DistributedSampler against torch.utils.data.DistributedSampler,
// live (the PyTorch of REPLICA_PYTHON), over a grid of data set sizes, world sizes, every rank,
// seeds (including ones above 2^63, which torch takes as uint64), epochs, shuffle and
// drop_last. sampler_test.cpp keeps the constants made once with PyTorch 1.13 and runs without
// Python.
#include "replica/data/sampler.h"
#include "replica/testing/paths.h"
#include "replica/testing/referee.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct TempDir : replica::testing::ScratchDir {
  TempDir() : ScratchDir("replica-sampler-conformance") {}
};

struct Case {
  int64_t n;
  int world, rank;
  bool shuffle;
  uint64_t seed;
  bool drop_last;
  int64_t epoch;
};

std::string describe(const Case& c) {
  return "n " + std::to_string(c.n) + " world " + std::to_string(c.world) + " rank " + std::to_string(c.rank) +
         " shuffle " + std::to_string(c.shuffle) + " seed " + std::to_string(c.seed) + " drop_last " +
         std::to_string(c.drop_last) + " epoch " + std::to_string(c.epoch);
}

}  // namespace

TEST(SamplerConformance, OrderEqualsTorchDistributedSamplerOverAGrid) {
  REPLICA_REQUIRE_PYTHON("torch");
  std::vector<Case> cases;
  const int64_t sizes[] = {0, 1, 2, 3, 7, 10, 16, 33, 100, 1001};
  const int worlds[] = {1, 2, 3, 4, 8};
  // 2^63 + 5: a seed torch takes as uint64 (seed + epoch stays below 2^64 for every epoch here).
  const uint64_t seeds[] = {0, 42, (uint64_t{1} << 63) + 5};
  const int64_t epochs[] = {0, 1, 9};
  for (int64_t n : sizes) {
    for (int world : worlds) {
      for (int rank = 0; rank < world; ++rank) {
        for (bool drop_last : {false, true}) {
          // Without shuffle the order depends on neither seed nor epoch: one of each is enough.
          cases.push_back({n, world, rank, false, 0, drop_last, 0});
          cases.push_back({n, world, rank, false, 42, drop_last, 3});
          for (uint64_t seed : seeds) {
            for (int64_t epoch : epochs) cases.push_back({n, world, rank, true, seed, drop_last, epoch});
          }
        }
      }
    }
  }
  // Data set sizes of real runs (Fashion-MNIST's 60000, and a prime), first and last rank.
  for (int64_t n : {int64_t{60000}, int64_t{100003}}) {
    for (int world : {1, 3}) {
      for (int rank : {0, world - 1}) {
        for (bool drop_last : {false, true}) {
          cases.push_back({n, world, rank, true, 42, drop_last, 0});
          cases.push_back({n, world, rank, true, 42, drop_last, 3});
        }
      }
    }
  }

  TempDir dir;
  json in = json::array();
  for (const Case& c : cases) {
    in.push_back({{"n", c.n}, {"world", c.world}, {"rank", c.rank}, {"shuffle", c.shuffle}, {"seed", c.seed},
                  {"drop_last", c.drop_last}, {"epoch", c.epoch}});
  }
  const fs::path cases_file = dir.path / "cases.json", out_file = dir.path / "torch.json";
  std::ofstream(cases_file) << in.dump();
  const auto run = replica::testing::run_python(
      fs::path(REPLICA_SOURCE_DIR) / "replica/data/tests/referee/sampler_referee.py",
      {cases_file.string(), out_file.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::ifstream out_stream(out_file);
  const json torch_out = json::parse(out_stream);
  ASSERT_EQ(torch_out.size(), cases.size());

  int mismatches = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    replica::data::DistributedSampler sampler(c.n, c.rank, c.world, c.shuffle, c.seed, c.drop_last);
    sampler.set_epoch(c.epoch);
    const auto mine = sampler.indices();
    const auto theirs = torch_out[i]["indices"].get<std::vector<int64_t>>();
    const bool same = mine == theirs && sampler.num_samples() == torch_out[i]["num_samples"].get<int64_t>() &&
                      sampler.total_size() == torch_out[i]["total_size"].get<int64_t>();
    if (!same && ++mismatches <= 5) {
      ADD_FAILURE() << describe(c) << ": replica num_samples " << sampler.num_samples() << " total "
                    << sampler.total_size() << ", torch " << torch_out[i]["num_samples"] << " "
                    << torch_out[i]["total_size"] << "; indices equal: " << (mine == theirs);
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << cases.size() << " samplers";
  std::cerr << cases.size() << " samplers compared with " << run.output;
}
