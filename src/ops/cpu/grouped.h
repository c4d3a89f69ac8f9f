// Helpers shared by the f32 and bf16 grouped GEMMs (internal to ops/cpu).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "core/check.h"

namespace moecore::ops::detail {

// Groups in parallel, one single-threaded GEMM each (oneDNN runs sgemm on the calling thread
// inside an OpenMP region), or one after another with all threads per GEMM. Measured in
// bench/RESULTS.md "Grouped GEMM": with w as [G,N,K] parallel groups are 1.2-2.8x faster at 2
// threads (oneDNN's small-M 'NT' sgemm splits badly over threads); with [G,K,N] they tie, except
// at 16-row groups where they lost 18-24% in 2 of 3 clean runs. Only when the work splits evenly:
// with one dominant group parallel groups would leave threads idle. The
// choice depends only on m_G and the thread count, so results stay deterministic run to run.
inline bool groups_in_parallel(const int64_t* m_G, int64_t G) {
  int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads <= 1) return false;
  int64_t total = 0, largest = 0, non_empty = 0;
  for (int64_t g = 0; g < G; ++g) {
    total += m_G[g];
    largest = std::max(largest, m_G[g]);
    non_empty += m_G[g] > 0;
  }
  return non_empty >= threads && largest * threads <= total;
}

// Runs body(g, row0) for every non-empty group g, whose rows start at row0.
template <typename Body>
void for_each_group(const int64_t* m_G, int64_t G, bool parallel, const Body& body) {
  if (!parallel) {
    int64_t row0 = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (m_G[g] > 0) body(g, row0);
      row0 += m_G[g];
    }
    return;
  }
  // Each iteration recomputes its row offset: O(G^2) adds for G local experts (<= a few
  // hundred) is nothing next to a GEMM, and needs no scratch buffer inside the step.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t g = 0; g < G; ++g) {
    if (m_G[g] == 0) continue;
    int64_t row0 = 0;
    for (int64_t h = 0; h < g; ++h) row0 += m_G[h];
    body(g, row0);
  }
}

inline void check_group_sizes(const char* who, const int64_t* m_G, int64_t G, int64_t N, int64_t K) {
  MOE_CHECK(G >= 0 && N >= 0 && K >= 0, "[{}] negative size G={} N={} K={}", who, G, N, K);
  MOE_CHECK(G == 0 || m_G != nullptr, "[{}] m_G is null with G={} groups", who, G);
  for (int64_t g = 0; g < G; ++g) {
    MOE_CHECK(m_G[g] >= 0, "[{}] group {} has {} rows: token counts must be >= 0", who, g,
              m_G[g]);
  }
}

}  // namespace moecore::ops::detail
