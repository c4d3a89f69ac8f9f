// The router's load-balancing state on the GPU. Counting is a fixed-tree block sum of integers per
// expert (bitwise the CPU's counts, no atomics). The [E]-sized updates run in one block whose
// sums over E are one thread's loop in e order (the CPU's order; E is small). Quantile balancing
// selects a column's (C+1)-th largest by rank: the value v_t with #{v > v_t} <= C < #{v >= v_t},
// taken from the first such t, so the result is the CPU's nth_element value whatever the thread
// order, and needs no scratch (col_T is unused).
#include <algorithm>
#include <limits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/router_balance.h"

namespace moecore::ops::cuda {

namespace kernels {

// Block (e, 0): counts_E[e]; block (e, 1 + b): seq_counts_BE[b, e] over the tokens t = b mod B.
// Dynamic shared memory: blockDim.x / 32 + 1 int64.
__global__ void count_tokens_per_expert(int64_t* counts_E, int64_t* seq_counts_BE,
                                        const int32_t* idx_TK, int64_t n_tok, int64_t K, int64_t E,
                                        int64_t B) {
  const int32_t e = int32_t(blockIdx.x);
  const int64_t y = blockIdx.y;
  int64_t c = 0;
  if (y == 0) {
    for (int64_t i = threadIdx.x; i < n_tok * K; i += blockDim.x) c += idx_TK[i] == e ? 1 : 0;
  } else {
    const int64_t b = y - 1;
    for (int64_t t = b + int64_t(threadIdx.x) * B; t < n_tok; t += int64_t(blockDim.x) * B) {
      for (int64_t k = 0; k < K; ++k) c += idx_TK[t * K + k] == e ? 1 : 0;
    }
  }
  c = block_sum(c, dynamic_shared<int64_t>());
  if (threadIdx.x != 0) return;
  if (y == 0)
    counts_E[e] = c;
  else
    seq_counts_BE[(y - 1) * E + e] = c;
}

__global__ void accumulate_counts(double* sum_E, const int64_t* counts_E, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < E) sum_E[e] += static_cast<double>(counts_E[e]);
}

__global__ void running_mean_counts(double* mean_E, const double* sum_E, const int64_t* counts_E,
                                    double n_micro, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  mean_E[e] =
      counts_E ? (sum_E[e] + static_cast<double>(counts_E[e])) / n_micro : sum_E[e] / n_micro;
}

__global__ void divide_in_place(double* x, double d, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) x[i] /= d;
}

// Block e: beta_sum[e] += column e's (C+1)-th largest of (l - alpha). Shared: the value found.
__global__ void quantile_beta_estimate(double* beta_sum_E, const double* logits_TE,
                                       const double* keyv_TK1, int64_t n, int64_t E, int64_t K,
                                       int64_t C) {
  __shared__ double found;
  const int64_t e = blockIdx.x, K1 = K + 1;
  if (threadIdx.x == 0) found = std::numeric_limits<double>::quiet_NaN();  // NaN in the column
  __syncthreads();
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const double v = logits_TE[t * E + e] - keyv_TK1[t * K1 + K];
    int64_t greater = 0, equal_before = 0, equal = 0;
    for (int64_t s = 0; s < n; ++s) {
      const double w = logits_TE[s * E + e] - keyv_TK1[s * K1 + K];
      greater += w > v ? 1 : 0;
      equal += w == v ? 1 : 0;
      equal_before += (s < t && w == v) ? 1 : 0;
    }
    // v_t sits at descending position C, and t is the first of its equals: one writer.
    if (greater <= C && C < greater + equal && equal_before == 0) found = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) beta_sum_E[e] += found;
}

// One block. work[e] = ema beta + (1 - ema) avg, rounded as written (no contraction); the mean
// over E by thread 0 in e order; beta = work - mean as fp32.
__global__ void quantile_beta_update(float* beta_E, double* work_E, const double* avg_E, double ema,
                                     int64_t E) {
  __shared__ double mean;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    work_E[e] = __dadd_rn(__dmul_rn(ema, double(beta_E[e])), __dmul_rn(1.0 - ema, avg_E[e]));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += work_E[e];
    mean = s / static_cast<double>(E);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) beta_E[e] = float(work_E[e] - mean);
}

// One block: bias += rate * sign(mean(c) - c), the mean's sum by thread 0 in e order.
__global__ void expert_bias_update(float* bias_E, const double* counts_E, float rate, int64_t E) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += counts_E[e];
    mean = s / static_cast<double>(E);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const double off = mean - counts_E[e];
    const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
    bias_E[e] = __fadd_rn(bias_E[e], __fmul_rn(sign, rate));
  }
}

}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxGrid = 0x7fffffff;

