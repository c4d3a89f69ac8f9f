// The router's input jitter (--moe-input-jitter-eps eps): the gate sees x * u with
// u ~ U(1 - eps, 1 + eps) per element, drawn from the counter-based Philox RNG (core/rng.h) so
// that the noise is a pure function of (key, index, lane): reruns, recomputation and resumes see
// the same draws, on any backend and thread count. Its backward scales the gate's dx by u.
#pragma once

#include <cstdint>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void input_jitter_forward(T* jitter, T* y, const T* x, double eps, uint64_t key, uint64_t base,
                          uint32_t lane, int64_t n);
template <typename T>
void input_jitter_backward(T* dx, const T* dy, const T* jitter, int64_t n);
}  // namespace cpu

// jitter [n] = T(1 - eps + 2 eps rng_uniform(key, base + i, lane)); y [n] = x * jitter.
template <typename T>
void input_jitter_forward(const Exec& ex, T* jitter, T* y, const T* x, double eps, uint64_t key,
                          uint64_t base, uint32_t lane, int64_t n) {
  if (ex.on_cpu()) return cpu::input_jitter_forward(jitter, y, x, eps, key, base, lane, n);
  no_kernel(ex, "input_jitter_forward");
}
template <typename T>
void input_jitter_forward_ref(T* jitter, T* y, const T* x, double eps, uint64_t key,
                              uint64_t base, uint32_t lane, int64_t n);

// dx [n] += dy * jitter (accumulated: the router is one branch of the MoE input).
template <typename T>
void input_jitter_backward(const Exec& ex, T* dx, const T* dy, const T* jitter, int64_t n) {
  if (ex.on_cpu()) return cpu::input_jitter_backward(dx, dy, jitter, n);
  no_kernel(ex, "input_jitter_backward");
}
template <typename T>
void input_jitter_backward_ref(T* dx, const T* dy, const T* jitter, int64_t n);

}  // namespace moecore::ops
