// Dropout reference: plain loops, one dropout_keep call per element, the oracle for dropout.cpp.
// y = x * (keep ? scale : 0) and fma(x, keep ? scale : 0, residual): the same single rounding as
// the fast path, so the two agree bitwise.
#include <cmath>

#include "core/check.h"
#include "ops/dropout.h"

namespace moecore::ops {

// The op's argument checks, here beside the reference that every build (and the grid emulator's
// sanitizer build, which links the kernels' references alone) has.
uint32_t dropout_threshold(double p) {
  MOE_CHECK(p >= 0.0 && p < 1.0,
            "[dropout] p={} outside [0, 1): pass a dropout probability such as 0.1 (0 disables "
            "dropout)",
            p);
  return dropout_threshold_unchecked(p);
}

void check_dropout_args(double p, const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                        int64_t s0, const char* op) {
  dropout_threshold(p);
  MOE_CHECK(S >= 0 && B >= 0 && C >= 0 && s0 >= 0,
            "[{}] bad shape S={} B={} C={} s0={}: sizes and the first position must be >= 0", op, S,
            B, C, s0);
  MOE_CHECK(counters != nullptr || p == 0.0,
            "[{}] p={} without counters: pass the micro-batch's DropoutCounters (iteration, "
            "sample0), written before the step",
            op, p);
}

namespace {

template <typename T>
T factor_ref(double p, uint64_t key, const DropoutCounters* counters, int64_t s, int64_t b,
             int64_t c, int64_t s0) {
  if (p == 0.0) return T(1);
  const bool keep = dropout_keep(
      key, static_cast<uint64_t>(counters->iteration), static_cast<uint64_t>(counters->sample0 + b),
      static_cast<uint64_t>(s0 + s), static_cast<uint64_t>(c), dropout_threshold(p));
  return keep ? dropout_scale<T>(p) : T(0);
}

}  // namespace

template <typename T>
void dropout_forward_ref(T* y_SBC, const T* x_SBC, double p, uint64_t key,
                         const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                         int64_t s0) {
  check_dropout_args(p, counters, S, B, C, s0, "dropout_ref");
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (s * B + b) * C + c;
        y_SBC[i] = x_SBC[i] * factor_ref<T>(p, key, counters, s, b, c, s0);
      }
    }
  }
}

template <typename T>
void dropout_add_forward_ref(T* y_SBC, const T* residual_SBC, const T* x_SBC, double p,
                             uint64_t key, const DropoutCounters* counters, int64_t S, int64_t B,
                             int64_t C, int64_t s0) {
  check_dropout_args(p, counters, S, B, C, s0, "dropout_add_ref");
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (s * B + b) * C + c;
        y_SBC[i] =
            std::fma(x_SBC[i], factor_ref<T>(p, key, counters, s, b, c, s0), residual_SBC[i]);
      }
    }
  }
}

template <typename T>
void dropout_backward_ref(T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                          const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                          int64_t s0) {
  check_dropout_args(p, counters, S, B, C, s0, "dropout_backward_ref");
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (s * B + b) * C + c;
        dx_SBC[i] = dy_SBC[i] * factor_ref<T>(p, key, counters, s, b, c, s0);
      }
    }
  }
}

#define MOECORE_INSTANTIATE_DROPOUT_REF(T)                                                      \
  template void dropout_forward_ref<T>(T*, const T*, double, uint64_t, const DropoutCounters*,  \
                                       int64_t, int64_t, int64_t, int64_t);                     \
  template void dropout_add_forward_ref<T>(T*, const T*, const T*, double, uint64_t,            \
                                           const DropoutCounters*, int64_t, int64_t, int64_t,   \
                                           int64_t);                                            \
  template void dropout_backward_ref<T>(T*, const T*, double, uint64_t, const DropoutCounters*, \
                                        int64_t, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE_DROPOUT_REF(float)
MOECORE_INSTANTIATE_DROPOUT_REF(double)
#undef MOECORE_INSTANTIATE_DROPOUT_REF

}  // namespace moecore::ops
