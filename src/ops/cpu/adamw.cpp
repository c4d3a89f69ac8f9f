// Fast AdamW on CPU: one fused, OpenMP-parallel pass over p, g, m, v (the update is memory-bound,
// so touching each array once is what matters), writing the bf16 copy of p in the same pass
// when there is one (--bf16: saves re-reading p to refresh it). Arithmetic in T with the bias
// corrections folded into per-step constants; agrees with adamw_ref to f32 rounding. GCC 12
// leaves the loop scalar: std::sqrt's errno branch blocks vectorisation unless the build adds
// -fno-math-errno.
#include <bit>
#include <cmath>
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

// The update loop; kBf16 also writes p16, kWide p16w (the same bf16 values widened). One
// instantiation per combination rather than a branch per element, so each loop stays plain
// vector code.
template <typename T, bool kBf16, bool kWide>
void adamw_loop(T* p, const T* g, float* m, float* v, uint16_t* p16, float* p16w, int64_t n,
                const AdamWParams& a, const AdamWStep& s) {
  // Constants in double, rounded once to T: mhat/(sqrt(vhat)+eps) becomes
  // m*inv_bc1 / (sqrt(v*inv_bc2) + eps), multiplications instead of divisions in the loop.
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(s.step));
  const T b1 = static_cast<T>(a.beta1), one_m_b1 = static_cast<T>(1.0 - a.beta1);
  const T b2 = static_cast<T>(a.beta2), one_m_b2 = static_cast<T>(1.0 - a.beta2);
  const T inv_bc1 = static_cast<T>(1.0 / bc1), inv_bc2 = static_cast<T>(1.0 / bc2);
  const T lr = static_cast<T>(s.lr), wd = static_cast<T>(a.weight_decay);
  const T eps = static_cast<T>(a.eps), scale = static_cast<T>(s.grad_scale);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    T gi = scale * g[i];
    T mi = b1 * static_cast<T>(m[i]) + one_m_b1 * gi;
    T vi = b2 * static_cast<T>(v[i]) + one_m_b2 * gi * gi;
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
    // Use the stored (f32) m, v so both paths see the same state next step.
    T mhat = static_cast<T>(m[i]) * inv_bc1;
    T vhat = static_cast<T>(v[i]) * inv_bc2;
    const T pi = p[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * p[i]);
    p[i] = pi;
    if constexpr (kBf16 || kWide) {
      const uint16_t b = f32_to_bf16_bits(pi);
      if constexpr (kBf16) p16[i] = b;
      if constexpr (kWide) p16w[i] = std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
    }
  }
}
}  // namespace

template <typename T>
void adamw_step(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a,
                const AdamWStep* step, bf16* p16, float* p16w) {
  MOE_CHECK(step != nullptr, "[adamw] no step scalars (AdamWStep) given");
  const AdamWStep& s = *step;  // host memory on the CPU backend
  check_adamw_params("adamw", n, a, s);
  if (s.skip) return;
  if (p16 == nullptr && p16w == nullptr)
    return adamw_loop<T, false, false>(p, g, m, v, nullptr, nullptr, n, a, s);
  MOE_CHECK((std::is_same_v<T, float>),
            "[adamw] a bf16 copy needs f32 parameters: f64 models keep no bf16 copies");
  if constexpr (std::is_same_v<T, float>) {
    uint16_t* b = reinterpret_cast<uint16_t*>(p16);
    if (p16 != nullptr && p16w != nullptr)
      return adamw_loop<T, true, true>(p, g, m, v, b, p16w, n, a, s);
    if (p16 != nullptr) return adamw_loop<T, true, false>(p, g, m, v, b, nullptr, n, a, s);
    adamw_loop<T, false, true>(p, g, m, v, nullptr, p16w, n, a, s);
  }
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&,
                                const AdamWStep*, bf16*, float*);
template void adamw_step<double>(double*, const double*, float*, float*, int64_t,
                                 const AdamWParams&, const AdamWStep*, bf16*, float*);

}  // namespace cpu
}  // namespace moecore::ops
