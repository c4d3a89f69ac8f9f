// AdamW with Megatron's decoupled weight decay, on fp32 master values:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * p )
#pragma once

#include <cstdint>

namespace moecore::ops {

struct AdamWParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;        // 1-based, for bias correction
  double grad_scale = 1.0;  // g is multiplied by this first (clipping coefficient)
};

template <typename T>
void adamw_step(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a);
template <typename T>
void adamw_step_ref(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a);

}  // namespace moecore::ops
