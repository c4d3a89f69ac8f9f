// Dropout keep factors for a run of 64 columns of one row: 16 Philox blocks computed side by side
// in SIMD lanes (one 32x32 -> 64-bit multiply per lane and half-round vectorises), bitwise the
// bits of ops::dropout_keep, which the references draw one element at a time. Shared by the
// dropout ops and the attention kernel's dropout of probabilities.
#pragma once

#include <cstdint>

#include "ops/dropout.h"

namespace moecore::ops::cpu {

// One row's stream: key, iteration, sample and position fixed, columns varying.
struct DropoutRow {
  uint32_t k0, k1, pos, sample, iteration, threshold;
  DropoutRow(uint64_t key, uint64_t iteration_, uint64_t sample_, uint64_t pos_, uint32_t thr)
      : k0(static_cast<uint32_t>(key)),
        k1(static_cast<uint32_t>(key >> 32)),
        pos(static_cast<uint32_t>(pos_)),
        sample(static_cast<uint32_t>(sample_)),
        iteration(static_cast<uint32_t>(iteration_)),
        threshold(thr) {}
};

constexpr int64_t kDropoutChunk = 64;  // columns per call: 16 Philox blocks of 4

// m[c] = keep(c0 + c) ? scale : 0 for c < 64 (c0 a multiple of 4; columns past the caller's
// end are computed and ignored).
template <typename T>
inline void dropout_factors64(T* m, int64_t c0, const DropoutRow& r, T scale) {
  constexpr int kBlocks = kDropoutChunk / 4;
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t x0[kBlocks], x1[kBlocks], x2[kBlocks], x3[kBlocks];
  const uint32_t g0 = static_cast<uint32_t>(c0 / 4);
#pragma omp simd
  for (int l = 0; l < kBlocks; ++l) {
    x0[l] = g0 + static_cast<uint32_t>(l);
    x1[l] = r.pos;
    x2[l] = r.sample;
    x3[l] = r.iteration;
  }
  uint32_t k0 = r.k0, k1 = r.k1;
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int l = 0; l < kBlocks; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * x0[l];
      const uint64_t p1 = static_cast<uint64_t>(kM1) * x2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ x1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ x3[l] ^ k1;
      x1[l] = static_cast<uint32_t>(p1);
      x3[l] = static_cast<uint32_t>(p0);
      x0[l] = n0;
      x2[l] = n2;
    }
    k0 += kW0;
    k1 += kW1;
  }
#pragma omp simd
  for (int l = 0; l < kBlocks; ++l) {
    m[4 * l + 0] = x0[l] >= r.threshold ? scale : T(0);
    m[4 * l + 1] = x1[l] >= r.threshold ? scale : T(0);
    m[4 * l + 2] = x2[l] >= r.threshold ? scale : T(0);
    m[4 * l + 3] = x3[l] >= r.threshold ? scale : T(0);
  }
}

// x[c] *= factor(c) for c in [0, n) of one row (columns 0 ..).
template <typename T>
inline void dropout_row_in_place(T* x, int64_t n, const DropoutRow& r, T scale) {
  alignas(64) T m[kDropoutChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kDropoutChunk) {
    dropout_factors64(m, c0, r, scale);
    const int64_t w = n - c0 < kDropoutChunk ? n - c0 : kDropoutChunk;
#pragma omp simd
    for (int64_t c = 0; c < w; ++c) x[c0 + c] *= m[c];
  }
}

// x[c] *= factor(col0 + c) for c in [0, n) of one row: columns from any col0 (a block of keys at
// a global offset, ops/attention.h). The same factors as dropout_row_in_place at col0 == 0.
template <typename T>
inline void dropout_row_in_place_at(T* x, int64_t n, int64_t col0, const DropoutRow& r, T scale) {
  if (col0 == 0) return dropout_row_in_place(x, n, r, scale);
  alignas(64) T m[kDropoutChunk];
  const int64_t end = col0 + n;
  for (int64_t a = col0 - col0 % 4; a < end; a += kDropoutChunk) {  // Philox blocks start at 4k
    dropout_factors64(m, a, r, scale);
    const int64_t c_lo = a > col0 ? a : col0;
    const int64_t c_hi = a + kDropoutChunk < end ? a + kDropoutChunk : end;
    for (int64_t c = c_lo; c < c_hi; ++c) x[c - col0] *= m[c - a];
  }
}

}  // namespace moecore::ops::cpu
