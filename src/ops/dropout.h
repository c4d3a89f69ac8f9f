// Dropout that every parallel layout draws identically: the keep bit of an element is a pure
// function of (stream key, training iteration, global sample, global position, column), so
// splitting the batch (DP, micro-batches), the sequence (SP / CP) or the heads (TP) changes
// which rank draws a bit, never the bit. docs/design.md, "Dropout".
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/host_device.h"
#include "core/rng.h"

namespace moecore::ops {

// One per micro-batch, written by the host into planned memory before the step and read inside
// the ops (DESIGN.md §8: per-step values come from buffers): the training iteration, and the
// index within the iteration's global batch of the micro-batch's first sample.
struct DropoutCounters {
  int64_t iteration = 0;
  int64_t sample0 = 0;
};

// floor(p * 2^32) as uint32: an element is kept iff its 32-bit word is >= this, so
// P(keep) = 1 - threshold / 2^32 (p to 2^-32). p == 0 gives 0: everything kept. Throws unless
// 0 <= p < 1.
uint32_t dropout_threshold(double p);
// The same value without the check, for callers that check p themselves (the CUDA wrappers, whose
// messages come without fmt).
inline uint32_t dropout_threshold_unchecked(double p) {
  return static_cast<uint32_t>(std::floor(p * 4294967296.0));
}

// The factor a kept value is multiplied by, 1 / (1 - p), rounded once to T.
template <typename T>
T dropout_scale(double p) {
  return static_cast<T>(1.0 / (1.0 - p));
}

// The Philox words of columns 4 * col4 .. 4 * col4 + 3 of row (sample, pos). Counters are 32-bit:
// iteration, sample (within the global batch), position and col4 are taken mod 2^32. Shared with
// the CUDA kernels (the same bits on every backend).
MOE_HOST_DEVICE inline std::array<uint32_t, 4> dropout_words(uint64_t key, uint64_t iteration,
                                                             uint64_t sample, uint64_t pos,
                                                             uint64_t col4) {
  return philox4x32({static_cast<uint32_t>(col4), static_cast<uint32_t>(pos),
                     static_cast<uint32_t>(sample), static_cast<uint32_t>(iteration)},
                    {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)});
}

// The keep bit of column `col` at (sample, pos): one Philox call serves 4 adjacent columns.
MOE_HOST_DEVICE inline bool dropout_keep(uint64_t key, uint64_t iteration, uint64_t sample,
                                         uint64_t pos, uint64_t col, uint32_t threshold) {
  return dropout_words(key, iteration, sample, pos, col / 4)[col % 4] >= threshold;
}

