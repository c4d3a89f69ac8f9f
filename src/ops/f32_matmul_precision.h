// The arithmetic of the f32 GEMMs (--fp32-matmul-precision), process-wide as PyTorch's
// torch.set_float32_matmul_precision is (Megatron has no flag of its own: PyTorch's setting
// decides, "highest" by default for matmuls). Highest: full f32 products, the reference, bitwise
// what every test and golden digest holds. High: on CUDA the f32 GEMMs (ops::gemm, linear_*, the
// grouped GEMMs) ask cuBLASLt / cuBLAS for CUBLAS_COMPUTE_32F_FAST_TF32, which rounds the inputs
// to TF32 (10 explicit mantissa bits) for the tensor cores and sums in f32 (docs/numerics.md,
// "TF32 GEMM"). The CPU backend has no TF32: there High changes nothing (the trainer says so).
// f64 and bf16 GEMMs are not f32 GEMMs: unchanged either way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/exec.h"

namespace moecore::ops {

enum class F32MatmulPrecision : uint8_t { Highest, High };

// "highest" or "high" (PyTorch's names) -> the setting; anything else is an error naming both.
F32MatmulPrecision parse_f32_matmul_precision(std::string_view name);
std::string_view f32_matmul_precision_name(F32MatmulPrecision p);

// The process's setting (Highest until set): the trainer sets it from the flag before step 0.
void set_f32_matmul_precision(F32MatmulPrecision p);
F32MatmulPrecision f32_matmul_precision();

// Whether f32 GEMMs on this device take TF32 products: High on CUDA. (A device, not a context:
// these are settings, not ops of the backend table.)
bool f32_gemm_tf32(Device device);

// The start-up line of a run on this device: "[gemm] f32 GEMMs: TF32 on (...)" or "... TF32 off
// (...)"; empty on the CPU at Highest (nothing to say: the CPU always computes in full f32).
std::string f32_gemm_line(Device device);

}  // namespace moecore::ops
