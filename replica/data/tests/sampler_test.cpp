#include "replica/data/sampler.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>
#include <vector>

using replica::data::DistributedSampler;

namespace {

using Indices = std::vector<int64_t>;

std::vector<Indices> all_ranks(int64_t n, int world, bool shuffle, uint64_t seed, bool drop_last,
                               int64_t epoch = 0) {
  std::vector<Indices> slices;
  for (int rank = 0; rank < world; ++rank) {
    DistributedSampler sampler(n, rank, world, shuffle, seed, drop_last);
    sampler.set_epoch(epoch);
    slices.push_back(sampler.indices());
    EXPECT_EQ(static_cast<int64_t>(slices.back().size()), sampler.num_samples());
  }
  return slices;
}

}  // namespace

// Expected values below were produced once with PyTorch 1.13 (python3-torch):
//   torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
//   list(DistributedSampler(range(n), num_replicas=W, rank=r, seed=s, drop_last=d)) after
//   set_epoch(e)
// They are hard-coded so the test needs no Python.
TEST(DistributedSampler, OrderEqualsPyTorchRandperm) {
  DistributedSampler sampler(10, 0, 1, /*shuffle=*/true, /*seed=*/7);
  EXPECT_EQ(sampler.indices(), (Indices{5, 0, 3, 4, 1, 7, 9, 6, 8, 2}));

  // A full-size permutation (randperm(60000) with seed 5), first 8 entries.
  DistributedSampler big(60000, 0, 1, true, /*seed=*/0);
  big.set_epoch(5);  // seed + epoch = 5
  const Indices order = big.indices();
  EXPECT_EQ(Indices(order.begin(), order.begin() + 8),
            (Indices{53411, 765, 31431, 44421, 31202, 28270, 18376, 35073}));
}

TEST(DistributedSampler, RankSlicesEqualPyTorch) {
  {
    DistributedSampler sampler(10, 1, 3, true, 7, /*drop_last=*/false);
    EXPECT_EQ(sampler.indices(), (Indices{0, 1, 6, 5}));  // padded with the first index
  }
  {
    DistributedSampler sampler(10, 2, 3, true, 7, /*drop_last=*/true);
    sampler.set_epoch(2);
    EXPECT_EQ(sampler.indices(), (Indices{8, 2, 4}));
  }
  {
    DistributedSampler sampler(5, 3, 4, true, 1, /*drop_last=*/false);
    sampler.set_epoch(1);
    EXPECT_EQ(sampler.indices(), (Indices{0, 1}));
  }
}

TEST(DistributedSampler, SlicesAreDisjointAndComplete) {
  // (n, world, drop_last) including n < world, n divisible by world, and n == 0.
  const std::vector<std::tuple<int64_t, int, bool>> cases = {
      {10, 3, false}, {10, 3, true}, {12, 4, false}, {12, 4, true}, {7, 1, false},
      {7, 1, true},   {3, 5, false}, {3, 5, true},   {1, 4, false}, {0, 3, false},
      {0, 3, true},   {1000, 7, false}, {1000, 7, true}, {60000, 8, false}};
  for (const auto& [n, world, drop_last] : cases) {
    SCOPED_TRACE(testing::Message() << "n=" << n << " world=" << world << " drop_last=" << drop_last);
    for (bool shuffle : {false, true}) {
      const auto slices = all_ranks(n, world, shuffle, /*seed=*/42, drop_last, /*epoch=*/3);
      const int64_t per_rank = drop_last ? n / world : (n + world - 1) / world;
      std::map<int64_t, int> seen;
      for (const auto& slice : slices) {
        EXPECT_EQ(static_cast<int64_t>(slice.size()), per_rank);
        for (int64_t index : slice) {
          ASSERT_GE(index, 0);
          ASSERT_LT(index, n);
          ++seen[index];
        }
      }
      const int64_t total = per_rank * world;
      if (drop_last) {
        // No index twice; exactly n - n % world distinct ones survive.
        EXPECT_EQ(static_cast<int64_t>(seen.size()), total);
        for (const auto& [index, count] : seen) EXPECT_EQ(count, 1) << "index " << index;
      } else {
        // Every index at least once; only the total - n padding entries repeat.
        EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
        int64_t repeats = 0;
        for (const auto& [index, count] : seen) repeats += count - 1;
        EXPECT_EQ(repeats, total - n);
      }
    }
  }
}

