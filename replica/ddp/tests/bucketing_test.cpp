#include "replica/ddp/bucketing.h"

#include "replica/core/error.h"

#include <gtest/gtest.h>

#include <numeric>

using replica::ddp::assign_buckets;
using replica::ddp::ParamInfo;

namespace {
constexpr size_t MiB = 1024 * 1024;
std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.rbegin(), v.rend(), 0);
  return v;
}
}  // namespace

TEST(Bucketing, FirstBucketIsSmallLaterOnesUseTheCap) {
  // Ten 0.6 MiB float parameters: the first bucket closes once it reaches 1 MiB (two
  // parameters), later ones at 2 MiB (four parameters).
  std::vector<ParamInfo> params(10, ParamInfo{static_cast<size_t>(0.6 * MiB), "Float@cpu"});
  auto buckets = assign_buckets(params, reversed(10), 1 * MiB, 2 * MiB);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{9, 8}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{7, 6, 5, 4}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{3, 2, 1, 0}));
}

TEST(Bucketing, EveryParameterExactlyOnceInGivenOrder) {
  std::vector<ParamInfo> params;
  for (size_t i = 0; i < 57; ++i) params.push_back({(i % 7 + 1) * 100'000, "Float@cpu"});
  std::vector<size_t> order = {5, 3, 1};
  for (size_t i = 0; i < 57; ++i)
    if (i != 5 && i != 3 && i != 1) order.push_back(i);
  auto buckets = assign_buckets(params, order, 1 * MiB, 3 * MiB);
  std::vector<size_t> flat;
  for (auto& b : buckets) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, order);  // launch order follows the given (arrival) order
}

TEST(Bucketing, LargeParameterGetsItsOwnBucket) {
  std::vector<ParamInfo> params = {{100, "Float@cpu"}, {50 * MiB, "Float@cpu"}, {100, "Float@cpu"}};
  auto buckets = assign_buckets(params, reversed(3), 1 * MiB, 25 * MiB);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1}));  // fills past the 1 MiB cap, closes
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
}

TEST(Bucketing, DtypesNeverShareABucket) {
  std::vector<ParamInfo> params = {{10, "Float@cpu"}, {10, "BFloat16@cpu"}, {10, "Float@cpu"}};
  auto buckets = assign_buckets(params, reversed(3), 1 * MiB, 25 * MiB);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 0}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1}));
}

TEST(Bucketing, RejectsBadOrders) {
  std::vector<ParamInfo> params(3, ParamInfo{10, "Float@cpu"});
  EXPECT_THROW(assign_buckets(params, {0, 1}, MiB, MiB), replica::Error);
  EXPECT_THROW(assign_buckets(params, {0, 1, 1}, MiB, MiB), replica::Error);
  EXPECT_THROW(assign_buckets(params, {0, 1, 7}, MiB, MiB), replica::Error);
}
