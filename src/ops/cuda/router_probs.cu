// The routing probabilities and their backward on the GPU, in f64 like the CPU (docs/router.md).
// The gather and kept_prob_grads are elementwise; the probs and the backward of the formulas over
// K run a thread per token, its K terms in k order as the CPU fast path adds them (K is small, and
// each token writes only its own row). SoftmaxOverE's backward is a block per token: the row's
// g scattered into work, its dot with the softmax in a fixed block tree (ops/cuda/reduce.cuh), then
// the softmax backward into dlogits. No atomics: the same bits run to run.
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/router_probs.h"

namespace moecore::ops::cuda {

namespace kernels {
// d score / d logit of the elementwise score functions (ops/cpu/router_math.h's, for the device).
__device__ __forceinline__ double dscore_dlogit(ScoreFn f, double logit, double score) {
  if (f == ScoreFn::Sigmoid) return score * (1.0 - score);
  const double sig = 1.0 / (1.0 + std::exp(-logit));
  return sig / (2.0 * score);  // d sqrt(softplus(l)) / dl
}

__global__ void gather_topk(double* val_TK, const double* src_TE, const int32_t* idx_TK, int64_t E,
                            int64_t K, int64_t TK) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < TK; i += stride) {
    val_TK[i] = src_TE[(i / K) * E + idx_TK[i]];
  }
}

template <typename T>
__global__ void kept_prob_grads(double* g_TK, const T* dprobs_TK, const int32_t* idx_TK,
                                double scale, int64_t TK) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < TK; i += stride) {
    g_TK[i] = idx_TK[i] >= 0 ? static_cast<double>(dprobs_TK[i]) * scale : 0.0;
  }
}

// A thread per token (grid-stride).
__global__ void topk_probs(ProbsFn fn, double* probs_TK, const double* val_TK, double scale,
                           int64_t n_tok, int64_t K) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n_tok; t += stride) {
    const double* v = val_TK + t * K;
    double* p = probs_TK + t * K;
    if (fn == ProbsFn::SoftmaxOverK) {
      double m = v[0], z = 0;  // v is in descending order of the key, not necessarily of v
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) p[k] = std::exp(v[k] - m) / z * scale;
    } else if (fn == ProbsFn::Normalized && K > 1) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      for (int64_t k = 0; k < K; ++k) p[k] = v[k] / (sum + kRouterNormEps) * scale;
    } else {
      for (int64_t k = 0; k < K; ++k) p[k] = v[k] * scale;
    }
  }
}

// SoftmaxOverK, SigmoidTop1 and Normalized: a thread per token (grid-stride), adding into its own
// row of dlogits at the routed experts.
__global__ void topk_probs_backward_over_k(ProbsFn fn, ScoreFn score, double* dlogits_TE,
                                           const double* g_TK, const double* val_TK,
                                           const int32_t* routed_TK, const double* logits_TE,
                                           const double* scores_TE, int64_t n_tok, int64_t E,
                                           int64_t K) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n_tok; t += stride) {
    const double* v = val_TK + t * K;
    const double* g = g_TK + t * K;
    const int32_t* idx = routed_TK + t * K;
    double* dl = dlogits_TE + t * E;
    if (fn == ProbsFn::SoftmaxOverK) {
      // p = softmax(v) over K, recomputed unscaled.
      double m = v[0], z = 0, dot = 0;
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) dot += g[k] * (std::exp(v[k] - m) / z);
      for (int64_t k = 0; k < K; ++k) dl[idx[k]] += std::exp(v[k] - m) / z * (g[k] - dot);
    } else if (fn == ProbsFn::SigmoidTop1) {
      dl[idx[0]] += g[0] * v[0] * (1.0 - v[0]);
    } else {
      // Normalized: p = v / (sum v + eps) for K > 1, else v.
      double sum = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      const double den = sum + kRouterNormEps;
      for (int64_t k = 0; k < K; ++k) dot += g[k] * v[k];
      for (int64_t k = 0; k < K; ++k) {
        const double dv = K > 1 ? g[k] / den - dot / (den * den) : g[k];
        const int64_t e = idx[k];
        dl[e] += dv * dscore_dlogit(score, logits_TE[t * E + e], scores_TE[t * E + e]);
      }
    }
  }
}

// SoftmaxOverE: a block per token (dynamic shared memory: blockDim.x / 32 + 1 doubles). work's
// row = g scattered to the routed experts (one thread, in k order), then
// dl[e] += s[e] (w[e] - sum_e' w[e'] s[e']), the softmax backward.
__global__ void topk_probs_backward_over_e(double* dlogits_TE, double* work_TE, const double* g_TK,
                                           const int32_t* routed_TK, const double* scores_TE,
                                           int64_t E, int64_t K) {
  const int64_t t = blockIdx.x;
  double* w = work_TE + t * E;
  const double* s = scores_TE + t * E;
  double* dl = dlogits_TE + t * E;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) w[e] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int64_t k = 0; k < K; ++k) w[routed_TK[t * K + k]] += g_TK[t * K + k];
  }
  __syncthreads();
  double part = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) part += w[e] * s[e];
  const double dot = block_sum(part, dynamic_shared<double>());
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dl[e] += s[e] * (w[e] - dot);
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// Grid-stride kernels' blocks at most: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;

