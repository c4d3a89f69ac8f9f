// The router's input jitter (--moe-input-jitter-eps eps): the gate sees x * u with
// u ~ U(1 - eps, 1 + eps) per element, drawn from the counter-based Philox RNG (core/rng.h) so
// that the noise is a pure function of (key, index, lane): reruns, recomputation and resumes see
// the same draws, on any backend and thread count. Its backward scales the gate's dx by u.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void input_jitter_forward(T* jitter, T* y, const T* x, double eps, uint64_t key, uint64_t base,
                          uint32_t lane, int64_t n);
template <typename T>
void input_jitter_backward(T* dx, const T* dy, const T* jitter, int64_t n);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's, `step` device memory read (advance: written) inside the
// kernel. Bitwise the CPU's. The switches below call them where the build has kernels.
namespace cuda {
template <typename T>
void input_jitter_forward(void* stream, T* jitter, T* y, const T* x, double eps, uint64_t key,
                          const int64_t* step, int64_t stride, uint32_t lane, int64_t n);
void input_jitter_advance(void* stream, int64_t* step);
template <typename T>
void input_jitter_backward(void* stream, T* dx, const T* dy, const T* jitter, int64_t n);
}  // namespace cuda

// jitter [n] = T(fma(2 eps, rng_uniform(key, base + i, lane), 1 - eps)); y [n] = x * jitter, with
// base = *step * stride: the stream's step counter is read from memory (it changes every
// optimizer step, input_jitter_advance), the lane (the micro-batch of the step) is a constant
// of each forward. The fma is the op's, on every backend: a compiler may or may not contract
// 1 - eps + 2 eps u (GCC does for an ISA with FMA, nvcc does by default), so the op fixes the
// single rounding that every backend can give bitwise.
template <typename T>
void input_jitter_forward(const Exec& ex, DevPtr<T> jitter, DevPtr<T> y, DevPtr<const T> x,
                          double eps, uint64_t key, DevPtr<const int64_t> step, int64_t stride,
                          uint32_t lane, int64_t n) {
  if (ex.on_cpu()) {
    const uint64_t base = static_cast<uint64_t>(*raw_ptr(step)) * static_cast<uint64_t>(stride);
    return cpu::input_jitter_forward(raw_ptr(jitter), raw_ptr(y), raw_ptr(x), eps, key, base, lane,
                                     n);
  }
  return cuda::input_jitter_forward(ex.stream, raw_ptr(jitter), raw_ptr(y), raw_ptr(x), eps, key,
                                    raw_ptr(step), stride, lane, n);
}
// *step += 1: once per optimizer step, after the step's forwards.
inline void input_jitter_advance(const Exec& ex, DevPtr<int64_t> step) {
  if (ex.on_cpu()) {
    ++*raw_ptr(step);
    return;
  }
  return cuda::input_jitter_advance(ex.stream, raw_ptr(step));
}
template <typename T>
void input_jitter_forward_ref(T* jitter, T* y, const T* x, double eps, uint64_t key, uint64_t base,
                              uint32_t lane, int64_t n);

// dx [n] = fma(dy, jitter, dx) (accumulated: the router is one branch of the MoE input; one
// rounding on every backend, as the forward's factor).
template <typename T>
void input_jitter_backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> jitter,
                           int64_t n) {
  if (ex.on_cpu()) return cpu::input_jitter_backward(raw_ptr(dx), raw_ptr(dy), raw_ptr(jitter), n);
  return cuda::input_jitter_backward(ex.stream, raw_ptr(dx), raw_ptr(dy), raw_ptr(jitter), n);
}
template <typename T>
void input_jitter_backward_ref(T* dx, const T* dy, const T* jitter, int64_t n);

}  // namespace moecore::ops
