#include "nn/linear_gemms.h"

#include <algorithm>
#include <type_traits>

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

template <typename T>
void LinearGemms<T>::forward(DevPtr<T> y, DevPtr<const T> x, const Param& w, int64_t M, int64_t N,
                             int64_t K, bool x_rounded) const {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      return ops::linear_forward_bf16(*ex_, y, x, w.data16, M, N, K, in16_, ws32_, w.data16w,
                                      x_rounded);
    }
  }
  ops::linear_forward(*ex_, y, x, w.data_as<T>(), M, N, K);
}

template <typename T>
void LinearGemms<T>::backward(DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x, const Param& w,
                              int64_t M, int64_t N, int64_t K, bool x_rounded) const {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      return ops::linear_backward_bf16(*ex_, dx, w.grad_as<T>(), dy, x, w.data16, M, N, K, dy16_,
                                       in16_, ws32_, w.data16w, x_rounded);
    }
  }
  ops::linear_backward(*ex_, dx, w.grad_as<T>(), dy, x, w.data_as<T>(), M, N, K);
}

template class LinearGemms<float>;
template class LinearGemms<double>;

}  // namespace moecore::nn
