// Dropout on the GPU: a thread per 4 adjacent columns of a row (one Philox block serves them,
// ops::dropout_words, shared with the CPU), grid-stride over the rows' groups. The counters
// (iteration, sample0) are read from device memory inside the kernel, as the op's contract says.
// Every element is a pure function of its inputs and indices: bitwise the CPU's (x * factor, or
// the explicit fma of dropout_add), in any order; y may alias x or the residual (each element is
// read before it is written, by one thread).
#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/dropout.h"

namespace moecore::ops::cuda {

namespace kernels {
// n_groups = S * B * ceil(C / 4); threshold 0 keeps everything (p == 0, counters may be null).
template <typename T, bool kAdd>
__global__ void dropout_rows(T* out, const T* base, const T* x, uint32_t threshold, T scale,
                             uint64_t key, const DropoutCounters* counters, int64_t B, int64_t C,
                             int64_t s0, int64_t n_groups) {
  const int64_t iteration = counters ? counters->iteration : 0;
  const int64_t sample0 = counters ? counters->sample0 : 0;
  const int64_t c4s = (C + 3) / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < n_groups; g += stride) {
    const int64_t row = g / c4s, c4 = g % c4s;
    const int64_t s = row / B, b = row % B;
    std::array<uint32_t, 4> words = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
    if (threshold != 0) {
      words = dropout_words(key, uint64_t(iteration), uint64_t(sample0 + b), uint64_t(s0 + s),
                            uint64_t(c4));
    }
    // Constant indices into the words (a loop over them would place them in local memory).
    const auto apply = [&](int64_t j, uint32_t word) {
      if (4 * c4 + j >= C) return;
      const int64_t i = row * C + 4 * c4 + j;
      const T f = word >= threshold ? scale : T(0);
      if constexpr (kAdd) {
        out[i] = std::fma(x[i], f, base[i]);
      } else {
        out[i] = x[i] * f;
      }
    };
    apply(0, words[0]);
    apply(1, words[1]);
    apply(2, words[2]);
    apply(3, words[3]);
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill a GPU

template <typename T, bool kAdd>
void dropout_launch(void* stream, T* out, const T* base, const T* x, double p, uint64_t key,
                    const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0,
                    const char* op) {
  // check_dropout_args's checks (p in [0, 1), sizes, counters set when p > 0); counters is a
  // device pointer here, tested for null only.
  MOE_KERNEL_CHECK(p >= 0.0 && p < 1.0,
                   std::string("[") + op + "] p=" + std::to_string(p) +
                       " outside [0, 1): pass a dropout probability such as 0.1 (0 disables "
                       "dropout)");
  MOE_KERNEL_CHECK(S >= 0 && B >= 0 && C >= 0 && s0 >= 0,
                   std::string("[") + op + "] bad shape S=" + std::to_string(S) +
                       " B=" + std::to_string(B) + " C=" + std::to_string(C) +
                       " s0=" + std::to_string(s0) + ": sizes and the first position must be >= 0");
  MOE_KERNEL_CHECK(counters != nullptr || p == 0.0,
                   std::string("[") + op + "] p=" + std::to_string(p) +
                       " without counters: pass the micro-batch's DropoutCounters (iteration, "
                       "sample0), written before the step");
  const int64_t n_groups = S * B * ((C + 3) / 4);
  if (n_groups == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min(kMaxBlocks, (n_groups + kBlock - 1) / kBlock);
  launch(op, kernels::dropout_rows<T, kAdd>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0,
         stream, out, base, x, dropout_threshold_unchecked(p), dropout_scale<T>(p), key, counters,
         B, C, s0, n_groups);
}
}  // namespace

template <typename T>
void dropout_forward(void* stream, T* y_SBC, const T* x_SBC, double p, uint64_t key,
                     const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0) {
  dropout_launch<T, false>(stream, y_SBC, nullptr, x_SBC, p, key, counters, S, B, C, s0, "dropout");
}

template <typename T>
void dropout_add_forward(void* stream, T* y_SBC, const T* residual_SBC, const T* x_SBC, double p,
                         uint64_t key, const DropoutCounters* counters, int64_t S, int64_t B,
                         int64_t C, int64_t s0) {
  dropout_launch<T, true>(stream, y_SBC, residual_SBC, x_SBC, p, key, counters, S, B, C, s0,
                          "dropout_add");
}

template <typename T>
void dropout_backward(void* stream, T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                      const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                      int64_t s0) {
  dropout_launch<T, false>(stream, dx_SBC, nullptr, dy_SBC, p, key, counters, S, B, C, s0,
                           "dropout_backward");
}

#define MOECORE_INSTANTIATE_DROPOUT(T)                                                             \
  template void dropout_forward<T>(void*, T*, const T*, double, uint64_t, const DropoutCounters*,  \
                                   int64_t, int64_t, int64_t, int64_t);                            \
  template void dropout_add_forward<T>(void*, T*, const T*, const T*, double, uint64_t,            \
                                       const DropoutCounters*, int64_t, int64_t, int64_t,          \
                                       int64_t);                                                   \
  template void dropout_backward<T>(void*, T*, const T*, double, uint64_t, const DropoutCounters*, \
                                    int64_t, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE_DROPOUT(float)
MOECORE_INSTANTIATE_DROPOUT(double)
#undef MOECORE_INSTANTIATE_DROPOUT

}  // namespace moecore::ops::cuda
