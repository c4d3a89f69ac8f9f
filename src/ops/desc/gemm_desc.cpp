// The row-major -> cuBLASLt column-major translation (see gemm_desc.h for the algebra).
#include "ops/desc/gemm_desc.h"

#include <limits>

#include "core/check.h"
#include "ops/desc/blas_args.h"

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

BlasDataType gemm_input_type(GemmTypes types) {
  switch (types) {
    case GemmTypes::F64: return BlasDataType::R64F;
    case GemmTypes::Bf16F32:
    case GemmTypes::Bf16Bf16: return BlasDataType::R16BF;
    case GemmTypes::F32:
    case GemmTypes::F32Tf32: break;
  }
  return BlasDataType::R32F;
}

BlasDataType gemm_output_type(GemmTypes types) {
  switch (types) {
    case GemmTypes::F64: return BlasDataType::R64F;
    case GemmTypes::Bf16Bf16: return BlasDataType::R16BF;
    case GemmTypes::F32:
    case GemmTypes::F32Tf32:
    case GemmTypes::Bf16F32: break;
  }
  return BlasDataType::R32F;
}

BlasComputeType gemm_compute_type(GemmTypes types) {
  switch (types) {
    case GemmTypes::F64: return BlasComputeType::F64;
    case GemmTypes::F32Tf32: return BlasComputeType::F32FastTf32;  // TF32 products (opt-in)
    case GemmTypes::F32:  // not _FAST_TF32: full f32 products (library_enums.h)
    case GemmTypes::Bf16F32:
    case GemmTypes::Bf16Bf16: break;
  }
  return BlasComputeType::F32;
}

int64_t gemm_input_bytes(GemmTypes types) {
  return static_cast<int64_t>(blas_type_bytes(gemm_input_type(types)));
}

int64_t gemm_output_bytes(GemmTypes types) {
  return static_cast<int64_t>(blas_type_bytes(gemm_output_type(types)));
}

const char* gemm_types_name(GemmTypes types) {
  switch (types) {
    case GemmTypes::F64: return "f64";
    case GemmTypes::Bf16F32: return "bf16";
    case GemmTypes::F32Tf32: return "tf32 (f32 with TF32 products)";
    case GemmTypes::Bf16Bf16: return "bf16 -> bf16";
    case GemmTypes::F32: break;
  }
  return "f32";
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
  // A bf16 D holds the rounded result only: accumulating into it (beta 1) would round twice.
  MOE_CHECK(call.types != GemmTypes::Bf16Bf16 || call.beta == 0.0,
            "[gemm_desc] a bf16 output is assigned only (beta={} asks to add to it): use the f32 "
            "output (Bf16F32) to accumulate",
            call.beta);
  LtMatmulDesc d;
  const BlasDataType in = gemm_input_type(call.types), out = gemm_output_type(call.types);
  d.compute = gemm_compute_type(call.types);
  d.scale_type = blas_scale_type(d.compute);
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
