// The CUDA build checks the project's mirrors of the library enums (ops/desc/library_enums.h)
// against the real headers, so the descriptors' values can be cast straight to library types.
#include <cublasLt.h>
#include <library_types.h>
#include <nccl.h>

#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

static_assert(static_cast<int>(BlasOp::N) == CUBLAS_OP_N);
static_assert(static_cast<int>(BlasOp::T) == CUBLAS_OP_T);
static_assert(static_cast<int>(BlasDataType::R32F) == CUDA_R_32F);
static_assert(static_cast<int>(BlasDataType::R64F) == CUDA_R_64F);
static_assert(static_cast<int>(BlasDataType::R16BF) == CUDA_R_16BF);
static_assert(static_cast<int>(BlasComputeType::F32) == CUBLAS_COMPUTE_32F);
static_assert(static_cast<int>(BlasComputeType::F64) == CUBLAS_COMPUTE_64F);
static_assert(static_cast<int>(BlasComputeType::F32FastTf32) == CUBLAS_COMPUTE_32F_FAST_TF32);
static_assert(static_cast<int>(NcclDataType::Int32) == ncclInt32);
static_assert(static_cast<int>(NcclDataType::Int64) == ncclInt64);
static_assert(static_cast<int>(NcclDataType::Float32) == ncclFloat32);
static_assert(static_cast<int>(NcclDataType::Float64) == ncclFloat64);
static_assert(static_cast<int>(NcclDataType::Bfloat16) == ncclBfloat16);
static_assert(static_cast<int>(NcclRedOp::Sum) == ncclSum);
static_assert(static_cast<int>(NcclRedOp::Max) == ncclMax);

}  // namespace moecore::ops::desc
