// SwiGLU fast path: OpenMP over rows, vectorisable per-row loops in the working precision.
// Each row is independent, so results do not depend on the thread count.
#include <algorithm>
#include <bit>
#include <cmath>

#include "ops/cast.h"
#include "ops/cpu/store_bf16.h"
#include "ops/cpu/fast_exp.h"
#include "ops/swiglu.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;


// H: h's element type, T or bf16 bits (uint16_t) widened on load.
template <typename T, typename Out, bool kWide = false, typename H = T>
void forward_rows(Out* a_NF, const H* h_N2F, const T* p_N, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const H* g = h_N2F + n * 2 * F;
    const H* u = g + F;
    Out* a = a_NF + n * F;
    const T p = p_N ? p_N[n] : T(1);
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const T gf = widen(g[f]);
      a[f] = store<kWide>(gf / (T(1) + fast_exp(-gf)) * widen(u[f]) * p, a);
    }
  }
}

// dp is a dot product over F. `omp simd reduction` would associate it by whatever vector width
// the compiler picks for each instantiation, and that differs between the f32 and the bf16-out
// loops on some targets (8 vs 16 lanes with -march=icelake-server): the same sum, other bits.
// So the sum has a fixed association on every target and for every output type: element f goes
// to lane f % kLanes, lanes add up in order, then a fixed pairwise tree.
constexpr int kLanes = 16;

template <typename T>
T sum_lanes(const T* part) {
  T s[kLanes / 2];
  for (int l = 0; l < kLanes / 2; ++l) s[l] = part[l] + part[l + kLanes / 2];
  for (int w = kLanes / 4; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  }
  return s[0];
}

template <typename T, typename Out, bool kWide = false, typename H = T>
void backward_rows(Out* dh_N2F, T* dp_N, const T* da_NF, const H* h_N2F, const T* p_N, int64_t N,
                   int64_t F) {
  const bool want_dp = p_N && dp_N;
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const H* g = h_N2F + n * 2 * F;
    const H* u = g + F;
    const T* da = da_NF + n * F;
    Out* dg = dh_N2F + n * 2 * F;
    Out* du = dg + F;
    const T p = p_N ? p_N[n] : T(1);
    T part[kLanes] = {};
    for (int64_t f0 = 0; f0 < F; f0 += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, F - f0);
#pragma omp simd
      for (int64_t l = 0; l < m; ++l) {
        const int64_t f = f0 + l;
        const T gf = widen(g[f]), uf = widen(u[f]);
        const T s = T(1) / (T(1) + fast_exp(-gf));
        const T silu = gf * s;
        dg[f] = store<kWide>(da[f] * p * uf * s * (T(1) + gf * (T(1) - s)), dg);
        du[f] = store<kWide>(da[f] * p * silu, du);
        part[l] += silu * uf * da[f];
      }
    }
    if (want_dp) dp_N[n] = sum_lanes(part);
  }
}

}  // namespace

template <typename T>
void swiglu_forward(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F) {
  forward_rows(a_NF, h_N2F, p_N, N, F);
}

template <typename T>
void swiglu_backward(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N, int64_t N,
                     int64_t F) {
  backward_rows(dh_N2F, dp_N, da_NF, h_N2F, p_N, N, F);
}

void swiglu_forward_bf16(bf16* a16_NF, const float* h_N2F, const float* p_N, int64_t N, int64_t F) {
  forward_rows(reinterpret_cast<uint16_t*>(a16_NF), h_N2F, p_N, N, F);
}

void swiglu_backward_bf16(bf16* dh16_N2F, float* dp_N, const float* da_NF, const float* h_N2F,
                          const float* p_N, int64_t N, int64_t F) {
  backward_rows(reinterpret_cast<uint16_t*>(dh16_N2F), dp_N, da_NF, h_N2F, p_N, N, F);
}

void swiglu_forward_bf16w(float* a_NF, const float* h_N2F, const float* p_N, int64_t N, int64_t F) {
  forward_rows<float, float, true>(a_NF, h_N2F, p_N, N, F);
}

void swiglu_backward_bf16w(float* dh_N2F, float* dp_N, const float* da_NF, const float* h_N2F,
                           const float* p_N, int64_t N, int64_t F) {
  backward_rows<float, float, true>(dh_N2F, dp_N, da_NF, h_N2F, p_N, N, F);
}

// h kept in bf16: the same row loops, h widened on load.
namespace {
const uint16_t* bits(const bf16* h) { return reinterpret_cast<const uint16_t*>(h); }
}  // namespace

void swiglu_forward_bf16(bf16* a16_NF, const bf16* h16_N2F, const float* p_N, int64_t N,
                         int64_t F) {
  forward_rows(reinterpret_cast<uint16_t*>(a16_NF), bits(h16_N2F), p_N, N, F);
}

void swiglu_forward_bf16w(float* a_NF, const bf16* h16_N2F, const float* p_N, int64_t N,
                          int64_t F) {
  forward_rows<float, float, true>(a_NF, bits(h16_N2F), p_N, N, F);
}

void swiglu_backward(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                     const float* p_N, int64_t N, int64_t F) {
  backward_rows(dh_N2F, dp_N, da_NF, bits(h16_N2F), p_N, N, F);
}

void swiglu_backward_bf16(bf16* dh16_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                          const float* p_N, int64_t N, int64_t F) {
  backward_rows(reinterpret_cast<uint16_t*>(dh16_N2F), dp_N, da_NF, bits(h16_N2F), p_N, N, F);
}

void swiglu_backward_bf16w(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                           const float* p_N, int64_t N, int64_t F) {
  backward_rows<float, float, true>(dh_N2F, dp_N, da_NF, bits(h16_N2F), p_N, N, F);
}

template void swiglu_forward<float>(float*, const float*, const float*, int64_t, int64_t);
template void swiglu_forward<double>(double*, const double*, const double*, int64_t, int64_t);
template void swiglu_backward<float>(float*, float*, const float*, const float*, const float*,
                                     int64_t, int64_t);
template void swiglu_backward<double>(double*, double*, const double*, const double*, const double*,
                                      int64_t, int64_t);

}  // namespace moecore::ops::cpu
