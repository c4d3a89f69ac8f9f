// What the CUDA backend hands cuBLASLt / cuBLAS for a GEMM descriptor beyond the descriptor's own
// fields: the operand in each library slot, alpha and beta as the bytes of the scale type, and
// the grouped call's per-problem pointer tables and per-group scalar arrays. One function each,
// shared by the cuBLASLt backend (ops/cuda/blas_cublaslt.cpp) and its emulated twin
// (tests/emu/blas_emu.cpp), so the twin's tests cover this plumbing; no CUDA headers needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/desc/gemm_desc.h"
#include "ops/desc/grouped_gemm_desc.h"
#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

size_t blas_type_bytes(BlasDataType t);  // 4, 8, 2
// The scale type of a compute type (cublasGemmGroupedBatchedEx's alpha/beta arrays): R64F for
// F64, else R32F.
BlasDataType blas_scale_type(BlasComputeType compute);

// The pointers for cublasLtMatmul's A and B slots: the project operands the descriptor names
// (d.a_operand / d.b_operand; gemm_desc.h swaps them for the column-major view).
struct MatmulOperands {
  const void* a_slot = nullptr;
  const void* b_slot = nullptr;
};
MatmulOperands matmul_operands(const LtMatmulDesc& d, const void* A, const void* B);

// One scalar as the library reads it through a host pointer: a float for R32F, a double for
// R64F (cublasLtMatmul's alpha/beta follow the descriptor's scale type).
struct BlasScalar {
  alignas(8) unsigned char bytes[8] = {};
  const void* ptr() const { return bytes; }
};
BlasScalar blas_scalar(BlasDataType scale_type, double v);
// What the library reads from p for a scale type (the interpreters decode scalars with it).
double blas_scalar_value(BlasDataType scale_type, const void* p);

// cublasGemmGroupedBatchedEx's per-problem device addresses (before upload: the backend copies
// these host tables to device memory) and per-group alpha/beta host arrays in the scale type.
struct GroupedArgs {
  std::vector<const void*> a, b;  // one per problem: the A and B slots' matrices
  std::vector<void*> c;
  std::vector<unsigned char> alpha, beta;  // group_count scalars of blas_scale_type(compute)
};
// A, B, C: the bases of the project's operands (x / w / y, or dy / x / dw); each slot's table
// adds the descriptor's element offsets to the base of the operand it names.
GroupedArgs grouped_args(const GroupedBatchedDesc& d, const void* A, const void* B, void* C);

}  // namespace moecore::ops::desc
