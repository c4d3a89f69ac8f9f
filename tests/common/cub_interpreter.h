// Test-only plain-loop interpreters of the CUB device algorithms the backend calls, as
// documented (https://nvidia.github.io/cccl/cub/api/structcub_1_1DeviceHistogram.html,
// structcub_1_1DeviceScan.html, structcub_1_1DeviceRadixSort.html).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ops/desc/cub_desc.h"

namespace moecore::testing {

// HistogramEven: num_levels - 1 bins of equal width over [lower, upper); samples outside are
// not counted. (Integer samples, unit-width bins here.)
inline void cub_histogram_even(const int32_t* samples, int64_t num_samples, int64_t* histogram,
                               int32_t num_levels, int32_t lower, int32_t upper) {
  const int32_t bins = num_levels - 1;
  for (int32_t b = 0; b < bins; ++b) histogram[b] = 0;
  for (int64_t i = 0; i < num_samples; ++i) {
    const int32_t s = samples[i];
    if (s < lower || s >= upper) continue;
    const int64_t bin = static_cast<int64_t>(s - lower) * bins / (upper - lower);
    ++histogram[bin];
  }
}

// ExclusiveSum: out[0] = 0, out[i] = in[0] + ... + in[i - 1].
inline void cub_exclusive_sum(const int64_t* in, int64_t* out, int64_t n) {
  int64_t run = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = in[i];
    out[i] = run;
    run += v;
  }
}

// SortPairs on bits [begin_bit, end_bit) of unsigned keys: a stable LSD radix sort, one bit per
// pass, as documented (bits outside the range are ignored).
inline void cub_radix_sort_pairs(std::vector<uint32_t>& keys, std::vector<int32_t>& values,
                                 const ops::desc::RadixSortDesc& d) {
  if (static_cast<int64_t>(keys.size()) != d.num_items || keys.size() != values.size())
    throw std::runtime_error("cub: num_items does not match the buffers");
  if (d.begin_bit < 0 || d.end_bit > 32 || d.begin_bit >= d.end_bit)
    throw std::runtime_error("cub: bad bit range");
  for (int bit = d.begin_bit; bit < d.end_bit; ++bit) {
    std::vector<uint32_t> k2;
    std::vector<int32_t> v2;
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i = 0; i < keys.size(); ++i)
        if (((keys[i] >> bit) & 1u) == static_cast<uint32_t>(pass)) {
          k2.push_back(keys[i]);
          v2.push_back(values[i]);
        }
    keys.swap(k2);
    values.swap(v2);
  }
}

}  // namespace moecore::testing
