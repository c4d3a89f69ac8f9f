// Zeroing and copying planned buffers: the accumulators, statistics and report slots a step
// resets, and the moves between the host's pinned staging and the step's buffers (the inputs
// before the step, the report after it). The one way layer code clears or copies memory: a
// memset or memcpy in a layer would touch host memory on any backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void zero_bytes(void* p, size_t bytes);
void copy_bytes(void* dst, const void* src, size_t bytes);
}  // namespace cpu

// p [n] = T{} (all bits zero for the arithmetic types and the report structs it is used on).
template <typename T>
void zero(const Exec& ex, T* p, int64_t n) {
  static_assert(std::is_trivially_copyable_v<T>, "zero() clears plain data only");
  if (ex.on_cpu()) return cpu::zero_bytes(p, static_cast<size_t>(n) * sizeof(T));
  no_kernel(ex, "zero");
}
template <typename T>
void zero_ref(T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = T{};
}

// dst [n] = src [n], ordered on the context's stream; either side may be device memory or the
// host's pinned memory (MemSpace). The buffers do not overlap.
template <typename T>
void copy(const Exec& ex, T* dst, const T* src, int64_t n) {
  static_assert(std::is_trivially_copyable_v<T>, "copy() moves plain data only");
  if (ex.on_cpu()) return cpu::copy_bytes(dst, src, static_cast<size_t>(n) * sizeof(T));
  no_kernel(ex, "copy");
}
template <typename T>
void copy_ref(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

}  // namespace moecore::ops
