// The device-table grouped GEMM's problem tables as a plain loop (ops/grouped_gemm_tables.h): the
// oracle of the CUDA kernel, and the CPU path of the op.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/check.h"
#include "ops/grouped_gemm_tables.h"

namespace moecore::ops {

void grouped_gemm_tables_ref(cuda::GroupedGemmProblem* problems, const int64_t* m_G, int64_t G,
                             GroupedGemmForm form, desc::GemmTypes types, int64_t N, int64_t K,
                             bool trans_w, const void* a, const void* b, void* d) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  MOE_CHECK(G >= 0 && G <= kMax && N >= 0 && N <= kMax && K >= 0 && K <= kMax &&
                (G == 0 || (m_G != nullptr && problems != nullptr)),
            "[grouped_gemm_tables_ref] G={} N={} K={}, m_G {}, problems {}: sizes in [0, 2^31), "
            "m_G and problems set when G > 0",
            G, N, K, m_G ? "set" : "null", problems ? "set" : "null");
  const int64_t ab = desc::gemm_input_bytes(types), db = desc::gemm_output_bytes(types);
  const auto* pa = static_cast<const char*>(a);
  const auto* pb = static_cast<const char*>(b);
  auto* pd = static_cast<char*>(d);
  const auto at = [](auto* base, int64_t bytes) { return base == nullptr ? base : base + bytes; };
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = std::max<int64_t>(m_G[g], 0);
    cuda::GroupedGemmProblem p;
    if (form == GroupedGemmForm::Forward) {
      p.m = static_cast<int32_t>(rows);
      p.n = static_cast<int32_t>(N);
      p.k = static_cast<int32_t>(K);
      p.trans_a = 0;
      p.trans_b = trans_w ? 1 : 0;
      p.lda = std::max<int64_t>(K, 1);
      p.ldb = std::max<int64_t>(trans_w ? K : N, 1);
      p.ldd = std::max<int64_t>(N, 1);
      p.a = at(pa, row0 * K * ab);
      p.b = at(pb, g * N * K * ab);
      p.d = at(pd, row0 * N * db);
    } else {
      p.m = static_cast<int32_t>(N);
      p.n = static_cast<int32_t>(K);
      p.k = static_cast<int32_t>(rows);
      p.trans_a = 1;
      p.trans_b = 0;
      p.lda = std::max<int64_t>(N, 1);
      p.ldb = std::max<int64_t>(K, 1);
      p.ldd = std::max<int64_t>(K, 1);
      p.a = at(pa, row0 * N * ab);
      p.b = at(pb, row0 * K * ab);
      p.d = at(pd, g * N * K * db);
    }
    problems[g] = p;
    row0 += rows;
  }
}

}  // namespace moecore::ops
