// Shard ranges of the distributed optimizer: ceil-divided buckets, owned pieces in flat order.
#include "parallel/bucket_shards.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"

namespace moecore::parallel {

BucketShard shard_bucket(int64_t offset, int64_t n, int d, int r) {
  MOE_CHECK(d >= 1 && r >= 0 && r < d && n >= 0 && offset >= 0,
            "[ddp] shard {} of {} of a bucket of {} elements at {}", r, d, n, offset);
  BucketShard s;
  s.shard = (n + d - 1) / d;
  s.counts.resize(d);
  for (int q = 0; q < d; ++q) {
    s.counts[q] = std::clamp<int64_t>(n - static_cast<int64_t>(q) * s.shard, 0, s.shard);
  }
  s.begin = offset + std::min<int64_t>(static_cast<int64_t>(r) * s.shard, n);
  s.count = s.counts[r];
  return s;
}

std::vector<BucketShard> shard_buckets(const std::vector<int64_t>& offsets,
                                       const std::vector<int64_t>& counts, int d, int r,
                                       int64_t* owned_numel) {
  MOE_CHECK(offsets.size() == counts.size(), "[ddp] {} bucket offsets for {} counts",
            offsets.size(), counts.size());
  std::vector<BucketShard> out;
  out.reserve(offsets.size());
  for (size_t b = 0; b < offsets.size(); ++b) out.push_back(shard_bucket(offsets[b], counts[b], d, r));
  std::vector<size_t> order(out.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  int64_t at = 0;
  for (size_t b : order) {
    out[b].owned_offset = at;
    at += out[b].count;
  }
  if (owned_numel != nullptr) *owned_numel = at;
  return out;
}

}  // namespace moecore::parallel
