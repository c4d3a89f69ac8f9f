#include "nn/linear_gemms.h"

#include <algorithm>
#include <type_traits>

#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::nn {

template <typename T>
void LinearGemms<T>::allocate(Arena& a, const Param& weight, std::initializer_list<Shape> shapes,
                              const std::string& prefix) {
  ex_ = &a.exec();
  bf16_ = std::is_same_v<T, float> && weight.has_bf16_copy();
  widened_ = weight.has_data16w;
  in16_ = dy16_ = nullptr;
  ws32_ = nullptr;
  if (!bf16_) return;
  int64_t in = 0, out = 0, ws32 = 0;
  for (const Shape& s : shapes) {
    in = std::max(in, s.M * s.K);
    out = std::max(out, s.M * s.N);
    ws32 = std::max(ws32, ops::linear_bf16_workspace_elems(a.exec(), s.M, s.N, s.K));
  }
  if (weight.has_data16) {  // the widen path rounds straight into ws32
    in16_ = a.alloc<moecore::bf16>(in, prefix + ".in16", MemKind::Workspace);
    dy16_ = a.alloc<moecore::bf16>(out, prefix + ".dy16", MemKind::Workspace);
  }
  if (ws32 > 0) ws32_ = a.alloc<float>(ws32, prefix + ".ws32", MemKind::Workspace);
}

namespace {
// p + off, null staying null (a copy the registry does not keep).
template <typename P>
P at(P p, int64_t off) {
  return p == nullptr ? p : p + off;
}
}  // namespace

template <typename T>
void LinearGemms<T>::forward(DevPtr<T> y, DevPtr<const T> x, const Param& w, int64_t M, int64_t N,
                             int64_t K, bool x_rounded, int64_t row0) const {
  const int64_t off = row0 * K;
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      return ops::linear_forward_bf16(*ex_, y, x, at(w.data16, off), M, N, K, in16_, ws32_,
                                      at(w.data16w, off), x_rounded);
    }
  }
  ops::linear_forward(*ex_, y, x, DevPtr<const T>(w.data_as<T>() + off), M, N, K);
}

template <typename T>
void LinearGemms<T>::backward(DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x, const Param& w,
                              int64_t M, int64_t N, int64_t K, bool x_rounded, bool accumulate_dx,
                              int64_t row0) const {
  const int64_t off = row0 * K;
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_ && accumulate_dx)  // linear_backward_bf16 assigns dx: one block, added
      return backward_blocks_bf16(dx, dy, x, w, off, M, N, 1, K, K, x_rounded, true);
    if (bf16_) {
      return ops::linear_backward_bf16(*ex_, dx, w.grad_as<T>() + off, dy, x, at(w.data16, off), M,
                                       N, K, dy16_, in16_, ws32_, at(w.data16w, off), x_rounded);
    }
  }
  ops::linear_backward(*ex_, dx, w.grad_as<T>() + off, dy, x, DevPtr<const T>(w.data_as<T>() + off),
                       M, N, K, accumulate_dx);
}

template <typename T>
void LinearGemms<T>::forward_blocks(DevPtr<T> y, DevPtr<const T> x, const Param& w, int64_t M,
                                    int64_t N, int64_t G, int64_t Kg, int64_t ldg) const {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) return forward_blocks_bf16(y, x, w, M, N, G, Kg, ldg);
  }
  const DevPtr<const T> wv = w.data_as<T>();
  for (int64_t g = 0; g < G; ++g) {
    ops::gemm<T>(*ex_, false, true, M, N, Kg, T(1), x + g * ldg, G * ldg, wv + g * Kg, G * Kg,
                 g == 0 ? T(0) : T(1), y, N);
  }
}

template <typename T>
void LinearGemms<T>::backward_blocks(DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x,
                                     const Param& w, int64_t M, int64_t N, int64_t G, int64_t Kg,
                                     int64_t ldg) const {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) return backward_blocks_bf16(dx, dy, x, w, 0, M, N, G, Kg, ldg, false, false);
  }
  const DevPtr<const T> wv = w.data_as<T>();
  const DevPtr<T> dw = w.grad_as<T>();
  for (int64_t g = 0; g < G; ++g) {
    ops::gemm<T>(*ex_, true, false, N, Kg, M, T(1), dy, N, x + g * ldg, G * ldg, T(1), dw + g * Kg,
                 G * Kg);
    ops::gemm<T>(*ex_, false, false, M, Kg, N, T(1), dy, N, wv + g * Kg, G * Kg, T(0), dx + g * ldg,
                 G * ldg);
  }
}

