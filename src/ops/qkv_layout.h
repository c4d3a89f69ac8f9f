// The fused QKV projection's layout (Megatron's): per token, per query group g of Hkv, the group's
// Hq/Hkv query heads, then its key head, then its value head, D values each. split_qkv copies a
// [T, (Hq + 2 Hkv) D] projection out into q [T, Hq, D], k and v [T, Hkv, D]; fuse_qkv is its
// inverse (the backward assembles dq, dk, dv into the projection's gradient). Pure copies.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

struct QkvShape {
  int64_t n_tok = 0, Hq = 0, Hkv = 0, D = 0;
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void split_qkv(T* q, T* k, T* v, const T* fused, const QkvShape& s);
template <typename T>
void fuse_qkv(T* fused, const T* q, const T* k, const T* v, const QkvShape& s);
}  // namespace cpu
// The CUDA kernels (ops/cuda/qkv_layout.cu): a thread per element, bitwise the CPU's copies;
// `stream` is the context's.
namespace cuda {
template <typename T>
void split_qkv(void* stream, T* q, T* k, T* v, const T* fused, const QkvShape& s);
template <typename T>
void fuse_qkv(void* stream, T* fused, const T* q, const T* k, const T* v, const QkvShape& s);
}  // namespace cuda

template <typename T>
void split_qkv(const Exec& ex, DevPtr<T> q, DevPtr<T> k, DevPtr<T> v, DevPtr<const T> fused,
               const QkvShape& s) {
  if (ex.on_cpu()) return cpu::split_qkv(raw_ptr(q), raw_ptr(k), raw_ptr(v), raw_ptr(fused), s);
  return cuda::split_qkv(ex.stream, raw_ptr(q), raw_ptr(k), raw_ptr(v), raw_ptr(fused), s);
}
template <typename T>
void split_qkv_ref(T* q, T* k, T* v, const T* fused, const QkvShape& s);
template <typename T>
void fuse_qkv(const Exec& ex, DevPtr<T> fused, DevPtr<const T> q, DevPtr<const T> k,
              DevPtr<const T> v, const QkvShape& s) {
  if (ex.on_cpu()) return cpu::fuse_qkv(raw_ptr(fused), raw_ptr(q), raw_ptr(k), raw_ptr(v), s);
  return cuda::fuse_qkv(ex.stream, raw_ptr(fused), raw_ptr(q), raw_ptr(k), raw_ptr(v), s);
}
template <typename T>
void fuse_qkv_ref(T* fused, const T* q, const T* k, const T* v, const QkvShape& s);

}  // namespace moecore::ops
