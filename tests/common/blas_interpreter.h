// Test-only plain-loop interpreters of cuBLASLt's cublasLtMatmul and cuBLAS's
// cublasGemmGroupedBatchedEx as documented (https://docs.nvidia.com/cuda/cublas/): column-major
// storage, element (r, c) of a matrix with leading dimension ld at r + c * ld; op(X) = X or X^T;
// D = alpha * op(A) op(B) + beta * C, C not read when beta == 0. Each checks what the library
// checks (layout rows/cols match the op and m/n/k, ld >= rows, supported type combinations) and
// sums in double in k order, as ops::gemm_ref does, so results compare bitwise.
// CUBLAS_COMPUTE_32F_FAST_TF32 is modelled as NVIDIA describes TF32 tensor-core math: each f32
// input rounded to TF32 (cvt.rna.tf32.f32's rounding: to nearest, ties away from zero; 10
// explicit mantissa bits), the products exact (11 x 11 significant bits fit an f32), summed in
// f32 in k order, then alpha / beta applied in f32. The library only "allows down-converting"
// (cublas_api.h): it may also read the f32 bits with the low 13 cut off (the tensor core's
// truncation) or not convert at all, so tests hold the result to a bound valid for either
// rounding (tf32_truncate is the other model), not to these bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/blas_args.h"
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
  const bool f32 =
      (compute == BlasComputeType::F32 || compute == BlasComputeType::F32FastTf32) &&
      a == BlasDataType::R32F && b == BlasDataType::R32F && c == BlasDataType::R32F;
  const bool f64 = compute == BlasComputeType::F64 && a == BlasDataType::R64F &&
                   b == BlasDataType::R64F && c == BlasDataType::R64F;
  const bool bf16 = compute == BlasComputeType::F32 && a == BlasDataType::R16BF &&
                    b == BlasDataType::R16BF &&
                    (c == BlasDataType::R32F || c == BlasDataType::R16BF);
  if (!(f32 || f64 || bf16)) throw std::runtime_error("cuBLAS: CUBLAS_STATUS_NOT_SUPPORTED types");
}

// f32 -> TF32 (8 exponent bits, 10 explicit mantissa bits, kept in an f32), rounded to nearest
// with ties away from zero: cvt.rna.tf32.f32 (PTX ISA), which adds half an ulp of TF32 (bit 12)
// to the bits and clears the low 13. Inf and NaN pass unchanged; a value that rounds past the
// largest TF32 becomes inf, as the hardware's add carries into the exponent.
inline float tf32_round(float x) {
  if (!std::isfinite(x)) return x;
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return std::bit_cast<float>((u + 0x1000u) & 0xffffe000u);
}
// The other documented reading: the tensor core takes the f32 bits' top 19 (the low 13 mantissa
// bits ignored), i.e. rounding toward zero.
inline float tf32_truncate(float x) {
  if (std::isnan(x)) return x;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0xffffe000u);
}

// The TF32 GEMM's bound (docs/numerics.md, "TF32 GEMM vs its exact product"), per element of
// C = A B against the exact product of the f32 inputs: each input rounded to TF32 errs by at most
// u_t |x|, u_t = 2^-10 when the library truncates and 2^-11 when it rounds to nearest, so a
// product errs by (2 u_t + u_t^2) |a b|; the products are exact in f32 and summed in f32
// (gamma_K = K u / (1 - K u), u = 2^-24, in any order). Bound: (2 u_t + u_t^2 + gamma_K)
// sum_k |a_ik| |b_kj| with the truncation's u_t, valid for both roundings.
inline constexpr double kTf32UnitTruncate = 0x1p-10;
inline constexpr double kF32UnitRoundoff = 0x1p-24;
inline double tf32_gemm_bound_factor(double K) {
  const double gamma = K * kF32UnitRoundoff / (1 - K * kF32UnitRoundoff);
  return 2 * kTf32UnitTruncate + kTf32UnitTruncate * kTf32UnitTruncate + gamma;
}

// Which f32 -> TF32 rounding the COMPUTE_32F_FAST_TF32 model applies (tests switch it to show
// that their bound holds for both); the emulated build uses the default.
enum class Tf32Rounding { NearestTiesAway, Truncate };
inline Tf32Rounding& tf32_rounding() {
  static Tf32Rounding r = Tf32Rounding::NearestTiesAway;
  return r;
}

// One column-major problem in TF32 (the model above): f32 operands and output.
inline void blas_gemm_colmajor_tf32(BlasOp op_a, BlasOp op_b, int64_t m, int64_t n, int64_t k,
                                    double alpha, const float* A, int64_t lda, const float* B,
                                    int64_t ldb, double beta, float* C, int64_t ldc) {
  const bool away = tf32_rounding() == Tf32Rounding::NearestTiesAway;
  const auto tf32 = [away](float x) { return away ? tf32_round(x) : tf32_truncate(x); };
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) {
        const float a = tf32(A[op_a == BlasOp::N ? i + p * lda : p + i * lda]);
        const float b = tf32(B[op_b == BlasOp::N ? p + j * ldb : j + p * ldb]);
        acc += a * b;  // exact product (22 significant bits), one f32 rounding per addition
      }
      float& c = C[i + j * ldc];
      c = beta == 0.0 ? alpha32 * acc : alpha32 * acc + beta32 * c;
    }
  }
}

// One column-major problem.
inline void blas_gemm_colmajor(BlasOp op_a, BlasOp op_b, int64_t m, int64_t n, int64_t k,
                               double alpha, BlasDataType at, const void* A, int64_t lda,
                               BlasDataType bt, const void* B, int64_t ldb, double beta,
                               BlasDataType ct, void* C, int64_t ldc,
                               BlasComputeType compute = BlasComputeType::F32) {
  if (compute == BlasComputeType::F32FastTf32) {
    blas_check_types(compute, at, bt, ct);
    blas_gemm_colmajor_tf32(op_a, op_b, m, n, k, alpha, static_cast<const float*>(A), lda,
                            static_cast<const float*>(B), ldb, beta, static_cast<float*>(C), ldc);
    return;
  }
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
  const size_t as = ops::desc::blas_type_bytes(A.type), cs = ops::desc::blas_type_bytes(Cl.type);
  for (int32_t b = 0; b < Cl.batch_count; ++b) {
    const char* pa = static_cast<const char*>(a_slot) + b * A.batch_stride * as;
    const char* pb = static_cast<const char*>(b_slot) + b * B.batch_stride * as;
    char* pc = static_cast<char*>(C) + b * Cl.batch_stride * cs;
    blas_gemm_colmajor(d.trans_a, d.trans_b, d.m, d.n, d.k, d.alpha, A.type, pa, A.ld, B.type, pb,
                       B.ld, d.beta, Cl.type, pc, Cl.ld, d.compute);
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
                         d.c_type, Carray[problem], d.ldc[g], d.compute);
    }
  }
}

// The same with the pointer tables built from the descriptor's offsets into the slot operands'
// bases (what the backend uploads) and the descriptor's scalars.
inline void gemm_grouped_batched(const ops::desc::GroupedBatchedDesc& d, const void* a_base,
                                 const void* b_base, void* c_base) {
  const size_t as = ops::desc::blas_type_bytes(d.a_type), cs = ops::desc::blas_type_bytes(d.c_type);
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
