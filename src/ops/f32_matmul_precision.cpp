// The process-wide f32 GEMM arithmetic (ops/f32_matmul_precision.h).
#include "ops/f32_matmul_precision.h"

#include <atomic>

#include "core/check.h"

namespace moecore::ops {

namespace {
std::atomic<F32MatmulPrecision> g_precision{F32MatmulPrecision::Highest};
}  // namespace

F32MatmulPrecision parse_f32_matmul_precision(std::string_view name) {
  if (name == "highest") return F32MatmulPrecision::Highest;
  if (name == "high") return F32MatmulPrecision::High;
  MOE_FAIL(
      "[gemm] --fp32-matmul-precision {}: the choices are highest (full f32 GEMM products, the "
      "default) and high (TF32 tensor-core products on --device cuda)",
      name);
}

std::string_view f32_matmul_precision_name(F32MatmulPrecision p) {
  return p == F32MatmulPrecision::High ? "high" : "highest";
}

void set_f32_matmul_precision(F32MatmulPrecision p) { g_precision.store(p); }

F32MatmulPrecision f32_matmul_precision() { return g_precision.load(); }

bool f32_gemm_tf32(Device device) {
  return device != Device::CPU && f32_matmul_precision() == F32MatmulPrecision::High;
}

std::string f32_gemm_line(Device device) {
  const bool high = f32_matmul_precision() == F32MatmulPrecision::High;
  if (device == Device::CPU) {
    return high ? "[gemm] f32 GEMMs: TF32 off (--fp32-matmul-precision high changes nothing on "
                  "--device cpu, which has no TF32: full f32 products)"
                : "";
  }
  return f32_gemm_tf32(device)
             ? "[gemm] f32 GEMMs: TF32 on (--fp32-matmul-precision high: "
               "CUBLAS_COMPUTE_32F_FAST_TF32, inputs rounded to 10 mantissa bits, f32 sums)"
             : "[gemm] f32 GEMMs: TF32 off (--fp32-matmul-precision highest: CUBLAS_COMPUTE_32F, "
               "full f32 products)";
}

}  // namespace moecore::ops
