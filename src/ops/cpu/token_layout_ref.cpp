// [B, S] -> [S, B], element by element from the definition t = s * B + b: the oracle.
#include "ops/token_layout.h"

namespace moecore::ops {

void tokens_to_sequence_major_ref(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                  const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                                  int64_t S) {
  *counted = 0;
  for (int64_t t = 0; t < B * S; ++t) {
    const int64_t s = t / B, b = t % B;
    ids_T[t] = ids_BS[b * S + s];
    targets_T[t] = targets_BS[b * S + s];
    if (targets_T[t] >= 0) ++*counted;
  }
}

void sequence_positions_ref(int32_t* pos_T, int64_t n_tok, int64_t B) {
  for (int64_t t = 0; t < n_tok; ++t) pos_T[t] = static_cast<int32_t>(t / B);
}

void roll_tokens_ref(int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                     int64_t shift, int32_t fill) {
  int64_t n = 0;
  for (int64_t t = 0; t < n_tok; ++t) {
    out_T[t] = t + shift < n_tok ? in_T[t + shift] : fill;
    if (out_T[t] >= 0) ++n;
  }
  if (counted != nullptr) *counted = n;
}

}  // namespace moecore::ops
