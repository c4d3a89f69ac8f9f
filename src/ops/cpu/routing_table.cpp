// Routing replay's table copies, the CPU fast path: a token's K ids are contiguous in both the
// local buffer and the table, so each token is one K-long copy (or one fill of -1), a plain loop
// (a memcpy call per token of a few ids measured slower than the reference); OpenMP over the
// run's rows when there are enough ids. Pure copies: bitwise the reference for any thread count.
#include "ops/routing_table.h"

namespace moecore::ops::cpu {

namespace {
// Below this many ids a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t{1} << 14;
}  // namespace

void routing_table_store(int32_t* table_BSK, const int32_t* local_TK, int64_t B, int64_t S,
                         int64_t K, int64_t rows, int64_t pos0) {
  check_routing_table_args(B, S, K, rows, "routing_table_store");
#pragma omp parallel for schedule(static) if (rows * B * K >= kParallelMin)
  for (int64_t s = 0; s < rows; ++s) {
    const int64_t pos = pos0 + s;
    if (pos < 0 || pos >= S) continue;
    for (int64_t b = 0; b < B; ++b) {
      const int32_t* src = local_TK + (s * B + b) * K;
      int32_t* dst = table_BSK + (b * S + pos) * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k];
    }
  }
}

void routing_table_load(int32_t* local_TK, const int32_t* table_BSK, int64_t B, int64_t S,
                        int64_t K, int64_t rows, int64_t pos0) {
  check_routing_table_args(B, S, K, rows, "routing_table_load");
#pragma omp parallel for schedule(static) if (rows * B * K >= kParallelMin)
  for (int64_t s = 0; s < rows; ++s) {
    const int64_t pos = pos0 + s;
    const bool inside = pos >= 0 && pos < S;
    for (int64_t b = 0; b < B; ++b) {
      int32_t* dst = local_TK + (s * B + b) * K;
      const int32_t* src = table_BSK + (b * S + (inside ? pos : 0)) * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = inside ? src[k] : -1;
    }
  }
}

}  // namespace moecore::ops::cpu
