#include "data/token_source.h"


namespace moecore::data {

void make_batch(const TokenSource& src, int32_t* ids_BS, int32_t* targets_BS, int64_t n_samples,
                int64_t S, uint64_t first_index, int32_t* scratch_S1) {
  for (int64_t b = 0; b < n_samples; ++b) {
    src.sample(scratch_S1, S + 1, first_index + b);
    for (int64_t s = 0; s < S; ++s) {
      ids_BS[b * S + s] = scratch_S1[s];
      targets_BS[b * S + s] = scratch_S1[s + 1];
    }
  }
}

}  // namespace moecore::data
