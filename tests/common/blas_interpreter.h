// Test-only plain-loop interpreters of cuBLASLt's cublasLtMatmul and cuBLAS's
// cublasGemmGroupedBatchedEx as documented (https://docs.nvidia.com/cuda/cublas/): column-major
// storage, element (r, c) of a matrix with leading dimension ld at r + c * ld; op(X) = X or X^T;
// D = alpha * op(A) op(B) + beta * C, C not read when beta == 0. Each checks what the library
// checks (layout rows/cols match the op and m/n/k, ld >= rows, supported type combinations) and
// sums in double in k order, as ops::gemm_ref does, so results compare bitwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/gemm_desc.h"
#include "ops/desc/grouped_gemm_desc.h"

namespace moecore::testing {

using ops::desc::BlasComputeType;
using ops::desc::BlasDataType;
using ops::desc::BlasOp;

inline double blas_load(BlasDataType t, const void* p, int64_t i) {
  switch (t) {
    case BlasDataType::R32F: return static_cast<const float*>(p)[i];
    case BlasDataType::R64F: return static_cast<const double*>(p)[i];
    case BlasDataType::R16BF: return bf16_to_float(static_cast<const bf16*>(p)[i]);
  }
  throw std::runtime_error("blas_load: bad type");
}

inline void blas_store(BlasDataType t, void* p, int64_t i, double v) {
  switch (t) {
    case BlasDataType::R32F: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case BlasDataType::R64F: static_cast<double*>(p)[i] = v; return;
    case BlasDataType::R16BF: static_cast<bf16*>(p)[i] = float_to_bf16(static_cast<float>(v)); return;
  }
}

// The type combinations this project uses, from cublasLtMatmul's table of supported types.
inline void blas_check_types(BlasComputeType compute, BlasDataType a, BlasDataType b,
                             BlasDataType c) {
  const bool f32 = compute == BlasComputeType::F32 && a == BlasDataType::R32F &&
                   b == BlasDataType::R32F && c == BlasDataType::R32F;
  const bool f64 = compute == BlasComputeType::F64 && a == BlasDataType::R64F &&
                   b == BlasDataType::R64F && c == BlasDataType::R64F;
  const bool bf16 = compute == BlasComputeType::F32 && a == BlasDataType::R16BF &&
                    b == BlasDataType::R16BF && c == BlasDataType::R32F;
  if (!(f32 || f64 || bf16)) throw std::runtime_error("cuBLAS: CUBLAS_STATUS_NOT_SUPPORTED types");
}

// One column-major problem.
inline void blas_gemm_colmajor(BlasOp op_a, BlasOp op_b, int64_t m, int64_t n, int64_t k,
                               double alpha, BlasDataType at, const void* A, int64_t lda,
                               BlasDataType bt, const void* B, int64_t ldb, double beta,
                               BlasDataType ct, void* C, int64_t ldc) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        double a = blas_load(at, A, op_a == BlasOp::N ? i + p * lda : p + i * lda);
        double b = blas_load(bt, B, op_b == BlasOp::N ? p + j * ldb : j + p * ldb);
        acc += a * b;
      }
      double c = beta == 0.0 ? 0.0 : beta * blas_load(ct, C, i + j * ldc);
      blas_store(ct, C, i + j * ldc, alpha * acc + c);
    }
  }
}

// cublasLtMatmul with the descriptor's layouts; a_slot / b_slot are the pointers the backend
// passes (the project operands named by d.a_operand / d.b_operand), C is also D.
inline void lt_matmul(const ops::desc::LtMatmulDesc& d, const void* a_slot, const void* b_slot,
                      void* C) {
  if (d.empty) return;
  blas_check_types(d.compute, d.a.type, d.b.type, d.c.type);
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw std::runtime_error("cuBLASLt: CUBLAS_STATUS_INVALID_VALUE: " + what);
  };
  const auto& A = d.a;
  const auto& B = d.b;
  const auto& Cl = d.c;
  check(A.rows == (d.trans_a == BlasOp::N ? d.m : d.k) &&
            A.cols == (d.trans_a == BlasOp::N ? d.k : d.m),
        "A layout does not match op_a(A) [m,k]");
  check(B.rows == (d.trans_b == BlasOp::N ? d.k : d.n) &&
            B.cols == (d.trans_b == BlasOp::N ? d.n : d.k),
        "B layout does not match op_b(B) [k,n]");
  check(Cl.rows == d.m && Cl.cols == d.n, "C layout is not [m,n]");
  check(A.ld >= A.rows && B.ld >= B.rows && Cl.ld >= Cl.rows, "ld < rows");
  check(A.batch_count == B.batch_count && B.batch_count == Cl.batch_count, "batch counts differ");
  const size_t as = A.type == BlasDataType::R16BF ? 2 : (A.type == BlasDataType::R64F ? 8 : 4);
  const size_t cs = Cl.type == BlasDataType::R64F ? 8 : 4;
  for (int32_t b = 0; b < Cl.batch_count; ++b) {
    const char* pa = static_cast<const char*>(a_slot) + b * A.batch_stride * as;
    const char* pb = static_cast<const char*>(b_slot) + b * B.batch_stride * as;
    char* pc = static_cast<char*>(C) + b * Cl.batch_stride * cs;
    blas_gemm_colmajor(d.trans_a, d.trans_b, d.m, d.n, d.k, d.alpha, A.type, pa, A.ld, B.type, pb,
                       B.ld, d.beta, Cl.type, pc, Cl.ld);
  }
}

