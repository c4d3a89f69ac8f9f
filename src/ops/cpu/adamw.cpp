// Fast AdamW on CPU: one fused, OpenMP-parallel pass over p, g, m, v (the update is memory-bound,
// so touching each array once is what matters), writing the bf16 copy of p in the same pass
// when there is one (--bf16: saves re-reading p to refresh it), and the widened copy of the widen
// GEMM path with streaming stores. Arithmetic in T with the bias corrections folded into per-step
// constants; agrees with adamw_ref to f32 rounding. GCC 12
// leaves the loop scalar: std::sqrt's errno branch blocks vectorisation unless the build adds
// -fno-math-errno.
#if defined(__SSE__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/check.h"
#include "ops/adamw.h"
#include "ops/cast.h"

namespace moecore::ops {

// Shared with adamw_ref.cpp (not in the header: an implementation detail of both paths).
void check_adamw_params(const char* who, int64_t n, const AdamWParams& a, const AdamWStep& s) {
  MOE_CHECK(n >= 0, "[{}] n={} < 0", who, n);
  MOE_CHECK(s.step >= 1,
            "[{}] step={}: the step is 1-based (bias correction divides by "
            "1-beta^step); pass the count of steps taken including this one",
            who, s.step);
  MOE_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
            "[{}] beta1={} beta2={} must lie in [0, 1): fix --adam-beta1/--adam-beta2", who,
            a.beta1, a.beta2);
  MOE_CHECK(a.eps > 0, "[{}] eps={} must be > 0: fix --adam-eps", who, a.eps);
  MOE_CHECK(s.lr >= 0 && a.weight_decay >= 0,
            "[{}] lr={} weight_decay={} must be >= 0: fix the schedule or --weight-decay", who,
            s.lr, a.weight_decay);
}

namespace cpu {

namespace {
// Below this the parallel region's fork/join costs more than the update.
constexpr int64_t kParallelMin = int64_t{1} << 14;

// The per-step constants of the update, in T. Kept in locals by value (never behind a pointer
// the loop's stores could alias), so the loops stay vector code.
template <typename T>
struct AdamWConsts {
  T b1, one_m_b1, b2, one_m_b2, inv_bc1, inv_bc2, lr, wd, eps, scale;
};

template <typename T>
AdamWConsts<T> adamw_consts(const AdamWParams& a, const AdamWStep& s) {
  // Constants in double, rounded once to T: mhat/(sqrt(vhat)+eps) becomes
  // m*inv_bc1 / (sqrt(v*inv_bc2) + eps), multiplications instead of divisions in the loop.
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(s.step));
  return {static_cast<T>(a.beta1),       static_cast<T>(1.0 - a.beta1),  static_cast<T>(a.beta2),
          static_cast<T>(1.0 - a.beta2), static_cast<T>(1.0 / bc1),      static_cast<T>(1.0 / bc2),
          static_cast<T>(s.lr),          static_cast<T>(a.weight_decay), static_cast<T>(a.eps),
          static_cast<T>(s.grad_scale)};
}

// The update of element i; returns the new p[i].
template <typename T>
inline T adamw_update(T* p, const T* g, float* m, float* v, int64_t i, const AdamWConsts<T> c) {
  T gi = c.scale * g[i];
  T mi = c.b1 * static_cast<T>(m[i]) + c.one_m_b1 * gi;
  T vi = c.b2 * static_cast<T>(v[i]) + c.one_m_b2 * gi * gi;
  m[i] = static_cast<float>(mi);
  v[i] = static_cast<float>(vi);
  // Use the stored (f32) m, v so both paths see the same state next step.
  T mhat = static_cast<T>(m[i]) * c.inv_bc1;
  T vhat = static_cast<T>(v[i]) * c.inv_bc2;
  const T pi = p[i] - c.lr * (mhat / (std::sqrt(vhat) + c.eps) + c.wd * p[i]);
  p[i] = pi;
  return pi;
}

// The update loop; kBf16 also writes p16. One instantiation per combination rather than a
// branch per element, so each loop stays plain vector code.
template <typename T, bool kBf16>
void adamw_loop(T* p, const T* g, float* m, float* v, uint16_t* p16, int64_t n,
                const AdamWParams& a, const AdamWStep& s) {
  const AdamWConsts<T> c = adamw_consts<T>(a, s);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T pi = adamw_update(p, g, m, v, i, c);
    if constexpr (kBf16) p16[i] = f32_to_bf16_bits(pi);
  }
}

