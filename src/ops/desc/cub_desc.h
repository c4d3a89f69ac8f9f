// The CUB calls of token permutation and the embedding backward, as pure functions of the
// shapes, tested on the CPU through plain-loop interpreters of CUB's documented semantics
// (tests/common/cub_interpreter.h) against the ops' references:
// - cub::DeviceHistogram::HistogramEven(samples, histogram, num_levels, lower, upper, n)
//   (https://nvidia.github.io/cccl/cub/api/structcub_1_1DeviceHistogram.html): num_levels - 1
//   equal bins over [lower, upper); samples outside are not counted (dropped slots, idx < 0).
// - cub::DeviceScan::ExclusiveSum over the histogram plus one zero bin gives E + 1 segment
//   offsets: expert e's rows are [off[e], off[e + 1]), off[E] the kept rows.
// - cub::DeviceRadixSort::SortPairs(keys, values, n, begin_bit, end_bit)
//   (https://nvidia.github.io/cccl/cub/api/structcub_1_1DeviceRadixSort.html): a stable sort on
//   bits [begin_bit, end_bit) of unsigned keys; bits outside are ignored, so end_bit must cover
//   the largest key or keys alias.
#pragma once

#include <cstdint>

namespace moecore::ops::desc {

// Per-expert token counts and segment offsets from idx [T, K] (expert per slot, < 0 dropped).
struct ExpertHistogramDesc {
  int32_t num_levels = 0;      // E + 1 boundaries: E bins
  int32_t lower_level = 0;     // bins [lower + e, lower + e + 1)
  int32_t upper_level = 0;     // E
  int64_t num_samples = 0;     // T * K
  int64_t histogram_bins = 0;  // E + 1: the histogram's E bins and a zero bin for off[E]
  int64_t scan_items = 0;      // E + 1 items of ExclusiveSum -> offsets [E + 1]
};
ExpertHistogramDesc expert_histogram_desc(int64_t n_tok, int64_t K, int64_t E);

// A radix sort's key bits: keys in [0, max_key].
struct RadixSortDesc {
  int64_t num_items = 0;
  int begin_bit = 0;
  int end_bit = 0;  // bit width of max_key, at least 1
};
// The dispatch permutation: keys idx[t, k] with dropped slots keyed E (sorted last), values the
// flat slot t * K + k; the stable sort orders rows expert-major, token ascending (permute.h).
RadixSortDesc permutation_sort_desc(int64_t n_tok, int64_t K, int64_t E);
// The embedding backward: keys the token ids [0, V), values the token positions; equal ids
// become adjacent segments, summed in token order.
RadixSortDesc embedding_sort_desc(int64_t n_tok, int64_t V);

}  // namespace moecore::ops::desc