// cublasGemmGroupedBatchedEx as called: per problem the device addresses in Aarray / Barray /
// Carray, per group alpha / beta read from host arrays of the compute type's scale type (float
// for COMPUTE_32F, double for COMPUTE_64F).
inline void gemm_grouped_batched_tables(const ops::desc::GroupedBatchedDesc& d,
                                        const void* alpha_array, const void* const* Aarray,
                                        const void* const* Barray, const void* beta_array,
                                        void* const* Carray) {
  blas_check_types(d.compute, d.a_type, d.b_type, d.c_type);
  const BlasDataType scale =
      d.compute == BlasComputeType::F64 ? BlasDataType::R64F : BlasDataType::R32F;
  int64_t problem = 0;
  for (int32_t g = 0; g < d.group_count; ++g) {
    if (d.m[g] < 0 || d.n[g] < 0 || d.k[g] < 0)
      throw std::runtime_error("cuBLAS: CUBLAS_STATUS_INVALID_VALUE: negative size");
    const int64_t a_rows = d.transa[g] == BlasOp::N ? d.m[g] : d.k[g];
    const int64_t b_rows = d.transb[g] == BlasOp::N ? d.k[g] : d.n[g];
    if (d.lda[g] < std::max<int64_t>(1, a_rows) || d.ldb[g] < std::max<int64_t>(1, b_rows) ||
        d.ldc[g] < std::max<int64_t>(1, d.m[g]))
      throw std::runtime_error("cuBLAS: CUBLAS_STATUS_INVALID_VALUE: ld < max(1, rows)");
    const double alpha = blas_load(scale, alpha_array, g), beta = blas_load(scale, beta_array, g);
    for (int32_t i = 0; i < d.group_size[g]; ++i, ++problem) {
      blas_gemm_colmajor(d.transa[g], d.transb[g], d.m[g], d.n[g], d.k[g], alpha, d.a_type,
                         Aarray[problem], d.lda[g], d.b_type, Barray[problem], d.ldb[g], beta,
                         d.c_type, Carray[problem], d.ldc[g]);
    }
  }
}

// The same with the pointer tables built from the descriptor's offsets into the slot operands'
// bases (what the backend uploads) and the descriptor's scalars.
inline void gemm_grouped_batched(const ops::desc::GroupedBatchedDesc& d, const void* a_base,
                                 const void* b_base, void* c_base) {
  const size_t as = d.a_type == BlasDataType::R16BF ? 2 : (d.a_type == BlasDataType::R64F ? 8 : 4);
  const size_t cs = d.c_type == BlasDataType::R64F ? 8 : 4;
  std::vector<const void*> A, B;
  std::vector<void*> C;
  for (size_t p = 0; p < d.a_off.size(); ++p) {
    A.push_back(static_cast<const char*>(a_base) + d.a_off[p] * as);
    B.push_back(static_cast<const char*>(b_base) + d.b_off[p] * as);
    C.push_back(static_cast<char*>(c_base) + d.c_off[p] * cs);
  }
  const bool f64 = d.compute == BlasComputeType::F64;
  std::vector<double> alpha64(d.alpha), beta64(d.beta);
  std::vector<float> alpha32(d.alpha.begin(), d.alpha.end()), beta32(d.beta.begin(), d.beta.end());
  gemm_grouped_batched_tables(
      d, f64 ? static_cast<const void*>(alpha64.data()) : alpha32.data(), A.data(), B.data(),
      f64 ? static_cast<const void*>(beta64.data()) : beta32.data(), C.data());
}

}  // namespace moecore::testing
