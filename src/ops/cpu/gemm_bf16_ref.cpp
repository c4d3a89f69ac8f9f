// Plain-loop bf16 GEMM: inputs widened to f64, summed in f64, stored as f32.
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

}  // namespace moecore::ops
