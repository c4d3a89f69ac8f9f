// The row-major -> cuBLASLt column-major translation (see gemm_desc.h for the algebra).
#include "ops/desc/gemm_desc.h"

#include <limits>

#include "core/check.h"

namespace moecore::ops::desc {

ColumnMajorGemm column_major_gemm(const char* who, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                  int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  MOE_CHECK(M >= 0 && N >= 0 && K >= 0, "[{}] negative size M={} N={} K={}", who, M, N, K);
  const int64_t a_width = trans_a ? M : K, b_width = trans_b ? K : N;
  MOE_CHECK(lda >= a_width && lda >= 1,
            "[{}] lda={} is less than A's stored row of {} elements (M={} K={} trans_a={}): pass "
            "the row stride of A as stored",
            who, lda, a_width, M, K, trans_a);
  MOE_CHECK(ldb >= b_width && ldb >= 1,
            "[{}] ldb={} is less than B's stored row of {} elements (K={} N={} trans_b={}): pass "
            "the row stride of B as stored",
            who, ldb, b_width, K, N, trans_b);
  MOE_CHECK(ldc >= N && ldc >= 1, "[{}] ldc={} is less than C's row of N={} elements", who, ldc,
            N);
  ColumnMajorGemm g;
  // C^T = op(B)^T op(A)^T: our B in the A slot, our A in the B slot (gemm_desc.h).
  g.a_operand = GemmOperand::B;
  g.b_operand = GemmOperand::A;
  g.op_a = trans_b ? BlasOp::T : BlasOp::N;
  g.op_b = trans_a ? BlasOp::T : BlasOp::N;
  g.m = N;
  g.n = M;
  g.k = K;
  g.lda = ldb;
  g.ldb = lda;
  g.ldc = ldc;
  return g;
}

namespace {

LtMatrixLayout layout(BlasDataType type, BlasOp op, int64_t rows_op, int64_t cols_op, int64_t ld,
                      int64_t batch, int64_t stride) {
  // The layout describes the matrix as stored: op = T stores op(X)^T.
  LtMatrixLayout l;
  l.type = type;
  l.rows = op == BlasOp::N ? rows_op : cols_op;
  l.cols = op == BlasOp::N ? cols_op : rows_op;
  l.ld = ld;
  l.batch_count = static_cast<int32_t>(batch);
  l.batch_stride = stride;
  return l;
}

}  // namespace

LtMatmulDesc gemm_desc(const GemmCall& call) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  MOE_CHECK(call.batch >= 0, "[gemm_desc] batch={} must be >= 0", call.batch);
  MOE_CHECK(call.batch <= kInt32Max, "[gemm_desc] batch={} exceeds cuBLASLt's int32 batch count",
            call.batch);
  MOE_CHECK(call.stride_a >= 0 && call.stride_b >= 0 && call.stride_c >= 0,
            "[gemm_desc] negative batch stride (A {} B {} C {})", call.stride_a, call.stride_b,
            call.stride_c);
  ColumnMajorGemm g = column_major_gemm("gemm_desc", call.trans_a, call.trans_b, call.M, call.N,
                                        call.K, call.lda, call.ldb, call.ldc);
  MOE_CHECK(g.m <= kInt32Max && g.n <= kInt32Max && g.k <= kInt32Max,
            "[gemm_desc] M={} N={} K={}: cuBLASLt supports sizes up to 2^31-1; split the GEMM",
            call.M, call.N, call.K);
  LtMatmulDesc d;
  BlasDataType in = BlasDataType::R32F, out = BlasDataType::R32F;
  switch (call.types) {
    case GemmTypes::F32:
      d.compute = BlasComputeType::F32;  // not _FAST_TF32: full f32 products (library_enums.h)
      d.scale_type = BlasDataType::R32F;
      break;
    case GemmTypes::F32Tf32:
      d.compute = BlasComputeType::F32FastTf32;  // f32 in and out, TF32 products (opt-in)
      d.scale_type = BlasDataType::R32F;
      break;
    case GemmTypes::F64:
      in = out = BlasDataType::R64F;
      d.compute = BlasComputeType::F64;
      d.scale_type = BlasDataType::R64F;
      break;
    case GemmTypes::Bf16F32:
      in = BlasDataType::R16BF;
      d.compute = BlasComputeType::F32;
      d.scale_type = BlasDataType::R32F;
      break;
  }
  d.trans_a = g.op_a;
  d.trans_b = g.op_b;
  d.m = g.m;
  d.n = g.n;
  d.k = g.k;
  d.a_operand = g.a_operand;
  d.b_operand = g.b_operand;
  // The A slot holds our B (its batch stride too), the B slot our A.
  d.a = layout(in, g.op_a, g.m, g.k, g.lda, call.batch, call.stride_b);
  d.b = layout(in, g.op_b, g.k, g.n, g.ldb, call.batch, call.stride_a);
  d.c = layout(out, BlasOp::N, g.m, g.n, g.ldc, call.batch, call.stride_c);
  d.alpha = call.alpha;
  d.beta = call.beta;
  d.empty = g.m == 0 || g.n == 0 || call.batch == 0;
  return d;
}

}  // namespace moecore::ops::desc