// With the widened copy p16w (the bf16 values of p as f32, which the widen GEMM path reads):
// p16w is written with streaming stores, in blocks of 16 computed as vectors: no cache holds
// the copy (it is the size of the model), so a plain store would first read every line of it
// (read-for-ownership), a third more memory traffic than the update without the copy. The
// values are those of the plain loop: each element's update is independent of the blocking.
template <bool kBf16>
void adamw_loop_widened(float* p, const float* g, float* m, float* v, uint16_t* p16, float* p16w,
                        int64_t n, const AdamWParams& a, const AdamWStep& s) {
  const AdamWConsts<float> c = adamw_consts<float>(a, s);
  auto update = [=](int64_t i) {
    const float pi = adamw_update(p, g, m, v, i, c);
    if constexpr (kBf16) p16[i] = f32_to_bf16_bits(pi);
    return pi;
  };
  constexpr int64_t kBlock = 16;
  // Elements before the first 16-byte boundary of p16w, then whole blocks, then the tail.
  const int64_t head =
      std::min<int64_t>(n, ((16 - reinterpret_cast<uintptr_t>(p16w) % 16) % 16) / sizeof(float));
  for (int64_t i = 0; i < head; ++i) p16w[i] = f32_bf16_rounded(update(i));
  const int64_t blocks = (n - head) / kBlock;
#pragma omp parallel if (n >= kParallelMin)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i0 = head + b * kBlock;
      alignas(64) float wide[kBlock];
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) wide[j] = f32_bf16_rounded(update(i0 + j));
#if defined(__SSE__)
      for (int64_t q = 0; q < kBlock; q += 4) _mm_stream_ps(p16w + i0 + q, _mm_load_ps(wide + q));
#else
      std::copy(wide, wide + kBlock, p16w + i0);
#endif
    }
#if defined(__SSE__)
    _mm_sfence();  // this thread's streaming stores are visible before the region ends
#endif
  }
  for (int64_t i = head + blocks * kBlock; i < n; ++i) p16w[i] = f32_bf16_rounded(update(i));
}
}  // namespace

template <typename T>
void adamw_step(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a,
                const AdamWStep* step, bf16* p16, float* p16w) {
  MOE_CHECK(step != nullptr, "[adamw] no step scalars (AdamWStep) given");
  const AdamWStep& s = *step;  // host memory on the CPU backend
  check_adamw_params("adamw", n, a, s);
  if (s.skip) return;
  if (p16 == nullptr && p16w == nullptr) return adamw_loop<T, false>(p, g, m, v, nullptr, n, a, s);
  MOE_CHECK((std::is_same_v<T, float>),
            "[adamw] a bf16 copy needs f32 parameters: f64 models keep no bf16 copies");
  if constexpr (std::is_same_v<T, float>) {
    uint16_t* b = reinterpret_cast<uint16_t*>(p16);
    if (p16w == nullptr) return adamw_loop<T, true>(p, g, m, v, b, n, a, s);
    if (p16 != nullptr) return adamw_loop_widened<true>(p, g, m, v, b, p16w, n, a, s);
    adamw_loop_widened<false>(p, g, m, v, nullptr, p16w, n, a, s);
  }
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&,
                                const AdamWStep*, bf16*, float*);
template void adamw_step<double>(double*, const double*, float*, float*, int64_t,
                                 const AdamWParams&, const AdamWStep*, bf16*, float*);

}  // namespace cpu
}  // namespace moecore::ops