unsigned flat_grid(int64_t n) {
  return unsigned(std::min(kMaxGrid, (n + kBlock - 1) / kBlock));
}

std::string e_msg(const char* op, int64_t E) {
  return std::string("[") + op + "] E=" + std::to_string(E) + " (>= 0 experts)";
}
}  // namespace

void count_tokens_per_expert(void* stream, int64_t* counts_E, int64_t* seq_counts_BE,
                             const int32_t* idx_TK, int64_t n_tok, int64_t K, int64_t E,
                             int64_t B) {
  const int64_t rows = seq_counts_BE ? B + 1 : 1;
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 0 && E >= 0 && E <= kMaxGrid &&
                       (!seq_counts_BE || (B >= 1 && rows <= 65535)),
                   "[count_tokens_per_expert] T=" + std::to_string(n_tok) + " K=" +
                       std::to_string(K) + " E=" + std::to_string(E) + " B=" + std::to_string(B) +
                       ": needs T, K >= 0, 0 <= E <= 2^31-1 and, with per-sequence counts, "
                       "1 <= B <= 65534 sequences");
  if (E == 0) return;
  // Whole warps for the slots, at most kBlock threads.
  const int64_t block = std::clamp<int64_t>((n_tok * K + 31) / 32 * 32, 32, kBlock);
  launch("count_tokens_per_expert", kernels::count_tokens_per_expert,
         dim3(unsigned(E), unsigned(rows)), dim3(unsigned(block)),
         size_t(block / 32 + 1) * sizeof(int64_t), stream, counts_E, seq_counts_BE, idx_TK, n_tok,
         K, E, B);
}

void accumulate_counts(void* stream, double* sum_E, const int64_t* counts_E, int64_t E) {
  MOE_KERNEL_CHECK(E >= 0, e_msg("accumulate_counts", E));
  if (E == 0) return;
  launch("accumulate_counts", kernels::accumulate_counts, dim3(flat_grid(E)),
         dim3(unsigned(kBlock)), 0, stream, sum_E, counts_E, E);
}

void running_mean_counts(void* stream, double* mean_E, const double* sum_E, const int64_t* counts_E,
                         double n_micro, int64_t E) {
  MOE_KERNEL_CHECK(E >= 0, e_msg("running_mean_counts", E));
  if (E == 0) return;
  launch("running_mean_counts", kernels::running_mean_counts, dim3(flat_grid(E)),
         dim3(unsigned(kBlock)), 0, stream, mean_E, sum_E, counts_E, n_micro, E);
}

void quantile_beta_estimate(void* stream, double* beta_sum_E, double* col_T,
                            const double* logits_TE, const double* keyv_TK1, int64_t n_tok,
                            int64_t E, int64_t K) {
  (void)col_T;  // the selection by rank needs no scratch
  MOE_KERNEL_CHECK(n_tok >= 1 && K >= 1 && K < E && E <= kMaxGrid && n_tok * K % E == 0,
                   "[quantile_beta_estimate] K=" + std::to_string(K) + " E=" + std::to_string(E) +
                       " T=" + std::to_string(n_tok) +
                       ": needs T >= 1, 1 <= K < E (keyv is a top-(K+1) of E) and T K divisible "
                       "by E");
  launch("quantile_beta_estimate", kernels::quantile_beta_estimate, dim3(unsigned(E)),
         dim3(unsigned(kBlock)), 0, stream, beta_sum_E, logits_TE, keyv_TK1, n_tok, E, K,
         n_tok * K / E);
}

void divide_in_place(void* stream, double* x, double d, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[divide_in_place] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  launch("divide_in_place", kernels::divide_in_place, dim3(flat_grid(n)), dim3(unsigned(kBlock)), 0,
         stream, x, d, n);
}

void quantile_beta_update(void* stream, float* beta_E, double* work_E, const double* avg_E,
                          double ema, int64_t E) {
  MOE_KERNEL_CHECK(E >= 0, e_msg("quantile_beta_update", E));
  if (E == 0) return;
  launch("quantile_beta_update", kernels::quantile_beta_update, dim3(1), dim3(unsigned(kBlock)), 0,
         stream, beta_E, work_E, avg_E, ema, E);
}

void expert_bias_update(void* stream, float* bias_E, const double* counts_E, float rate,
                        int64_t E) {
  MOE_KERNEL_CHECK(E >= 0, e_msg("expert_bias_update", E));
  if (E == 0) return;
  launch("expert_bias_update", kernels::expert_bias_update, dim3(1), dim3(unsigned(kBlock)), 0,
         stream, bias_E, counts_E, rate, E);
}

}  // namespace moecore::ops::cuda