// The stream of one attention head: the global head index mixed into the key (splitmix64's
// finaliser), so a rank holding heads head0.. of a tensor-parallel split draws what the whole
// model draws for them.
constexpr uint64_t dropout_head_key(uint64_t key, uint64_t head) {
  uint64_t x = key ^ ((head + 1) * 0x9E3779B97F4A7C15ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Sequence-major [S, B, C] tensors: element (s, b, c) is token s0 + s of the micro-batch's
// sample b, feature c, kept iff dropout_keep(key, iteration, sample0 + b, s0 + s, c, threshold)
// with iteration and sample0 from *counters; kept values are multiplied by dropout_scale<T>(p),
// dropped ones by 0 (so a NaN or inf stays visible). `key` is the site's stream,
// rng_key(seed, site name); s0 the global position of row 0 (0 unless the sequence is split).
// counters may be null only when p == 0.
namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void dropout_forward(T* y_SBC, const T* x_SBC, double p, uint64_t key,
                     const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0);
template <typename T>
void dropout_add_forward(T* y_SBC, const T* residual_SBC, const T* x_SBC, double p, uint64_t key,
                         const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                         int64_t s0);
template <typename T>
void dropout_backward(T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                      const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's, `counters` device memory read inside the kernel. Bitwise the
// CPU's. The switches below call them where the build has kernels.
namespace cuda {
template <typename T>
void dropout_forward(void* stream, T* y_SBC, const T* x_SBC, double p, uint64_t key,
                     const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0);
template <typename T>
void dropout_add_forward(void* stream, T* y_SBC, const T* residual_SBC, const T* x_SBC, double p,
                         uint64_t key, const DropoutCounters* counters, int64_t S, int64_t B,
                         int64_t C, int64_t s0);
template <typename T>
void dropout_backward(void* stream, T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                      const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0);
}  // namespace cuda

// y = keep * x * scale. y may alias x.
template <typename T>
void dropout_forward(const Exec& ex, DevPtr<T> y_SBC, DevPtr<const T> x_SBC, double p, uint64_t key,
                     DevPtr<const DropoutCounters> counters, int64_t S, int64_t B, int64_t C,
                     int64_t s0) {
  if (ex.on_cpu())
    return cpu::dropout_forward(raw_ptr(y_SBC), raw_ptr(x_SBC), p, key, raw_ptr(counters), S, B, C,
                                s0);
  return cuda::dropout_forward(ex.stream, raw_ptr(y_SBC), raw_ptr(x_SBC), p, key,
                               raw_ptr(counters), S, B, C, s0);
}
template <typename T>
void dropout_forward_ref(T* y_SBC, const T* x_SBC, double p, uint64_t key,
                         const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                         int64_t s0);

// y = residual + keep * x * scale: the bias-dropout-add of the transformer block (the bias is
// already in x). y may alias residual. Computed as fma(x, keep ? scale : 0, residual), one
// rounding: a compiler may or may not contract x * f + r into an FMA (it did, in one of two
// loops), so the op fixes the single rounding that every backend can give bitwise.
template <typename T>
void dropout_add_forward(const Exec& ex, DevPtr<T> y_SBC, DevPtr<const T> residual_SBC,
                         DevPtr<const T> x_SBC, double p, uint64_t key,
                         DevPtr<const DropoutCounters> counters, int64_t S, int64_t B, int64_t C,
                         int64_t s0) {
  if (ex.on_cpu())
    return cpu::dropout_add_forward(raw_ptr(y_SBC), raw_ptr(residual_SBC), raw_ptr(x_SBC), p, key,
                                    raw_ptr(counters), S, B, C, s0);
  return cuda::dropout_add_forward(ex.stream, raw_ptr(y_SBC), raw_ptr(residual_SBC),
                                   raw_ptr(x_SBC), p, key, raw_ptr(counters), S, B, C, s0);
}
template <typename T>
void dropout_add_forward_ref(T* y_SBC, const T* residual_SBC, const T* x_SBC, double p,
                             uint64_t key, const DropoutCounters* counters, int64_t S, int64_t B,
                             int64_t C, int64_t s0);

// dx = keep * dy * scale, assigned (the backward of both forwards with respect to x; the
// residual's gradient is dy itself). dx may alias dy.
template <typename T>
void dropout_backward(const Exec& ex, DevPtr<T> dx_SBC, DevPtr<const T> dy_SBC, double p,
                      uint64_t key, DevPtr<const DropoutCounters> counters, int64_t S, int64_t B,
                      int64_t C, int64_t s0) {
  if (ex.on_cpu())
    return cpu::dropout_backward(raw_ptr(dx_SBC), raw_ptr(dy_SBC), p, key, raw_ptr(counters), S, B,
                                 C, s0);
  return cuda::dropout_backward(ex.stream, raw_ptr(dx_SBC), raw_ptr(dy_SBC), p, key,
                                raw_ptr(counters), S, B, C, s0);
}
template <typename T>
void dropout_backward_ref(T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                          const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                          int64_t s0);

// Throws naming `op` unless 0 <= p < 1, the sizes are >= 0 and counters is set when p > 0.
void check_dropout_args(double p, const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                        int64_t s0, const char* op);

}  // namespace moecore::ops
