// A random attention problem for the op tests: q, k, v and the output gradient of a shape, q and
// k in [-2, 2] so that the scores are O(1) (the softmax neither flat nor one-hot).
#pragma once

#include <cstdint>
#include <vector>

#include "common/testing.h"
#include "ops/attention.h"

namespace moecore::testing {

template <typename T>
struct AttentionProblem {
  ops::AttentionShape s;
  int64_t n_q, n_kv, n_lse;
  std::vector<T> q, k, v, dout;
  AttentionProblem(const ops::AttentionShape& shape, uint32_t seed) : s(shape) {
    n_q = s.S * s.B * s.Hq * s.D;
    n_kv = s.S * s.B * s.Hkv * s.D;
    n_lse = s.B * s.Hq * s.S;
    q = random_vec<T>(n_q, seed, -2.0, 2.0);
    k = random_vec<T>(n_kv, seed + 1, -2.0, 2.0);
    v = random_vec<T>(n_kv, seed + 2);
    dout = random_vec<T>(n_q, seed + 3);
  }
};

}  // namespace moecore::testing
