// The library enum values the CUDA backend's descriptors hand to cuBLAS / cuBLASLt and NCCL,
// mirrored as the project's own enums so the descriptor functions (and their interpreters)
// build and run without the CUDA headers. The values are the libraries' own: the CUDA build
// checks each against the real header (src/ops/cuda/library_enums_check.cu), so a descriptor
// can be cast straight to the library type.
#pragma once

#include <cstdint>

namespace moecore::ops::desc {

// cublasOperation_t (cublas_api.h).
enum class BlasOp : int32_t { N = 0, T = 1 };

// cudaDataType_t (library_types.h): the element types of GEMM operands and scales.
enum class BlasDataType : int32_t { R32F = 0, R64F = 1, R16BF = 14 };

// cublasComputeType_t (cublas_api.h). COMPUTE_32F is full f32 arithmetic, the reference and the
// default. COMPUTE_32F_FAST_TF32 lets the library round f32 inputs to TF32 (10 explicit mantissa
// bits) and multiply them on tensor cores, summing in f32: outside the f32 tolerances of
// docs/numerics.md (its own row there), so only an f32 GEMM asked for it names it
// (GemmTypes::F32Tf32, --fp32-matmul-precision high on CUDA).
enum class BlasComputeType : int32_t { F32 = 68, F64 = 70, F32FastTf32 = 77 };

// ncclDataType_t and ncclRedOp_t (nccl.h).
enum class NcclDataType : int32_t { Int32 = 2, Int64 = 4, Float32 = 7, Float64 = 8, Bfloat16 = 9 };
enum class NcclRedOp : int32_t { Sum = 0, Max = 2 };

const char* blas_op_name(BlasOp op);
const char* blas_data_type_name(BlasDataType t);
const char* blas_compute_type_name(BlasComputeType t);

}  // namespace moecore::ops::desc
