// GEMM peak probe: the achieved GFLOP/s of the CPU GEMM we use, at a given shape. The MFU
// denominator for benchmarks and for the trainer's start-up report.
#pragma once

#include <cstdint>
#include <functional>

namespace moecore::ops {

// Times repeated C[M,N] = A[M,K] * B[K,N] (row-major, fresh random operands) for at least
// `min_seconds` after one warm-up call and returns the median rate over the timed calls in
// GFLOP/s (2*M*N*K flops per call). bf16 = false: f32 via dnnl_sgemm (the fast path of
// ops::gemm); bf16 = true: oneDNN matmul with bf16 A, B and f32 C. Uses the current OpenMP
// thread count.
double measure_gemm_gflops(bool bf16, int64_t M, int64_t N, int64_t K, double min_seconds);

// One GEMM as a model runs it: C[M,N] = op(A) op(B), row-major, dense operands.
struct GemmShape {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
};

// The rate of the GEMM path the model's GEMMs take at this shape and orientation: ops::gemm<float>
// (bf16 = false) or ops::gemm_bf16 on the path bf16_gemm_path() chose, widening included
// (bf16 = true), timed as measure_gemm_gflops. In GFLOP/s.
double measure_model_gemm_gflops(bool bf16, const GemmShape& shape, double min_seconds);

// The timing loop behind it, for benches that time other libraries the same way: calls `fn`
// once to warm up, then repeatedly for at least `min_seconds` (and at least 3 times), and
// returns the median of flops_per_call / seconds_per_call, in GFLOP/s.
double measure_gflops(const std::function<void()>& fn, double flops_per_call, double min_seconds);

}  // namespace moecore::ops
