// Element-wise MLP activations, fast path: OpenMP over rows, per-row loops in the working
// precision, the activation chosen once per call (a template parameter of the row loops). Each
// row is independent and dp has one fixed association, so results do not depend on the thread
// count, and the bf16 outputs are the rounded f32 ones bitwise (swiglu.cpp's scheme).
#include <algorithm>
#include <cmath>

#include "ops/activation.h"
#include "ops/cast.h"
#include "ops/cpu/store_bf16.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;

// The element bodies, shared with the CUDA kernels (ops/activation.h).
template <Activation A, typename T>
using Act = ActivationFn<A, T>;

// H: h's element type, T or bf16 bits (uint16_t) widened on load.
template <Activation A, typename T, typename Out, bool kWide, typename H>
void forward_rows(Out* a_NF, const H* h_NF, const T* p_N, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const H* h = h_NF + n * F;
    Out* a = a_NF + n * F;
    const T p = p_N ? p_N[n] : T(1);
    for (int64_t f = 0; f < F; ++f) a[f] = store<kWide>(Act<A, T>::f(T(widen(h[f]))) * p, a);
  }
}

// dp's dot product over F: element f goes to lane f % kLanes, lanes add up in order, then a
// fixed pairwise tree (swiglu.cpp: the vectoriser's association differs between instantiations).
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

template <Activation A, typename T, typename Out, bool kWide, typename H>
void backward_rows(Out* dh_NF, T* dp_N, const T* da_NF, const H* h_NF, const T* p_N, int64_t N,
                   int64_t F) {
  const bool want_dp = p_N && dp_N;
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const H* h = h_NF + n * F;
    const T* da = da_NF + n * F;
    Out* dh = dh_NF + n * F;
    const T p = p_N ? p_N[n] : T(1);
    T part[kLanes] = {};
    for (int64_t f0 = 0; f0 < F; f0 += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, F - f0);
      for (int64_t l = 0; l < m; ++l) {
        const int64_t f = f0 + l;
        const T hf = widen(h[f]);
        dh[f] = store<kWide>(da[f] * p * Act<A, T>::df(hf), dh);
        if (want_dp) part[l] += Act<A, T>::f(hf) * da[f];
      }
    }
    if (want_dp) dp_N[n] = sum_lanes(part);
  }
}

template <typename T, typename Out, bool kWide = false, typename H = T>
void forward(Activation act, Out* a_NF, const H* h_NF, const T* p_N, int64_t N, int64_t F) {
  check_elementwise_activation(act, "activation_forward");
  switch (act) {
    case Activation::GeLU:
      return forward_rows<Activation::GeLU, T, Out, kWide, H>(a_NF, h_NF, p_N, N, F);
    case Activation::GeLUTanh:
      return forward_rows<Activation::GeLUTanh, T, Out, kWide, H>(a_NF, h_NF, p_N, N, F);
    case Activation::SquaredReLU:
      return forward_rows<Activation::SquaredReLU, T, Out, kWide, H>(a_NF, h_NF, p_N, N, F);
    case Activation::SwiGLU:
      break;
  }
}

template <typename T, typename Out, bool kWide = false, typename H = T>
void backward(Activation act, Out* dh_NF, T* dp_N, const T* da_NF, const H* h_NF, const T* p_N,
              int64_t N, int64_t F) {
  check_elementwise_activation(act, "activation_backward");
  switch (act) {
    case Activation::GeLU:
      return backward_rows<Activation::GeLU, T, Out, kWide, H>(dh_NF, dp_N, da_NF, h_NF, p_N, N, F);
    case Activation::GeLUTanh:
      return backward_rows<Activation::GeLUTanh, T, Out, kWide, H>(dh_NF, dp_N, da_NF, h_NF, p_N, N,
                                                                F);
    case Activation::SquaredReLU:
      return backward_rows<Activation::SquaredReLU, T, Out, kWide, H>(dh_NF, dp_N, da_NF, h_NF, p_N, N,
                                                                   F);
    case Activation::SwiGLU:
      break;
  }
}

}  // namespace

template <typename T>
void activation_forward(Activation act, T* a_NF, const T* h_NF, const T* p_N, int64_t N,
                        int64_t F) {
  forward<T, T>(act, a_NF, h_NF, p_N, N, F);
}

template <typename T>
void activation_backward(Activation act, T* dh_NF, T* dp_N, const T* da_NF, const T* h_NF,
                         const T* p_N, int64_t N, int64_t F) {
  backward<T, T>(act, dh_NF, dp_N, da_NF, h_NF, p_N, N, F);
}

void activation_forward_bf16(Activation act, bf16* a16_NF, const float* h_NF, const float* p_N,
                             int64_t N, int64_t F) {
  forward<float, uint16_t>(act, reinterpret_cast<uint16_t*>(a16_NF), h_NF, p_N, N, F);
}

void activation_backward_bf16(Activation act, bf16* dh16_NF, float* dp_N, const float* da_NF,
                              const float* h_NF, const float* p_N, int64_t N, int64_t F) {
  backward<float, uint16_t>(act, reinterpret_cast<uint16_t*>(dh16_NF), dp_N, da_NF, h_NF, p_N, N,
                            F);
}

void activation_forward_bf16w(Activation act, float* a_NF, const float* h_NF, const float* p_N,
                              int64_t N, int64_t F) {
  forward<float, float, true>(act, a_NF, h_NF, p_N, N, F);
}

void activation_backward_bf16w(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                               const float* h_NF, const float* p_N, int64_t N, int64_t F) {
  backward<float, float, true>(act, dh_NF, dp_N, da_NF, h_NF, p_N, N, F);
}

// h kept in bf16: the same row loops, h widened on load.
namespace {
const uint16_t* bits(const bf16* h) { return reinterpret_cast<const uint16_t*>(h); }
}  // namespace

void activation_forward_bf16(Activation act, bf16* a16_NF, const bf16* h16_NF, const float* p_N,
                             int64_t N, int64_t F) {
  forward<float, uint16_t>(act, reinterpret_cast<uint16_t*>(a16_NF), bits(h16_NF), p_N, N, F);
}

void activation_forward_bf16w(Activation act, float* a_NF, const bf16* h16_NF, const float* p_N,
                              int64_t N, int64_t F) {
  forward<float, float, true>(act, a_NF, bits(h16_NF), p_N, N, F);
}

void activation_backward(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                         const bf16* h16_NF, const float* p_N, int64_t N, int64_t F) {
  backward<float, float>(act, dh_NF, dp_N, da_NF, bits(h16_NF), p_N, N, F);
}

void activation_backward_bf16(Activation act, bf16* dh16_NF, float* dp_N, const float* da_NF,
                              const bf16* h16_NF, const float* p_N, int64_t N, int64_t F) {
  backward<float, uint16_t>(act, reinterpret_cast<uint16_t*>(dh16_NF), dp_N, da_NF, bits(h16_NF),
                            p_N, N, F);
}

void activation_backward_bf16w(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                               const bf16* h16_NF, const float* p_N, int64_t N, int64_t F) {
  backward<float, float, true>(act, dh_NF, dp_N, da_NF, bits(h16_NF), p_N, N, F);
}

template void activation_forward<float>(Activation, float*, const float*, const float*, int64_t,
                                        int64_t);
template void activation_forward<double>(Activation, double*, const double*, const double*, int64_t,
                                         int64_t);
template void activation_backward<float>(Activation, float*, float*, const float*, const float*,
                                         const float*, int64_t, int64_t);
template void activation_backward<double>(Activation, double*, double*, const double*,
                                          const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cpu
