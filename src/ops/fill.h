// Zeroing planned buffers: the accumulators, statistics and report slots a step resets. The one
// way layer code clears memory (a memset in a layer would write host memory on any backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void zero_bytes(void* p, size_t bytes);
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

}  // namespace moecore::ops
