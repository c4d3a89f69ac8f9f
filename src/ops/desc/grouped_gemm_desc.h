// Library descriptors of the grouped (per local expert) GEMMs of ops/gemm.h, rows stacked by
// expert, w [G, N, K] (trans_w) or [G, K, N]:
//   forward  y_g[m_g, N]  = x_g[m_g, K] * op(w_g)
//   dgrad    dx_g[m_g, K] = dy_g[m_g, N] * op'(w_g): the forward with N and K exchanged and
//            trans_w flipped (w [G, N, K] read as [G, K', N'] untransposed, and vice versa)
//   wgrad    dw_g[N, K]  += dy_g[m_g, N]^T * x_g[m_g, K]
// Two library forms:
// - Padded dispatch (every expert a block of `cap` rows): one strided-batched cuBLASLt matmul,
//   batch G, no host sync (a GemmCall for gemm_desc).
// - Dropless (m_g differ): cublasGemmGroupedBatchedEx's host-side problem tables
//   (https://docs.nvidia.com/cuda/cublas/#cublasgemmgroupedbatchedex), one group of one problem
//   per non-empty expert, reading m_G on the host: the MoE layer's one documented sync.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/desc/gemm_desc.h"
#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

// Padded dispatch as one row-major strided-batched GEMM (per expert g, batch item g):
GemmCall padded_grouped_forward_call(GemmTypes types, int64_t G, int64_t cap, int64_t N, int64_t K,
                                     bool trans_w);
GemmCall padded_grouped_wgrad_call(GemmTypes types, int64_t G, int64_t cap, int64_t N, int64_t K);

// cublasGemmGroupedBatchedEx's arguments, column-major (the swap of gemm_desc.h per problem).
// Per group i (all of size 1 here): transa/transb, m/n/k, lda/ldb/ldc, alpha/beta (host arrays
// in the compute type's scale type); the pointer tables Aarray/Barray/Carray as element offsets
// from the base of the slot's project operand (a_operand / b_operand / C), which the backend adds
// to the device addresses and uploads. expert[i] is the expert of group i. Experts with no rows
// are left out: their forward writes nothing and their wgrad adds nothing; group_count 0 means
// the backend makes no call.
struct GroupedBatchedDesc {
  BlasDataType a_type = BlasDataType::R32F, b_type = BlasDataType::R32F,
               c_type = BlasDataType::R32F;
  BlasComputeType compute = BlasComputeType::F32;
  GemmOperand a_operand = GemmOperand::B, b_operand = GemmOperand::A;
  int32_t group_count = 0;
  std::vector<BlasOp> transa, transb;
  std::vector<int32_t> m, n, k, lda, ldb, ldc, group_size;
  std::vector<double> alpha, beta;
  std::vector<int64_t> a_off, b_off, c_off;  // one per problem (sum of group_size)
  std::vector<int64_t> expert;
};

// Forward (and dgrad, see above): x is our A, w our B, y the C.
GroupedBatchedDesc grouped_batched_forward(GemmTypes types, const int64_t* m_G, int64_t G,
                                           int64_t N, int64_t K, bool trans_w);
// Wgrad: dy is our A (transposed), x our B, dw the C (beta 1: accumulates).
GroupedBatchedDesc grouped_batched_wgrad(GemmTypes types, const int64_t* m_G, int64_t G, int64_t N,
                                         int64_t K);

}  // namespace moecore::ops::desc
