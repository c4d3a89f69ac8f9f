// Plain-loop bf16 GEMMs: inputs widened to f64, summed in f64, stored as f32; the bf16-output
// grouped form sums in f32 in k order, adds the f32 bias and rounds to nearest even.
#include "ops/gemm_bf16.h"

namespace moecore::ops {

void gemm_bf16_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                   int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        float a = bf16_to_float(trans_a ? A[k * lda + i] : A[i * lda + k]);
        float b = bf16_to_float(trans_b ? B[j * ldb + k] : B[k * ldb + j]);
        acc += static_cast<double>(a) * b;
      }
      float& c = C[i * ldc + j];
      c = static_cast<float>(acc + (beta != 0.f ? static_cast<double>(beta) * c : 0.0));
    }
  }
}

void grouped_gemm_bf16_out_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K,
                               const bf16* x16, const bf16* w, bool trans_w, const float* bias_GN,
                               bf16* y16) {
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    const bf16* wg = w + g * N * K;
    for (int64_t i = 0; i < m_G[g]; ++i, ++row) {
      for (int64_t j = 0; j < N; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const float b = bf16_to_float(trans_w ? wg[j * K + k] : wg[k * N + j]);
          acc += bf16_to_float(x16[row * K + k]) * b;
        }
        if (bias_GN != nullptr) acc += bias_GN[g * N + j];
        y16[row * N + j] = float_to_bf16(acc);
      }
    }
  }
}

}  // namespace moecore::ops
