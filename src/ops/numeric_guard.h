// The numeric guard's ops (--check-for-nan-in-loss-and-grad, --check-for-spiky-loss,
// --check-for-large-grads): each folds what it finds into an int32 flag in planned memory, so a
// step checks its losses and gradient buckets where they are and the host reads the flags once,
// after the step; skip_if_flagged turns a raised flag into a skipped update (ops::adamw_step
// leaves every weight and moment as it is) without a host round trip.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/adamw.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void flag_nonfinite(int32_t* flag, const T* x, int64_t n);
void flag_at_least(int32_t* flag, const double* value, const double* threshold);
void skip_if_flagged(AdamWStep* step, const int32_t* flags, int64_t n);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. Device-side flags (no host read); bitwise the references.
namespace cuda {
template <typename T>
void flag_nonfinite(void* stream, int32_t* flag, const T* x, int64_t n);
void flag_at_least(void* stream, int32_t* flag, const double* value, const double* threshold);
void skip_if_flagged(void* stream, AdamWStep* step, const int32_t* flags, int64_t n);
}  // namespace cuda

// *flag = 1 when some x[i] (i < n) is NaN or +-Inf; otherwise *flag is left as it is (an OR: one
// flag can collect several tensors).
template <typename T>
void flag_nonfinite(const Exec& ex, DevPtr<int32_t> flag, DevPtr<const T> x, int64_t n) {
  if (ex.on_cpu()) return cpu::flag_nonfinite(raw_ptr(flag), raw_ptr(x), n);
  return cuda::flag_nonfinite(ex.stream, raw_ptr(flag), raw_ptr(x), n);
}
template <typename T>
void flag_nonfinite_ref(int32_t* flag, const T* x, int64_t n);

// *flag = 1 when |*value| >= *threshold and *value is finite (Megatron's is_unexpectedly_large:
// NaN and Inf are the non-finite check's); otherwise left as it is. The threshold is a step
// input (+Inf: nothing is large yet).
inline void flag_at_least(const Exec& ex, DevPtr<int32_t> flag, DevPtr<const double> value,
                          DevPtr<const double> threshold) {
  if (ex.on_cpu()) return cpu::flag_at_least(raw_ptr(flag), raw_ptr(value), raw_ptr(threshold));
  return cuda::flag_at_least(ex.stream, raw_ptr(flag), raw_ptr(value), raw_ptr(threshold));
}
void flag_at_least_ref(int32_t* flag, const double* value, const double* threshold);

// step->skip = 1 when some flags[i] (i < n) is non-zero; otherwise left as ops::grad_clip set it.
inline void skip_if_flagged(const Exec& ex, DevPtr<AdamWStep> step, DevPtr<const int32_t> flags,
                            int64_t n) {
  if (ex.on_cpu()) return cpu::skip_if_flagged(raw_ptr(step), raw_ptr(flags), n);
  return cuda::skip_if_flagged(ex.stream, raw_ptr(step), raw_ptr(flags), n);
}
void skip_if_flagged_ref(AdamWStep* step, const int32_t* flags, int64_t n);

}  // namespace moecore::ops
