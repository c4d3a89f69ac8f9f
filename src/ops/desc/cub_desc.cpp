// CUB histogram / scan / radix-sort parameters (cub_desc.h).
#include "ops/desc/cub_desc.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "core/check.h"

namespace moecore::ops::desc {

namespace {

int key_bits(uint64_t max_key) { return std::max(1, static_cast<int>(std::bit_width(max_key))); }

}  // namespace

ExpertHistogramDesc expert_histogram_desc(int64_t n_tok, int64_t K, int64_t E) {
  MOE_CHECK(n_tok >= 0 && K >= 1 && E >= 1, "[expert_histogram_desc] T={} K={} E={}", n_tok, K, E);
  MOE_CHECK(E < std::numeric_limits<int32_t>::max(),
            "[expert_histogram_desc] E={} exceeds CUB's int levels", E);
  ExpertHistogramDesc d;
  d.num_levels = static_cast<int32_t>(E + 1);
  d.lower_level = 0;
  d.upper_level = static_cast<int32_t>(E);
  d.num_samples = n_tok * K;
  d.histogram_bins = E + 1;
  d.scan_items = E + 1;
  return d;
}

RadixSortDesc permutation_sort_desc(int64_t n_tok, int64_t K, int64_t E) {
  MOE_CHECK(n_tok >= 0 && K >= 1 && E >= 1, "[permutation_sort_desc] T={} K={} E={}", n_tok, K, E);
  RadixSortDesc d;
  d.num_items = n_tok * K;
  d.end_bit = key_bits(static_cast<uint64_t>(E));  // keys [0, E]: E is the dropped key
  return d;
}

RadixSortDesc embedding_sort_desc(int64_t n_tok, int64_t V) {
  MOE_CHECK(n_tok >= 0 && V >= 1, "[embedding_sort_desc] T={} V={}", n_tok, V);
  RadixSortDesc d;
  d.num_items = n_tok;
  d.end_bit = key_bits(static_cast<uint64_t>(V - 1));
  return d;
}

}  // namespace moecore::ops::desc