template <typename T>
void LinearGemms<T>::forward_blocks_bf16(DevPtr<float> y, DevPtr<const float> x, const Param& w,
                                         int64_t M, int64_t N, int64_t G, int64_t Kg,
                                         int64_t ldg) const {
  const int64_t ld = G * ldg;
  if (w.has_data16w) {  // f32 GEMMs over the bf16 values: x rounded once (into ws32)
    ops::round_f32_to_bf16(*ex_, ws32_, x, M * ld);
    for (int64_t g = 0; g < G; ++g) {
      ops::gemm<float>(*ex_, false, true, M, N, Kg, 1.f, DevPtr<const float>(ws32_ + g * ldg), ld,
                       DevPtr<const float>(w.data16w + g * Kg), G * Kg, g == 0 ? 0.f : 1.f, y, N);
    }
    return;
  }
  ops::cast_f32_to_bf16(*ex_, in16_, x, M * ld);
  for (int64_t g = 0; g < G; ++g) {
    ops::gemm_bf16(*ex_, false, true, M, N, Kg, DevPtr<const moecore::bf16>(in16_ + g * ldg), ld,
                   DevPtr<const moecore::bf16>(w.data16 + g * Kg), G * Kg, g == 0 ? 0.f : 1.f, y, N,
                   ws32_);
  }
}

template <typename T>
void LinearGemms<T>::backward_blocks_bf16(DevPtr<float> dx, DevPtr<const float> dy,
                                          DevPtr<const float> x, const Param& w, int64_t w_off,
                                          int64_t M, int64_t N, int64_t G, int64_t Kg, int64_t ldg,
                                          bool x_rounded, bool accumulate_dx) const {
  const int64_t ld = G * ldg, ldw = G * Kg;
  const DevPtr<float> dw = w.grad_as<float>() + w_off;
  const float dx_beta = accumulate_dx ? 1.f : 0.f;
  if (w.has_data16w) {  // f32 GEMMs over the bf16 values: dy and x rounded into ws32
    const DevPtr<float> dy32 = ws32_, x32 = ws32_ + M * N;
    ops::round_f32_to_bf16(*ex_, dy32, dy, M * N);
    DevPtr<const float> xr = x;
    if (!x_rounded) {
      ops::round_f32_to_bf16(*ex_, x32, x, M * ld);
      xr = x32;
    }
    const DevPtr<const float> w32 = w.data16w + w_off;
    for (int64_t g = 0; g < G; ++g) {
      ops::gemm<float>(*ex_, true, false, N, Kg, M, 1.f, DevPtr<const float>(dy32), N, xr + g * ldg,
                       ld, 1.f, dw + g * Kg, ldw);
      ops::gemm<float>(*ex_, false, false, M, Kg, N, 1.f, DevPtr<const float>(dy32), N,
                       w32 + g * Kg, ldw, dx_beta, dx + g * ldg, ld);
    }
    return;
  }
  ops::cast_f32_to_bf16(*ex_, dy16_, dy, M * N);
  ops::cast_f32_to_bf16(*ex_, in16_, x, M * ld);
  const DevPtr<const moecore::bf16> w16 = w.data16 + w_off;
  for (int64_t g = 0; g < G; ++g) {
    ops::gemm_bf16(*ex_, true, false, N, Kg, M, DevPtr<const moecore::bf16>(dy16_), N,
                   DevPtr<const moecore::bf16>(in16_ + g * ldg), ld, 1.f, dw + g * Kg, ldw, ws32_);
    ops::gemm_bf16(*ex_, false, false, M, Kg, N, DevPtr<const moecore::bf16>(dy16_), N,
                   w16 + g * Kg, ldw, dx_beta, dx + g * ldg, ld, ws32_);
  }
}

template class LinearGemms<float>;
template class LinearGemms<double>;

}  // namespace moecore::nn
