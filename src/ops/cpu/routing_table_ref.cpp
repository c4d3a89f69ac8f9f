// Routing replay's table copies, the reference: one plain loop over (s, b, k) per op, each index
// written out as the header's formula. The oracle for routing_table.cpp and the CUDA kernels.
#include "core/check.h"
#include "ops/routing_table.h"

namespace moecore::ops {

void check_routing_table_args(const DropoutCounters* counters, int64_t samples, int64_t S,
                              int64_t rows, int64_t B, int64_t K, const char* op) {
  MOE_CHECK(samples >= 0 && S >= 0 && rows >= 0 && B >= 0 && K >= 1,
            "[{}] bad shape samples={} S={} rows={} B={} K={}: the table's samples and sequence "
            "length, the run's rows and the micro-batch must be >= 0, K (the router's top-k) >= 1",
            op, samples, S, rows, B, K);
  MOE_CHECK(counters != nullptr,
            "[{}] no counters: pass the micro-batch's DropoutCounters (its sample0 places the "
            "run's samples in the table), written before the step",
            op);
}

void routing_table_store_ref(int32_t* table, const int32_t* local_TK,
                             const DropoutCounters* counters, int64_t samples, int64_t S,
                             int64_t rows, int64_t B, int64_t K, int64_t pos0) {
  check_routing_table_args(counters, samples, S, rows, B, K, "routing_table_store_ref");
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t sample = counters->sample0 + b, pos = pos0 + s;
      if (sample < 0 || sample >= samples || pos < 0 || pos >= S) continue;
      for (int64_t k = 0; k < K; ++k)
        table[(sample * S + pos) * K + k] = local_TK[(s * B + b) * K + k];
    }
  }
}

void routing_table_load_ref(int32_t* local_TK, const int32_t* table,
                            const DropoutCounters* counters, int64_t samples, int64_t S,
                            int64_t rows, int64_t B, int64_t K, int64_t pos0) {
  check_routing_table_args(counters, samples, S, rows, B, K, "routing_table_load_ref");
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t sample = counters->sample0 + b, pos = pos0 + s;
      const bool inside = sample >= 0 && sample < samples && pos >= 0 && pos < S;
      for (int64_t k = 0; k < K; ++k)
        local_TK[(s * B + b) * K + k] = inside ? table[(sample * S + pos) * K + k] : -1;
    }
  }
}

}  // namespace moecore::ops
