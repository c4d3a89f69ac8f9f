// AdamW on the GPU: one grid-stride pass over p, g, m, v (memory-bound: each array touched once),
// writing the bf16 copy and the widened bf16 copy of p in the same pass when there are some. The
// step's scalars (lr, step, grad_scale, skip) are read on the device, so a captured step replays
// with each step's values; skip leaves everything as it is. The element update is the CPU fast
// path's arithmetic (ops/cpu/adamw.cpp: constants in double rounded once to T, m and v re-read as
// stored), so the two agree bitwise where both compile it alike (FMA contraction aside), within
// f32 rounding of adamw_ref; the bf16 copies are cast_f32_to_bf16's bits of the new p.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/adamw.h"
#include "ops/cast.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
struct AdamWDeviceConsts {
  T b1, one_m_b1, b2, one_m_b2, inv_bc1, inv_bc2, lr, wd, eps, scale;
};

template <typename T>
__device__ __forceinline__ AdamWDeviceConsts<T> adamw_device_consts(const AdamWParams& a,
                                                                    const AdamWStep& s) {
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(s.step));
  return {static_cast<T>(a.beta1),       static_cast<T>(1.0 - a.beta1),  static_cast<T>(a.beta2),
          static_cast<T>(1.0 - a.beta2), static_cast<T>(1.0 / bc1),      static_cast<T>(1.0 / bc2),
          static_cast<T>(s.lr),          static_cast<T>(a.weight_decay), static_cast<T>(a.eps),
          static_cast<T>(s.grad_scale)};
}

// p16 / p16w: null, or the bf16 copy's bits and the widened copy (T = float only).
template <typename T>
__global__ void adamw_step(T* p, const T* g, float* m, float* v, int64_t n, AdamWParams a,
                           const AdamWStep* s, uint16_t* p16, float* p16w) {
  const AdamWStep st = *s;
  if (st.skip) return;
  const AdamWDeviceConsts<T> c = adamw_device_consts<T>(a, st);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = c.scale * g[i];
    const T mi = c.b1 * static_cast<T>(m[i]) + c.one_m_b1 * gi;
    const T vi = c.b2 * static_cast<T>(v[i]) + c.one_m_b2 * gi * gi;
    const float m32 = static_cast<float>(mi), v32 = static_cast<float>(vi);
    m[i] = m32;
    v[i] = v32;
    // The stored (f32) m, v, as the CPU path: both backends carry the same state to the next step.
    const T mhat = static_cast<T>(m32) * c.inv_bc1;
    const T vhat = static_cast<T>(v32) * c.inv_bc2;
    const T p0 = p[i];
    const T pi = p0 - c.lr * (mhat / (std::sqrt(vhat) + c.eps) + c.wd * p0);
    p[i] = pi;
    if constexpr (std::is_same_v<T, float>) {
      if (p16) p16[i] = f32_to_bf16_bits(pi);
      if (p16w) p16w[i] = f32_bf16_rounded(pi);
    }
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;  // one H200 wave; threads stride the rest
}  // namespace

template <typename T>
void adamw_step(void* stream, T* p, const T* g, float* m, float* v, int64_t n,
                const AdamWParams& a, const AdamWStep* s, bf16* p16, float* p16w) {
  MOE_KERNEL_CHECK(s != nullptr, "[adamw] no step scalars (AdamWStep) given");
  MOE_KERNEL_CHECK(n >= 0, "[adamw] n=" + std::to_string(n) + " < 0");
  // The run's constants are host values; the step's (lr, step) are written by the host into the
  // step buffer, which checks them there (the op does not read device memory on the host).
  MOE_KERNEL_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
                   "[adamw] beta1=" + std::to_string(a.beta1) + " beta2=" +
                       std::to_string(a.beta2) + " must lie in [0, 1): fix --adam-beta1/--adam-beta2");
  MOE_KERNEL_CHECK(a.eps > 0, "[adamw] eps=" + std::to_string(a.eps) + " must be > 0: fix --adam-eps");
  MOE_KERNEL_CHECK(a.weight_decay >= 0, "[adamw] weight_decay=" + std::to_string(a.weight_decay) +
                                            " must be >= 0: fix --weight-decay");
  MOE_KERNEL_CHECK((std::is_same_v<T, float> || (p16 == nullptr && p16w == nullptr)),
                   "[adamw] a bf16 copy needs f32 parameters: f64 models keep no bf16 copies");
  if (n == 0) return;
  const int64_t blocks = std::min((n + kBlock - 1) / kBlock, kMaxBlocks);
  launch("adamw_step", kernels::adamw_step<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0,
         stream, p, g, m, v, n, a, s, reinterpret_cast<uint16_t*>(p16), p16w);
}

template void adamw_step<float>(void*, float*, const float*, float*, float*, int64_t,
                                const AdamWParams&, const AdamWStep*, bf16*, float*);
template void adamw_step<double>(void*, double*, const double*, float*, float*, int64_t,
                                 const AdamWParams&, const AdamWStep*, bf16*, float*);

}  // namespace moecore::ops::cuda
