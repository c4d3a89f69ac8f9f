// The CUB parameters of token permutation and the embedding backward (ops/desc/cub_desc.h)
// through plain-loop interpreters of CUB's documented semantics (common/cub_interpreter.h),
// against the ops' references: the histogram + exclusive scan give build_permutation_ref's
// counts and expert segments; the radix sort on the descriptor's bits gives its row order
// (expert-major, token ascending) with dropped slots last; the embedding backward as sorted
// segments equals embedding_backward_ref. Awkward shapes: E and V powers of two (the key range
// needs one more bit than E - 1 has), E = 1, V = 1, experts with no tokens, dropped slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/cub_interpreter.h"
#include "ops/desc/cub_desc.h"
#include "ops/embedding.h"
#include "ops/permute.h"

namespace moecore::ops::desc {
namespace {

using moecore::testing::cub_exclusive_sum;
using moecore::testing::cub_histogram_even;
using moecore::testing::cub_radix_sort_pairs;

std::vector<int32_t> random_routing(int64_t T, int64_t K, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> idx(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> experts(E);
    for (int64_t e = 0; e < E; ++e) experts[e] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), rng);
    // Skew towards low experts so some get none; drop about one slot in five.
    std::sort(experts.begin(), experts.begin() + std::min<int64_t>(E, K + 1));
    for (int64_t k = 0; k < K; ++k)
      idx[t * K + k] = rng() % 5 == 0 ? -1 : experts[k];
  }
  return idx;
}

TEST(DescCub, HistogramScanAndSortEqualBuildPermutationRef) {
  struct Shape { int64_t T, K, E; };
  uint32_t seed = 1;
  for (Shape s : {Shape{7, 2, 4}, Shape{9, 1, 1}, Shape{13, 3, 8}, Shape{1, 1, 2}, Shape{6, 4, 16},
                  Shape{0, 2, 3}, Shape{11, 2, 5}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.T << " K=" << s.K << " E=" << s.E);
    const std::vector<int32_t> idx = random_routing(s.T, s.K, s.E, seed++);
    const int64_t TK = s.T * s.K;
    std::vector<int64_t> counts(s.E);
    std::vector<int32_t> row_token(TK), row_slot(TK), token_rows(TK);
    const int64_t n_kept = build_permutation_ref(counts.data(), row_token.data(), row_slot.data(),
                                                 token_rows.data(), idx.data(), s.T, s.K, s.E);
    // histogram + exclusive scan
    const ExpertHistogramDesc h = expert_histogram_desc(s.T, s.K, s.E);
    std::vector<int64_t> hist(h.histogram_bins, 0), off(h.scan_items);
    cub_histogram_even(idx.data(), h.num_samples, hist.data(), h.num_levels, h.lower_level,
                       h.upper_level);
    cub_exclusive_sum(hist.data(), off.data(), h.scan_items);
    for (int64_t e = 0; e < s.E; ++e) {
      EXPECT_EQ(hist[e], counts[e]) << "expert " << e;
      EXPECT_EQ(off[e + 1] - off[e], counts[e]) << "expert " << e;
    }
    EXPECT_EQ(off[s.E], n_kept);
    // radix sort: keys the expert (dropped = E), values the flat slot
    const RadixSortDesc d = permutation_sort_desc(s.T, s.K, s.E);
    std::vector<uint32_t> keys(TK);
    std::vector<int32_t> values(TK);
    for (int64_t i = 0; i < TK; ++i) {
      keys[i] = idx[i] < 0 ? static_cast<uint32_t>(s.E) : static_cast<uint32_t>(idx[i]);
      values[i] = static_cast<int32_t>(i);
    }
    cub_radix_sort_pairs(keys, values, d);
    for (int64_t r = 0; r < n_kept; ++r) {
      EXPECT_EQ(values[r] / s.K, row_token[r]) << "row " << r;
      EXPECT_EQ(values[r] % s.K, row_slot[r]) << "row " << r;
      EXPECT_GE(r, off[keys[r]]);
      EXPECT_LT(r, off[keys[r] + 1]);
    }
    for (int64_t r = n_kept; r < TK; ++r) EXPECT_EQ(keys[r], static_cast<uint32_t>(s.E)) << "row " << r;
  }
}

TEST(DescCub, EmbeddingBackwardBySortedSegmentsEqualsRef) {
  uint32_t seed = 50;
  for (int64_t V : {1, 2, 7, 8, 16, 33}) {
    const int64_t T = 23, H = 3;
    SCOPED_TRACE(::testing::Message() << "V=" << V);
    std::mt19937 rng(seed++);
    std::vector<int32_t> ids(T);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % V);
    ids[0] = static_cast<int32_t>(V - 1);  // the largest id occurs
    std::vector<float> dy(T * H);
    for (auto& x : dy) x = static_cast<float>(static_cast<int>(rng() % 17) - 8) * 0.5f;
    std::vector<float> want(V * H, 1.0f), got(V * H, 1.0f);
    embedding_backward_ref<float>(want.data(), dy.data(), ids.data(), T, H, V);
    const RadixSortDesc d = embedding_sort_desc(T, V);
    std::vector<uint32_t> keys(ids.begin(), ids.end());
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
    cub_radix_sort_pairs(keys, pos, d);
    for (int64_t i = 0; i < T; ++i) {
      if (i > 0) {
        ASSERT_LE(keys[i - 1], keys[i]) << "sorted keys out of order at " << i;
      }
      for (int64_t h = 0; h < H; ++h) got[keys[i] * H + h] += dy[pos[i] * H + h];
    }
    EXPECT_EQ(got, want);
  }
}

}  // namespace
}  // namespace moecore::ops::desc