dim3 stride_grid(int64_t n) {
  return dim3(unsigned(std::min((n + kBlock - 1) / kBlock, kMaxBlocks)));
}

std::string shape(int64_t n_tok, int64_t E, int64_t K) {
  return "tokens=" + std::to_string(n_tok) + " experts=" + std::to_string(E) +
         " topk=" + std::to_string(K);
}
}  // namespace

void gather_topk(void* stream, double* val_TK, const double* src_TE, const int32_t* idx_TK,
                 int64_t n_tok, int64_t E, int64_t K) {
  MOE_KERNEL_CHECK(
      n_tok >= 0 && E >= 1 && K >= 1 && K <= E,
      "[gather_topk] " + shape(n_tok, E, K) + ": needs tokens >= 0 and 1 <= topk <= experts");
  if (n_tok == 0) return;
  launch("gather_topk", kernels::gather_topk, stride_grid(n_tok * K), dim3(unsigned(kBlock)), 0,
         stream, val_TK, src_TE, idx_TK, E, K, n_tok * K);
}

void topk_probs(void* stream, ProbsFn fn, double* probs_TK, const double* val_TK, double scale,
                int64_t n_tok, int64_t K) {
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1, "[topk_probs] tokens=" + std::to_string(n_tok) +
                                             " topk=" + std::to_string(K) +
                                             ": needs tokens >= 0 and topk >= 1");
  if (n_tok == 0) return;
  launch("topk_probs", kernels::topk_probs, stride_grid(n_tok), dim3(unsigned(kBlock)), 0, stream,
         fn, probs_TK, val_TK, scale, n_tok, K);
}

template <typename T>
void kept_prob_grads(void* stream, double* g_TK, const T* dprobs_TK, const int32_t* idx_TK,
                     double scale, int64_t TK) {
  MOE_KERNEL_CHECK(TK >= 0, "[kept_prob_grads] tokens x topk=" + std::to_string(TK) + " < 0");
  if (TK == 0) return;
  launch("kept_prob_grads", kernels::kept_prob_grads<T>, stride_grid(TK), dim3(unsigned(kBlock)), 0,
         stream, g_TK, dprobs_TK, idx_TK, scale, TK);
}

void topk_probs_backward(void* stream, ProbsFn fn, ScoreFn score, double* dlogits_TE,
                         double* work_TE, const double* g_TK, const double* val_TK,
                         const int32_t* routed_TK, const double* logits_TE, const double* scores_TE,
                         int64_t n_tok, int64_t E, int64_t K) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && E >= 1 && K >= 1 && K <= E,
                   "[topk_probs_backward] " + shape(n_tok, E, K) +
                       ": needs 0 <= tokens <= 2^31-1 (one block each) and 1 <= topk <= experts");
  MOE_KERNEL_CHECK(fn != ProbsFn::SigmoidTop1 || K == 1,
                   "[topk_probs_backward] the sigmoid top-1 probs with topk=" + std::to_string(K) +
                       ": they are sinkhorn's for topk 1 only");
  MOE_KERNEL_CHECK(fn != ProbsFn::Normalized || score != ScoreFn::Softmax,
                   "[topk_probs_backward] normalized probs of softmax scores: they follow the "
                   "sigmoid or sqrtsoftplus score functions only (softmax scores use the softmax "
                   "over K or over E)");
  if (n_tok == 0) return;
  if (fn == ProbsFn::SoftmaxOverE) {
    const int64_t block = std::min(kBlock, (E + 31) / 32 * 32);
    const size_t smem = size_t(block / 32 + 1) * sizeof(double);
    launch("topk_probs_backward_over_e", kernels::topk_probs_backward_over_e, dim3(unsigned(n_tok)),
           dim3(unsigned(block)), smem, stream, dlogits_TE, work_TE, g_TK, routed_TK, scores_TE, E,
           K);
    return;
  }
  launch("topk_probs_backward_over_k", kernels::topk_probs_backward_over_k, stride_grid(n_tok),
         dim3(unsigned(kBlock)), 0, stream, fn, score, dlogits_TE, g_TK, val_TK, routed_TK,
         logits_TE, scores_TE, n_tok, E, K);
}

template void kept_prob_grads<float>(void*, double*, const float*, const int32_t*, double, int64_t);
template void kept_prob_grads<double>(void*, double*, const double*, const int32_t*, double,
                                      int64_t);

}  // namespace moecore::ops::cuda
