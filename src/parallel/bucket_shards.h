// The distributed optimizer's (ZeRO-1) shard ranges: each gradient bucket split into d equal
// contiguous shards over its data-parallel group (dense: dp x cp, expert: expt_dp); rank r owns
// shard r of every bucket, so a shard boundary may cut a parameter in two.
#pragma once

#include <cstdint>
#include <vector>

namespace moecore::parallel {

// Megatron pads each bucket's buffer so that it divides evenly by the data-parallel size (and
// aligns it for NCCL's bandwidth). Here the padding is not stored: the bucket of n elements is
// padded in thought to d * ceil(n / d), shard r is [r s, (r + 1) s) of that with s = ceil(n / d)
// clipped to [0, n), so the trailing shards are short (possibly empty) and the collectives carry
// the uneven counts (reduce_scatter_v, all_gather_v).
struct BucketShard {
  int64_t shard = 0;           // s = ceil(n / d): every shard's size before clipping
  int64_t begin = 0;           // this rank's owned elements, in the kind's flat buffer
  int64_t count = 0;           // (begin .. begin + count), 0 <= count <= shard
  int64_t owned_offset = 0;    // where they sit in the kind's owned (sharded) buffers
  std::vector<int64_t> counts;  // per group rank: the elements it owns (sum = n)
};

// Bucket [offset, offset + n) of a kind's flat buffer over d ranks, seen by rank r (0 <= r < d);
// owned_offset is left 0 (shard_buckets assigns it).
BucketShard shard_bucket(int64_t offset, int64_t n, int d, int r);

// One kind's buckets (their flat ranges, in any order) over d ranks, seen by rank r: the owned
// pieces laid out in the owned buffers in the order of the flat buffer, so that with d = 1 the
// owned buffer is the flat buffer itself (owned_offset == begin). *owned_numel: their sum.
std::vector<BucketShard> shard_buckets(const std::vector<int64_t>& offsets,
                                       const std::vector<int64_t>& counts, int d, int r,
                                       int64_t* owned_numel);

}  // namespace moecore::parallel
