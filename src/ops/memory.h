// Zeroing and copying planned buffers: the accumulators, statistics and report slots a step
// resets, and the moves between the host's pinned staging and the step's buffers (the inputs
// before the step, the report after it). The one way layer code clears or copies memory: a
// memset or memcpy in a layer would touch host memory on any backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/sync_audit.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void zero_bytes(void* p, size_t bytes);
void copy_bytes(void* dst, const void* src, size_t bytes);
}  // namespace cpu
// The CUDA paths (ops/cuda/memory.cu): asynchronous on the context's stream (cudaMemsetAsync,
// cudaMemcpyAsync of either direction); read_back_bytes then waits for the stream. In the emulated
// CUDA build they move host memory.
namespace cuda {
void zero_bytes(void* stream, void* p, size_t bytes);
void copy_bytes(void* stream, void* dst, const void* src, size_t bytes);
void read_back_bytes(void* stream, void* dst, const void* src, size_t bytes);
}  // namespace cuda

// p [n] = T{} (all bits zero for the arithmetic types and the report structs it is used on).
template <typename T>
void zero(const Exec& ex, DevPtr<T> p, int64_t n) {
  static_assert(std::is_trivially_copyable_v<T>, "zero() clears plain data only");
  if (ex.on_cpu()) return cpu::zero_bytes(raw_ptr(p), static_cast<size_t>(n) * sizeof(T));
  return cuda::zero_bytes(ex.stream, raw_ptr(p), static_cast<size_t>(n) * sizeof(T));
}
template <typename T>
void zero_ref(T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = T{};
}

// dst [n] = src [n], ordered on the context's stream; either side may be device memory or the
// host's pinned memory (MemSpace). The buffers do not overlap.
template <typename T>
void copy(const Exec& ex, DevPtr<T> dst, DevPtr<const T> src, int64_t n) {
  static_assert(std::is_trivially_copyable_v<T>, "copy() moves plain data only");
  if (ex.on_cpu())
    return cpu::copy_bytes(raw_ptr(dst), raw_ptr(src), static_cast<size_t>(n) * sizeof(T));
  return cuda::copy_bytes(ex.stream, raw_ptr(dst), raw_ptr(src),
                          static_cast<size_t>(n) * sizeof(T));
}
// dst [n] (host memory) = src [n] (the context's memory), the host waiting until it is there:
// a host read of device data. Inside an audited step it is a violation unless it belongs to a
// documented sync point (SyncAudit::Point): the layers read their results this way only after
// the step (the logs, tests) or at the documented points (EP count exchange).
template <typename T>
void read_back(const Exec& ex, T* dst, DevPtr<const T> src, int64_t n) {
  static_assert(std::is_trivially_copyable_v<T>, "read_back() moves plain data only");
  SyncAudit::instance().host_sync("ops::read_back: the host reads device data");
  if (ex.on_cpu()) return cpu::copy_bytes(dst, raw_ptr(src), static_cast<size_t>(n) * sizeof(T));
  return cuda::read_back_bytes(ex.stream, dst, raw_ptr(src), static_cast<size_t>(n) * sizeof(T));
}
// One value: read_back of n = 1.
template <typename T>
T read_value(const Exec& ex, DevPtr<const T> src) {
  T v{};
  read_back(ex, &v, src, 1);
  return v;
}

template <typename T>
void copy_ref(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

}  // namespace moecore::ops
