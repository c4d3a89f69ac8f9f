// Grouped GEMM descriptors: the strided-batched call of padded dispatch and the
// grouped-batched problem tables of dropless dispatch (grouped_gemm_desc.h).
#include "ops/desc/grouped_gemm_desc.h"

#include <algorithm>
#include <limits>

#include "core/check.h"

namespace moecore::ops::desc {

namespace {

void check_grouped(const char* who, int64_t G, int64_t N, int64_t K) {
  MOE_CHECK(G >= 0 && N >= 0 && K >= 0, "[{}] negative size G={} N={} K={}", who, G, N, K);
}

// The row-major call of expert g with `rows` rows starting at row row0 of the stacked operands.
struct ExpertGemm {
  GemmCall call;
  int64_t a_off = 0, b_off = 0, c_off = 0;  // our A, B, C
};

ExpertGemm forward_problem(int64_t g, int64_t row0, int64_t rows, int64_t N, int64_t K,
                           bool trans_w) {
  ExpertGemm e;
  e.call.M = rows;
  e.call.N = N;
  e.call.K = K;
  e.call.trans_b = trans_w;
  e.call.lda = std::max<int64_t>(K, 1);
  e.call.ldb = std::max<int64_t>(trans_w ? K : N, 1);
  e.call.ldc = std::max<int64_t>(N, 1);
  e.a_off = row0 * K;
  e.b_off = g * N * K;
  e.c_off = row0 * N;
  return e;
}

ExpertGemm wgrad_problem(int64_t g, int64_t row0, int64_t rows, int64_t N, int64_t K) {
  ExpertGemm e;
  e.call.trans_a = true;  // dy_g^T: dy_g stored [rows, N]
  e.call.M = N;
  e.call.N = K;
  e.call.K = rows;
  e.call.lda = std::max<int64_t>(N, 1);
  e.call.ldb = std::max<int64_t>(K, 1);
  e.call.ldc = std::max<int64_t>(K, 1);
  e.call.beta = 1.0;
  e.a_off = row0 * N;
  e.b_off = row0 * K;
  e.c_off = g * N * K;
  return e;
}

GroupedBatchedDesc tables(const char* who, GemmTypes types, const int64_t* m_G, int64_t G,
                          bool wgrad, int64_t N, int64_t K, bool trans_w) {
  check_grouped(who, G, N, K);
  MOE_CHECK(G == 0 || m_G != nullptr, "[{}] m_G is null with G={} experts", who, G);
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  MOE_CHECK(!wgrad || types != GemmTypes::Bf16Bf16,
            "[{}] the weight gradient accumulates (beta 1): a bf16 output cannot hold it", who);
  GroupedBatchedDesc d;
  d.a_type = d.b_type = gemm_input_type(types);
  d.c_type = gemm_output_type(types);
  d.compute = gemm_compute_type(types);
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = m_G[g];
    MOE_CHECK(rows >= 0, "[{}] expert {} has {} rows: token counts must be >= 0", who, g, rows);
    if (rows > 0) {
      ExpertGemm e = wgrad ? wgrad_problem(g, row0, rows, N, K)
                           : forward_problem(g, row0, rows, N, K, trans_w);
      ColumnMajorGemm c = column_major_gemm(who, e.call.trans_a, e.call.trans_b, e.call.M,
                                            e.call.N, e.call.K, e.call.lda, e.call.ldb, e.call.ldc);
      MOE_CHECK(c.m <= kInt32Max && c.n <= kInt32Max && c.k <= kInt32Max && c.lda <= kInt32Max &&
                    c.ldb <= kInt32Max && c.ldc <= kInt32Max,
                "[{}] expert {}: m={} n={} k={} exceed cublasGemmGroupedBatchedEx's int sizes", who,
                g, c.m, c.n, c.k);
      d.a_operand = c.a_operand;
      d.b_operand = c.b_operand;
      d.transa.push_back(c.op_a);
      d.transb.push_back(c.op_b);
      d.m.push_back(static_cast<int32_t>(c.m));
      d.n.push_back(static_cast<int32_t>(c.n));
      d.k.push_back(static_cast<int32_t>(c.k));
      d.lda.push_back(static_cast<int32_t>(c.lda));
      d.ldb.push_back(static_cast<int32_t>(c.ldb));
      d.ldc.push_back(static_cast<int32_t>(c.ldc));
      d.group_size.push_back(1);
      d.alpha.push_back(e.call.alpha);
      d.beta.push_back(e.call.beta);
      // The A slot holds our B: its pointer table gets our B's offsets, and vice versa.
      d.a_off.push_back(c.a_operand == GemmOperand::B ? e.b_off : e.a_off);
      d.b_off.push_back(c.b_operand == GemmOperand::A ? e.a_off : e.b_off);
      d.c_off.push_back(e.c_off);
      d.expert.push_back(g);
    }
    row0 += rows;
  }
  d.group_count = static_cast<int32_t>(d.m.size());
  return d;
}

}  // namespace

GemmCall padded_grouped_forward_call(GemmTypes types, int64_t G, int64_t cap, int64_t N, int64_t K,
                                     bool trans_w) {
  check_grouped("padded_grouped_forward", G, N, K);
  MOE_CHECK(cap >= 0, "[padded_grouped_forward] capacity {} must be >= 0", cap);
  GemmCall c = forward_problem(0, 0, cap, N, K, trans_w).call;
  c.types = types;
  c.batch = G;
  c.stride_a = cap * K;  // x_g: expert g's block of cap rows
  c.stride_b = N * K;    // w_g
  c.stride_c = cap * N;  // y_g
  return c;
}

GemmCall padded_grouped_wgrad_call(GemmTypes types, int64_t G, int64_t cap, int64_t N, int64_t K) {
  check_grouped("padded_grouped_wgrad", G, N, K);
  MOE_CHECK(cap >= 0, "[padded_grouped_wgrad] capacity {} must be >= 0", cap);
  GemmCall c = wgrad_problem(0, 0, cap, N, K).call;
  c.types = types;
  c.batch = G;
  c.stride_a = cap * N;  // dy_g
  c.stride_b = cap * K;  // x_g
  c.stride_c = N * K;    // dw_g
  return c;
}

GroupedBatchedDesc grouped_batched_forward(GemmTypes types, const int64_t* m_G, int64_t G,
                                           int64_t N, int64_t K, bool trans_w) {
  return tables("grouped_batched_forward", types, m_G, G, /*wgrad=*/false, N, K, trans_w);
}

GroupedBatchedDesc grouped_batched_wgrad(GemmTypes types, const int64_t* m_G, int64_t G, int64_t N,
                                         int64_t K) {
  return tables("grouped_batched_wgrad", types, m_G, G, /*wgrad=*/true, N, K, false);
}

}  // namespace moecore::ops::desc
