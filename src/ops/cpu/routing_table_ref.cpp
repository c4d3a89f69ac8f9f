// Routing replay's table copies, the reference: one plain loop over (s, b, k) per op, each index
// written out as the header's formula. The oracle for routing_table.cpp and the CUDA kernels.
#include "core/check.h"
#include "ops/routing_table.h"

namespace moecore::ops {

void check_routing_table_args(int64_t B, int64_t S, int64_t K, int64_t rows, const char* op) {
  MOE_CHECK(S >= 0 && rows >= 0 && B >= 0 && K >= 1,
            "[{}] bad shape B={} S={} K={} rows={}: the micro-batch's samples, the sequence "
            "length and the run's rows must be >= 0, K (the router's top-k) >= 1",
            op, B, S, K, rows);
  constexpr int64_t kMax32 = 0x7fffffff;  // the kernels' 32-bit index math
  MOE_CHECK(B * S * K <= kMax32 && rows * B * K <= kMax32,
            "[{}] a table of B={} x S={} x K={} ids or a run of {} rows holds 2^31 ids or more: "
            "lower --micro-batch-size or --seq-length",
            op, B, S, K, rows);
}

void routing_table_store_ref(int32_t* table_BSK, const int32_t* local_TK, int64_t B, int64_t S,
                             int64_t K, int64_t rows, int64_t pos0) {
  check_routing_table_args(B, S, K, rows, "routing_table_store_ref");
  for (int64_t s = 0; s < rows; ++s) {
    const int64_t pos = pos0 + s;
    if (pos < 0 || pos >= S) continue;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < K; ++k)
        table_BSK[(b * S + pos) * K + k] = local_TK[(s * B + b) * K + k];
    }
  }
}

void routing_table_load_ref(int32_t* local_TK, const int32_t* table_BSK, int64_t B, int64_t S,
                            int64_t K, int64_t rows, int64_t pos0) {
  check_routing_table_args(B, S, K, rows, "routing_table_load_ref");
  for (int64_t s = 0; s < rows; ++s) {
    const int64_t pos = pos0 + s;
    const bool inside = pos >= 0 && pos < S;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < K; ++k)
        local_TK[(s * B + b) * K + k] = inside ? table_BSK[(b * S + pos) * K + k] : -1;
    }
  }
}

}  // namespace moecore::ops