TEST(DistributedSampler, PaddingRepeatsFromTheStart) {
  // Without shuffling the padded list is 0..n-1 followed by 0, 1, ...: rank r gets r, r+W, ...
  // n=3, W=8: total 8, padded list 0 1 2 0 1 2 0 1 (the list repeated as often as needed).
  const auto slices = all_ranks(3, 8, /*shuffle=*/false, 0, /*drop_last=*/false);
  const Indices expected = {0, 1, 2, 0, 1, 2, 0, 1};
  for (int rank = 0; rank < 8; ++rank) EXPECT_EQ(slices[rank], (Indices{expected[rank]}));

  const auto ten = all_ranks(10, 4, false, 0, false);
  EXPECT_EQ(ten[0], (Indices{0, 4, 8}));
  EXPECT_EQ(ten[1], (Indices{1, 5, 9}));
  EXPECT_EQ(ten[2], (Indices{2, 6, 0}));
  EXPECT_EQ(ten[3], (Indices{3, 7, 1}));

  // drop_last truncates instead: 10 over 4 keeps the first 8.
  const auto dropped = all_ranks(10, 4, false, 0, true);
  EXPECT_EQ(dropped[2], (Indices{2, 6}));
  EXPECT_EQ(dropped[3], (Indices{3, 7}));
}

TEST(DistributedSampler, SizesFollowPyTorch) {
  DistributedSampler padded(10, 0, 3, true, 0, false);
  EXPECT_EQ(padded.num_samples(), 4);
  EXPECT_EQ(padded.total_size(), 12);
  DistributedSampler dropped(10, 0, 3, true, 0, true);
  EXPECT_EQ(dropped.num_samples(), 3);
  EXPECT_EQ(dropped.total_size(), 9);
  DistributedSampler even(12, 0, 3, true, 0, true);
  EXPECT_EQ(even.num_samples(), 4);
  DistributedSampler tiny(2, 4, 5, true, 0, true);  // ceil((2 - 5) / 5) = 0
  EXPECT_EQ(tiny.num_samples(), 0);
  EXPECT_TRUE(tiny.indices().empty());
}

TEST(DistributedSampler, EpochChangesOrderSeedReproducesIt) {
  DistributedSampler a(1000, 1, 4, true, /*seed=*/123);
  DistributedSampler b(1000, 1, 4, true, /*seed=*/123);
  EXPECT_EQ(a.indices(), b.indices());
  const Indices epoch0 = a.indices();
  a.set_epoch(1);
  EXPECT_EQ(a.epoch(), 1);
  EXPECT_NE(a.indices(), epoch0);
  b.set_epoch(1);
  EXPECT_EQ(a.indices(), b.indices());
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), epoch0);  // no hidden state: an epoch's order is a pure function

  DistributedSampler other_seed(1000, 1, 4, true, /*seed=*/124);
  EXPECT_NE(other_seed.indices(), epoch0);
  // seed + epoch is what PyTorch seeds with, so (seed 123, epoch 1) == (seed 124, epoch 0).
  a.set_epoch(1);
  EXPECT_EQ(other_seed.indices(), a.indices());
}

TEST(DistributedSampler, WithoutShuffleIsInOrder) {
  DistributedSampler sampler(9, 2, 3, /*shuffle=*/false);
  EXPECT_EQ(sampler.indices(), (Indices{2, 5, 8}));
  sampler.set_epoch(4);
  EXPECT_EQ(sampler.indices(), (Indices{2, 5, 8}));
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THROW(DistributedSampler(10, 0, 0), replica::Error);
  EXPECT_THROW(DistributedSampler(10, 3, 3), replica::Error);
  EXPECT_THROW(DistributedSampler(10, -1, 3), replica::Error);
  EXPECT_THROW(DistributedSampler(-1, 0, 1), replica::Error);
  try {
    DistributedSampler(10, 4, 2);
    FAIL() << "no replica::Error";
  } catch (const replica::Error& error) {
    EXPECT_NE(std::string(error.what()).find("rank 4"), std::string::npos) << error.what();
  }
}
