// The cuBLASLt matmul descriptor of one row-major GEMM call (ops::gemm, gemm_bf16, the
// strided-batched padded grouped GEMM): a pure function from the project's arguments to exactly
// what the CUDA backend hands cuBLASLt, tested on the CPU through a plain-loop interpreter of
// cuBLASLt's documented column-major semantics (tests/common/blas_interpreter.h).
//
// cuBLAS is column-major (https://docs.nvidia.com/cuda/cublas/#data-layout): a row-major C[M,N]
// with row stride ldc is, read column-major, C^T [N,M] with leading dimension ldc. So
//   C = op(A) op(B)   <=>   C^T = op(B)^T op(A)^T,
// which cuBLAS computes with its A slot holding our B, its B slot our A, m = N, n = M, k = K,
// op_A = (trans_b ? T : N), op_B = (trans_a ? T : N), and every leading dimension unchanged.
#pragma once

#include <cstdint>

#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

// The element types of a GEMM and, for f32, its arithmetic: f32 (CUBLAS_COMPUTE_32F, full f32
// products: the reference), f32 with TF32 products (F32Tf32: f32 operands and output, the inputs
// rounded to TF32 by the library, CUBLAS_COMPUTE_32F_FAST_TF32; --fp32-matmul-precision high on
// CUDA), f64, bf16 operands with f32 output (--bf16), or bf16 operands with a bf16 output
// (Bf16Bf16: the f32 accumulation rounded to nearest even once, as the f32 output cast to bf16
// would be; D assigned only, beta 0: fc1's h under --bf16).
enum class GemmTypes : uint8_t { F32, F64, Bf16F32, F32Tf32, Bf16Bf16 };

// The types' library element types, compute type and element sizes (one place for every
// backend, descriptor and interpreter).
BlasDataType gemm_input_type(GemmTypes types);   // A and B
BlasDataType gemm_output_type(GemmTypes types);  // C and D
BlasComputeType gemm_compute_type(GemmTypes types);
int64_t gemm_input_bytes(GemmTypes types);
int64_t gemm_output_bytes(GemmTypes types);
// "f32", "f64", "bf16", "tf32 (f32 with TF32 products)", "bf16 -> bf16"
const char* gemm_types_name(GemmTypes types);

// The project's operands, to say which one goes in a library slot.
enum class GemmOperand : uint8_t { A, B };

// A row-major GEMM as the project states it (ops/gemm.h): per batch item b,
//   C_b[M,N] = alpha * op(A_b) op(B_b) + beta * C_b,  X_b = X + b * stride_x,
// op(A) [M,K] (A stored [K,M] when trans_a), op(B) [K,N] (B stored [N,K] when trans_b);
// lda/ldb/ldc are row strides as stored. beta == 0: C is not read (BLAS convention).
struct GemmCall {
  GemmTypes types = GemmTypes::F32;
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  double alpha = 1.0, beta = 0.0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch items
};

// One problem in cuBLAS's column-major terms: op_a(A) is [m,k], op_b(B) is [k,n], C is [m,n];
// the A slot holds the project's operand a_operand, the B slot b_operand.
struct ColumnMajorGemm {
  BlasOp op_a = BlasOp::N, op_b = BlasOp::N;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  GemmOperand a_operand = GemmOperand::B, b_operand = GemmOperand::A;
};

// The row-major -> column-major swap of one problem. Checks sizes >= 0 and that each leading
// dimension covers its stored row (lda >= K, or M when trans_a; ldb >= N, or K when trans_b;
// ldc >= N), naming the values.
ColumnMajorGemm column_major_gemm(const char* who, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                  int64_t K, int64_t lda, int64_t ldb, int64_t ldc);

// cublasLtMatrixLayout_t attributes (https://docs.nvidia.com/cuda/cublas/#cublasltmatrixlayoutattribute-t):
// column-major (CUBLASLT_ORDER_COL), rows x cols as stored (before the op), ld the column stride.
struct LtMatrixLayout {
  BlasDataType type = BlasDataType::R32F;
  int64_t rows = 0, cols = 0, ld = 0;
  int32_t batch_count = 1;    // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT
  int64_t batch_stride = 0;   // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, elements
};

// cublasLtMatmul's D = alpha * op_a(A) op_b(B) + beta * C with D == C (in place, same layout)
// (https://docs.nvidia.com/cuda/cublas/#cublasltmatmul), plus the cublasLtMatmulDesc_t
// attributes: compute type, scale type (of alpha and beta), TRANSA / TRANSB.
struct LtMatmulDesc {
  BlasComputeType compute = BlasComputeType::F32;
  BlasDataType scale_type = BlasDataType::R32F;
  BlasOp trans_a = BlasOp::N, trans_b = BlasOp::N;
  int64_t m = 0, n = 0, k = 0;
  LtMatrixLayout a, b, c;  // D uses c's layout
  GemmOperand a_operand = GemmOperand::B, b_operand = GemmOperand::A;
  double alpha = 1.0, beta = 0.0;  // passed in scale_type
  bool empty = false;  // m, n or the batch 0: nothing to compute, the backend makes no call
};

// The descriptor of a row-major call. Checks the call (sizes, leading dimensions, batch >= 0,
// strides >= 0, m/n/k and batch within cuBLASLt's int32 limits) and names the values.
LtMatmulDesc gemm_desc(const GemmCall& call);

}  // namespace moecore::ops::desc
