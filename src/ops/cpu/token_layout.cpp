// [B, S] -> [S, B] token ids and targets: per sequence position, the B tokens of that position.
#include "ops/token_layout.h"
#include "core/check.h"

namespace moecore::ops::cpu {

void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S) {
  MOE_CHECK(B >= 0 && S >= 0, "[tokens] negative shape B={} S={}", B, S);
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      const int32_t tgt = targets_BS[b * S + s];
      ids_T[s * B + b] = ids_BS[b * S + s];
      targets_T[s * B + b] = tgt;
      n += tgt >= 0;
    }
  }
  *counted = n;
}

void sequence_positions(int32_t* pos_T, int64_t n_tok, int64_t B) {
  MOE_CHECK(n_tok >= 0 && B >= 1, "[positions] n_tok={} B={}", n_tok, B);
  for (int64_t s = 0, t = 0; t < n_tok; ++s) {
    for (int64_t b = 0; b < B && t < n_tok; ++b, ++t) pos_T[t] = static_cast<int32_t>(s);
  }
}

void roll_tokens(int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                 int64_t shift, int32_t fill) {
  MOE_CHECK(n_tok >= 0 && shift >= 0, "[roll_tokens] n_tok={} shift={}: both must be >= 0", n_tok,
            shift);
  const int64_t kept = shift < n_tok ? n_tok - shift : 0;
  int64_t n = 0;
  for (int64_t t = 0; t < kept; ++t) {
    out_T[t] = in_T[t + shift];
    n += out_T[t] >= 0;
  }
  for (int64_t t = kept; t < n_tok; ++t) out_T[t] = fill;
  if (counted != nullptr) *counted = n + (fill >= 0 ? n_tok - kept : 0);
}

}  // namespace moecore::ops::cpu
