// AdamW with Megatron's decoupled weight decay, on fp32 master values:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * p )
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

#include "core/dtype.h"

namespace moecore::ops {

// The constants of a run (the same every step).
struct AdamWParams {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// One step's scalars. The op reads them from memory (a planned buffer, on the device with a
// device backend), never by value: a captured step replays with each step's values. The host
// writes lr and step before the step; ops::grad_clip writes grad_scale and skip.
struct AdamWStep {
  double lr = 1e-3;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // g is multiplied by this first (clipping coefficient)
  int32_t skip = 0;         // non-zero: p, m, v (and the copies) stay as they are
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void adamw_step(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a,
                const AdamWStep* s, bf16* p16 = nullptr, float* p16w = nullptr);
}  // namespace cpu
// The CUDA kernel (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream` is
// the context's. The CPU fast path's element arithmetic, the step's scalars read on the device:
// within f32 rounding of adamw_ref, the bf16 copies bitwise the cast of the new p.
namespace cuda {
template <typename T>
void adamw_step(void* stream, T* p, const T* g, float* m, float* v, int64_t n,
                const AdamWParams& a, const AdamWStep* s, bf16* p16, float* p16w);
}  // namespace cuda

// p16 (f32 p only; may be null): the bf16 compute copy of p (--bf16), rewritten in the same
// pass from the updated values, bitwise what cast_f32_to_bf16 of the new p gives.
// p16w (f32 p only; may be null): the same bf16 values widened to f32, for the widened-bf16
// GEMM path (ops/gemm_bf16.h), written in the same pass too; with or without p16.
template <typename T>
void adamw_step(const Exec& ex, DevPtr<T> p, DevPtr<const T> g, DevPtr<float> m, DevPtr<float> v,
                int64_t n, const AdamWParams& a, DevPtr<const AdamWStep> s,
                DevPtr<bf16> p16 = nullptr, DevPtr<float> p16w = nullptr) {
  if (ex.on_cpu())
    return cpu::adamw_step(raw_ptr(p), raw_ptr(g), raw_ptr(m), raw_ptr(v), n, a, raw_ptr(s),
                           raw_ptr(p16), raw_ptr(p16w));
  return cuda::adamw_step(ex.stream, raw_ptr(p), raw_ptr(g), raw_ptr(m), raw_ptr(v), n, a,
                          raw_ptr(s), raw_ptr(p16), raw_ptr(p16w));
}
template <typename T>
void adamw_step_ref(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a,
                    const AdamWStep& s);

}  // namespace moecore::ops
