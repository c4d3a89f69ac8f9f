// The distributed optimizer's shard ranges: a bucket padded in thought to a multiple of d and cut
// into d equal contiguous shards (the trailing ones short), every element owned by exactly one
// rank, a parameter cut by a shard boundary, and the owned pieces packed in flat order.
#include <gtest/gtest.h>

#include <vector>

#include "parallel/bucket_shards.h"

namespace moecore::parallel {
namespace {

TEST(BucketShards, CeilSizedShardsWithTheShortOnesLast) {
  // 10 elements over 4 ranks: s = 3, padded to 12; ranks own 3, 3, 3, 1.
  const std::vector<int64_t> want = {3, 3, 3, 1};
  for (int r = 0; r < 4; ++r) {
    const BucketShard s = shard_bucket(100, 10, 4, r);
    EXPECT_EQ(s.shard, 3);
    EXPECT_EQ(s.counts, want);
    EXPECT_EQ(s.begin, 100 + 3 * r);
    EXPECT_EQ(s.count, want[r]);
  }
  // Fewer elements than ranks: the last ranks own nothing (begin at the bucket's end).
  const BucketShard tiny = shard_bucket(0, 2, 4, 3);
  EXPECT_EQ(tiny.counts, (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(tiny.count, 0);
  EXPECT_EQ(tiny.begin, 2);
  // d = 1: the whole bucket.
  const BucketShard one = shard_bucket(7, 5, 1, 0);
  EXPECT_EQ(one.begin, 7);
  EXPECT_EQ(one.count, 5);
  EXPECT_THROW(shard_bucket(0, 5, 2, 2), std::exception);
}

TEST(BucketShards, EveryElementOwnedOnceAndAParameterCutByABoundary) {
  // Two buckets listed in backward order (the later offset first), sizes that do not divide.
  const std::vector<int64_t> offsets = {7, 0}, counts = {11, 7};
  for (int d : {1, 2, 3, 4, 5}) {
    std::vector<int> owners(18, 0);
    int64_t total = 0;
    for (int r = 0; r < d; ++r) {
      int64_t owned = 0;
      const std::vector<BucketShard> s = shard_buckets(offsets, counts, d, r, &owned);
      int64_t sum = 0;
      for (const BucketShard& b : s) {
        for (int64_t i = b.begin; i < b.begin + b.count; ++i) ++owners[i];
        sum += b.count;
      }
      EXPECT_EQ(owned, sum);
      // Flat order: the bucket at offset 0 comes first in the owned buffer.
      EXPECT_EQ(s[1].owned_offset, 0);
      EXPECT_EQ(s[0].owned_offset, s[1].count);
      total += owned;
    }
    EXPECT_EQ(total, 18) << "d=" << d;
    for (int i = 0; i < 18; ++i) EXPECT_EQ(owners[i], 1) << "element " << i << " d=" << d;
  }
  // A parameter [8, 14) in the bucket [7, 18) over 2 ranks (s = 6): rank 0 owns [7, 13),
  // rank 1 [13, 18): the boundary at 13 cuts it into [8, 13) and [13, 14).
  const BucketShard r0 = shard_bucket(7, 11, 2, 0), r1 = shard_bucket(7, 11, 2, 1);
  EXPECT_EQ(r0.begin + r0.count, 13);
  EXPECT_EQ(r1.begin, 13);
  EXPECT_EQ(r1.count, 5);
  // d = 1: the owned layout is the flat layout.
  int64_t owned = 0;
  const std::vector<BucketShard> s1 = shard_buckets(offsets, counts, 1, 0, &owned);
  EXPECT_EQ(owned, 18);
  for (const BucketShard& b : s1) EXPECT_EQ(b.owned_offset, b.begin);
}

}  // namespace
}  // namespace moecore::parallel
