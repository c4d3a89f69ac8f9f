// Conversions between the model dtype and f64, for the router (its math after the gate GEMM is
// f64; --moe-router-dtype fp64 widens the gate's inputs too): widen, narrow, and narrow-and-add
// with an optional per-element factor (the input jitter's). Each element is one rounding, so the
// fast path equals the reference bitwise.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void widen_to_f64(double* y, const T* x, int64_t n);
template <typename T>
void narrow_from_f64(T* y, const double* x, int64_t n);
template <typename T>
void add_from_f64(T* y, const double* x, const T* factor, int64_t n);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. Elementwise, one rounding each: bitwise the references.
namespace cuda {
template <typename T>
void widen_to_f64(void* stream, double* y, const T* x, int64_t n);
template <typename T>
void narrow_from_f64(void* stream, T* y, const double* x, int64_t n);
template <typename T>
void add_from_f64(void* stream, T* y, const double* x, const T* factor, int64_t n);
}  // namespace cuda

// y [n] = double(x).
template <typename T>
void widen_to_f64(const Exec& ex, DevPtr<double> y, DevPtr<const T> x, int64_t n) {
  if (ex.on_cpu()) return cpu::widen_to_f64(raw_ptr(y), raw_ptr(x), n);
  return cuda::widen_to_f64(ex.stream, raw_ptr(y), raw_ptr(x), n);
}
template <typename T>
void widen_to_f64_ref(double* y, const T* x, int64_t n);

// y [n] = T(x) (round to nearest).
template <typename T>
void narrow_from_f64(const Exec& ex, DevPtr<T> y, DevPtr<const double> x, int64_t n) {
  if (ex.on_cpu()) return cpu::narrow_from_f64(raw_ptr(y), raw_ptr(x), n);
  return cuda::narrow_from_f64(ex.stream, raw_ptr(y), raw_ptr(x), n);
}
template <typename T>
void narrow_from_f64_ref(T* y, const double* x, int64_t n);

// y [n] += T(x * factor) (factor null: y += T(x)); the product is taken in f64. T = double: one
// fused multiply-add (std::fma), so no compiler's contraction choice changes the bits.
template <typename T>
void add_from_f64(const Exec& ex, DevPtr<T> y, DevPtr<const double> x, DevPtr<const T> factor,
                  int64_t n) {
  if (ex.on_cpu()) return cpu::add_from_f64(raw_ptr(y), raw_ptr(x), raw_ptr(factor), n);
  return cuda::add_from_f64(ex.stream, raw_ptr(y), raw_ptr(x), raw_ptr(factor), n);
}
template <typename T>
void add_from_f64_ref(T* y, const double* x, const T* factor, int64_t n);

}  // namespace moecore::ops
