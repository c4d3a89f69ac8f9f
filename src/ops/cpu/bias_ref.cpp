// Column bias and its grouped form, plain loops: the oracle of bias.cpp (sums in f64).
#include "ops/bias.h"

namespace moecore::ops {

template <typename T>
void bias_forward_ref(T* y_MN, const T* b_N, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) y_MN[m * N + n] += b_N[n];
  }
}

template <typename T>
void bias_backward_ref(T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    double acc = 0;
    for (int64_t m = 0; m < M; ++m) acc += static_cast<double>(dy_MN[m * N + n]);
    db_N[n] = static_cast<T>(static_cast<double>(db_N[n]) + acc);
  }
}

template <typename T>
void grouped_bias_forward_ref(T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G, int64_t G,
                              int64_t C) {
  int64_t n = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < m_G[g]; ++r, ++n) {
      const double s = p_N ? static_cast<double>(p_N[n]) : 1.0;
      for (int64_t c = 0; c < C; ++c) {
        y_NC[n * C + c] = static_cast<T>(static_cast<double>(y_NC[n * C + c]) +
                                         s * static_cast<double>(b_GC[g * C + c]));
      }
    }
  }
}

template <typename T>
void grouped_bias_backward_ref(T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC, const T* p_N,
                               const int64_t* m_G, int64_t G, int64_t C) {
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t n = row0; n < row0 + m_G[g]; ++n) {
        const double s = p_N ? static_cast<double>(p_N[n]) : 1.0;
        acc += s * static_cast<double>(dy_NC[n * C + c]);
      }
      db_GC[g * C + c] = static_cast<T>(static_cast<double>(db_GC[g * C + c]) + acc);
    }
    if (p_N && dp_N) {
      for (int64_t n = row0; n < row0 + m_G[g]; ++n) {
        double acc = 0;
        for (int64_t c = 0; c < C; ++c)
          acc += static_cast<double>(dy_NC[n * C + c]) * static_cast<double>(b_GC[g * C + c]);
        dp_N[n] = static_cast<T>(static_cast<double>(dp_N[n]) + acc);
      }
    }
    row0 += m_G[g];
  }
}

template void bias_forward_ref<float>(float*, const float*, int64_t, int64_t);
template void bias_forward_ref<double>(double*, const double*, int64_t, int64_t);
template void bias_backward_ref<float>(float*, const float*, int64_t, int64_t);
template void bias_backward_ref<double>(double*, const double*, int64_t, int64_t);
template void grouped_bias_forward_ref<float>(float*, const float*, const float*, const int64_t*,
                                              int64_t, int64_t);
template void grouped_bias_forward_ref<double>(double*, const double*, const double*,
                                               const int64_t*, int64_t, int64_t);
template void grouped_bias_backward_ref<float>(float*, float*, const float*, const float*,
                                               const float*, const int64_t*, int64_t, int64_t);
template void grouped_bias_backward_ref<double>(double*, double*, const double*, const double*,
                                                const double*, const int64_t*, int64_t, int64_t);

}  // namespace moecore::ops
