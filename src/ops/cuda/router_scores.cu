// Router score functions and the aux scores' backward on the GPU, in f64 (docs/router.md).
// Softmax: ops/cuda/softmax_topk.cu's row kernel, the aux scores a copy. Sigmoid and
// sqrt(softplus): one thread per row computing the scores and their sum in e order, as the CPU
// paths do, so the scores and aux scores are the CPU's bits wherever the device's exp / log1p /
// sqrt round as the host's (the grid emulator). The backward: one block per row, its two sums in
// ops/cuda/reduce.cuh's fixed trees (within the f64 tolerance of the CPU's, the same run to run).
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/memory.h"
#include "ops/router_scores.h"
#include "ops/softmax_topk.h"

namespace moecore::ops::cuda {

namespace kernels {
// ops/cpu/router_math.h's formulas, written out for the device.
__device__ __forceinline__ double router_sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
__device__ __forceinline__ double router_score(bool sigmoid, double l) {
  if (sigmoid) return router_sigmoid(l);
  const double softplus = l > 0 ? l + std::log1p(std::exp(-l)) : std::log1p(std::exp(l));
  return std::sqrt(softplus);
}
__device__ __forceinline__ double router_dscore_dlogit(bool sigmoid, double l, double s) {
  if (sigmoid) return s * (1.0 - s);
  return router_sigmoid(l) / (2.0 * s);
}

// One thread per row: scores, their sum in e order, then the aux scores. scores may alias logits
// when aux is null (each element is read before it is written).
__global__ void router_scores_elementwise(double* scores_TE, double* aux_scores_TE,
                                          const double* logits_TE, bool sigmoid, int64_t n_tok,
                                          int64_t E, double eps) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tok) return;
  const double* l = logits_TE + t * E;
  double* sc = scores_TE + t * E;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double s = router_score(sigmoid, l[e]);
    sc[e] = s;
    sum += s;
  }
  if (!aux_scores_TE) return;
  double* a = aux_scores_TE + t * E;
  for (int64_t e = 0; e < E; ++e) a[e] = sc[e] / (sum + eps);
}

// One block per row. Softmax: dl += a (g - sum(g a)); elementwise: dl += (g / den - sum(g s) /
// den^2) dscore/dlogit with den = sum(s) + eps. Dynamic shared memory: blockDim.x / 32 + 1
// doubles.
__global__ void aux_scores_backward(double* dlogits_TE, const double* daux_TE,
                                    const double* aux_scores_TE, const double* scores_TE,
                                    const double* logits_TE, int fn, int64_t E, double eps) {
  double* shared = dynamic_shared<double>();
  const int64_t row = int64_t(blockIdx.x) * E;
  const double* g = daux_TE + row;
  double* dl = dlogits_TE + row;
  if (fn == int(ScoreFn::Softmax)) {
    const double* a = aux_scores_TE + row;
    double dot = 0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dot += g[e] * a[e];
    dot = block_sum(dot, shared);
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dl[e] += a[e] * (g[e] - dot);
    return;
  }
  const bool sigmoid = fn == int(ScoreFn::Sigmoid);
  const double* sc = scores_TE + row;
  const double* l = logits_TE + row;
  double sum = 0, dot = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    sum += sc[e];
    dot += g[e] * sc[e];
  }
  sum = block_sum(sum, shared);  // its result slot is rewritten only after the next barrier
  dot = block_sum(dot, shared);
  const double den = sum + eps;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const double ds = g[e] / den - dot / (den * den);
    dl[e] += ds * router_dscore_dlogit(sigmoid, l[e], sc[e]);
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kRowThreadBlock = 128;  // the thread-per-row grid's blocks
constexpr int64_t kMaxRowBlock = 256;     // the block-per-row kernels: a warp per 32 experts

void check_rows(const char* op, int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && E > 0,
                   std::string("[") + op + "] tokens=" + std::to_string(n_tok) +
                       " (0 to 2^31-1), experts=" + std::to_string(E) + " (> 0)");
}
}  // namespace

void router_scores(void* stream, ScoreFn fn, double* scores_TE, double* aux_scores_TE,
                   const double* logits_TE, int64_t n_tok, int64_t E) {
  check_rows("router_scores", n_tok, E);
  if (n_tok == 0) return;
  if (fn == ScoreFn::Softmax) {
    softmax_forward<double>(stream, scores_TE, logits_TE, n_tok, E);
    if (aux_scores_TE) copy_bytes(stream, aux_scores_TE, scores_TE, sizeof(double) * n_tok * E);
    return;
  }
  launch("router_scores_elementwise", kernels::router_scores_elementwise,
         dim3(unsigned((n_tok + kRowThreadBlock - 1) / kRowThreadBlock)),
         dim3(unsigned(kRowThreadBlock)), 0, stream, scores_TE, aux_scores_TE, logits_TE,
         fn == ScoreFn::Sigmoid, n_tok, E, kRouterNormEps);
}

void aux_scores_backward(void* stream, ScoreFn fn, double* dlogits_TE, double* daux_TE,
                         const double* aux_scores_TE, const double* scores_TE,
                         const double* logits_TE, int64_t n_tok, int64_t E) {
  check_rows("aux_scores_backward", n_tok, E);
  if (n_tok == 0) return;
  const int64_t block = std::min(kMaxRowBlock, (E + 31) / 32 * 32);
  launch("aux_scores_backward", kernels::aux_scores_backward, dim3(unsigned(n_tok)),
         dim3(unsigned(block)), size_t(block / 32 + 1) * sizeof(double), stream, dlogits_TE,
         static_cast<const double*>(daux_TE), aux_scores_TE, scores_TE, logits_TE, int(fn), E,
         kRouterNormEps);
}

}  // namespace moecore::ops::cuda
