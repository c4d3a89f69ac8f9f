// Names of the mirrored library enums, for error messages and test traces.
#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

const char* blas_op_name(BlasOp op) { return op == BlasOp::N ? "CUBLAS_OP_N" : "CUBLAS_OP_T"; }

const char* blas_data_type_name(BlasDataType t) {
  switch (t) {
    case BlasDataType::R32F: return "CUDA_R_32F";
    case BlasDataType::R64F: return "CUDA_R_64F";
    case BlasDataType::R16BF: return "CUDA_R_16BF";
  }
  return "?";
}

const char* blas_compute_type_name(BlasComputeType t) {
  switch (t) {
    case BlasComputeType::F32: return "CUBLAS_COMPUTE_32F";
    case BlasComputeType::F64: return "CUBLAS_COMPUTE_64F";
    case BlasComputeType::F32FastTf32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
  }
  return "?";
}

}  // namespace moecore::ops::desc
