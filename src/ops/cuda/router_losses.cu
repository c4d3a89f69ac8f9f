// The router's loss values and gradients on the GPU, in f64 like the CPU (docs/router.md,
// "Losses"). A value is one block: each thread adds its strided elements a_te N_e of the [T, E]
// scores in order (sum_e P_e N_e = sum_te a_te N_e), the block meets in a fixed tree
// (ops/cuda/reduce.cuh) and thread 0 writes the scaled sum to the value's slot in device memory:
// nothing returns to the host, and no scratch is needed. z-loss writes each token's logsumexp (a
// thread per token, in expert order as the CPU), then one block sums their squares. The gradients
// are elementwise. No atomics: the same bits run to run, within the f64 tolerance of the
// references (another summation order).
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/router_losses.h"

namespace moecore::ops::cuda {

namespace kernels {
// *value = (sum_{t, e} a_te N_{t mod B, e}) * num / den / div, one block (dynamic shared memory:
// blockDim.x / 32 + 1 doubles). B = 1: the micro-batch's (or running mean) counts N_e.
template <typename C>
__global__ void weighted_score_sum(double* value, const double* aux_scores_TE, const C* counts_BE,
                                   int64_t TE, int64_t E, int64_t B, double num, double den,
                                   double div) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < TE; i += blockDim.x) {
    const int64_t t = i / E, e = i - t * E;
    acc += aux_scores_TE[i] * static_cast<double>(counts_BE[(t % B) * E + e]);
  }
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) *value = s * num / den / div;
}

// lse [T] = logsumexp of each row of logits: a thread per token (grid-stride), in expert order.
__global__ void row_logsumexp(double* lse_T, const double* logits_TE, int64_t n_tok, int64_t E) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n_tok; t += stride) {
    const double* l = logits_TE + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
    lse_T[t] = m + std::log(z);
  }
}

// *value = mean_t lse_t^2 (0 for no tokens), one block (shared memory as weighted_score_sum's).
__global__ void mean_square(double* value, const double* lse_T, int64_t n_tok) {
  double acc = 0;
  for (int64_t t = threadIdx.x; t < n_tok; t += blockDim.x) acc += lse_T[t] * lse_T[t];
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) *value = n_tok > 0 ? s / static_cast<double>(n_tok) : 0.0;
}

// daux [T, E] += c * N_{t mod B, e} (grid-stride; B = 1: the counts N_e).
template <typename C>
__global__ void add_scaled_counts(double* daux_TE, const C* counts_BE, double c, int64_t TE,
                                  int64_t E, int64_t B) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < TE; i += stride) {
    const int64_t t = i / E, e = i - t * E;
    daux_TE[i] += c * static_cast<double>(counts_BE[(t % B) * E + e]);
  }
}

// dlogits [T, E] += coeff * lse_t * softmax_te (grid-stride).
__global__ void z_loss_grad(double* dlogits_TE, const double* lse_T, const double* softmax_TE,
                            double coeff, int64_t TE, int64_t E) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < TE; i += stride) {
    dlogits_TE[i] += coeff * lse_T[i / E] * softmax_TE[i];
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// The one block of a value: the most threads a block may have, so that a [T, E] of a few
// million elements is a few thousand loads a thread.
constexpr int64_t kValueBlock = 1024;
// Grid-stride kernels' blocks at most: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;

dim3 stride_grid(int64_t n) {
  return dim3(unsigned(std::min((n + kBlock - 1) / kBlock, kMaxBlocks)));
}
constexpr size_t kValueSmem = size_t(kValueBlock / 32 + 1) * sizeof(double);

std::string shape(int64_t n_tok, int64_t E) {
  return "tokens=" + std::to_string(n_tok) + " experts=" + std::to_string(E);
}
}  // namespace

template <typename C>
void aux_loss_value(void* stream, double* value, const double* aux_scores_TE, const C* counts_E,
                    int64_t n_tok, int64_t E, int64_t K) {
  MOE_KERNEL_CHECK(n_tok >= 1 && E >= 1 && K >= 1,
                   "[aux_loss_value] " + shape(n_tok, E) + " topk=" + std::to_string(K) +
                       ": needs at least one token, expert and topk (the caller skips the "
                       "loss of no tokens)");
  const double n = static_cast<double>(n_tok);
  launch("aux_loss_value", kernels::weighted_score_sum<C>, dim3(1), dim3(unsigned(kValueBlock)),
         kValueSmem, stream, value, aux_scores_TE, counts_E, n_tok * E, E, int64_t(1),
         static_cast<double>(E), static_cast<double>(K) * n * n, 1.0);
}

void seq_aux_loss_value(void* stream, double* value, const double* aux_scores_TE,
                        const int64_t* seq_counts_BE, int64_t n_tok, int64_t E, int64_t K,
                        int64_t B) {
  MOE_KERNEL_CHECK(n_tok >= 1 && E >= 1 && K >= 1 && B >= 1 && n_tok % B == 0,
                   "[seq_aux_loss_value] " + shape(n_tok, E) + " topk=" + std::to_string(K) +
                       " sequences=" + std::to_string(B) +
                       ": needs at least one token, expert, topk and sequence, and the tokens a "
                       "multiple of the sequences");
  const double S = static_cast<double>(n_tok / B);
  launch("seq_aux_loss_value", kernels::weighted_score_sum<int64_t>, dim3(1),
         dim3(unsigned(kValueBlock)), kValueSmem, stream, value, aux_scores_TE, seq_counts_BE,
         n_tok * E, E, B, static_cast<double>(E), static_cast<double>(K) * S * S,
         static_cast<double>(B));
}

void z_loss_value(void* stream, double* value, double* lse_T, const double* logits_TE,
                  int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E >= 1,
                   "[z_loss_value] " + shape(n_tok, E) + ": needs tokens >= 0 and experts >= 1");
  if (n_tok > 0) {
    launch("z_loss_logsumexp", kernels::row_logsumexp, stride_grid(n_tok), dim3(unsigned(kBlock)),
           0, stream, lse_T, logits_TE, n_tok, E);
  }
  launch("z_loss_value", kernels::mean_square, dim3(1), dim3(unsigned(kValueBlock)), kValueSmem,
         stream, value, static_cast<const double*>(lse_T), n_tok);
}

template <typename C>
void aux_loss_grad(void* stream, double* daux_TE, const C* counts_E, double coeff, int64_t n_tok,
                   int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E >= 1,
                   "[aux_loss_grad] " + shape(n_tok, E) + ": needs tokens >= 0 and experts >= 1");
  if (n_tok == 0) return;
  const double n = static_cast<double>(n_tok);
  launch("aux_loss_grad", kernels::add_scaled_counts<C>, stride_grid(n_tok * E),
         dim3(unsigned(kBlock)), 0, stream, daux_TE, counts_E, coeff / (n * n), n_tok * E, E,
         int64_t(1));
}

void seq_aux_loss_grad(void* stream, double* daux_TE, const int64_t* seq_counts_BE, double coeff,
                       int64_t n_tok, int64_t E, int64_t B) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E >= 1 && B >= 1 && n_tok % B == 0,
                   "[seq_aux_loss_grad] " + shape(n_tok, E) + " sequences=" + std::to_string(B) +
                       ": needs tokens >= 0, experts and sequences >= 1, and the tokens a "
                       "multiple of the sequences");
  if (n_tok == 0) return;
  const double S = static_cast<double>(n_tok / B);
  launch("seq_aux_loss_grad", kernels::add_scaled_counts<int64_t>, stride_grid(n_tok * E),
         dim3(unsigned(kBlock)), 0, stream, daux_TE, seq_counts_BE,
         coeff / (S * S * static_cast<double>(B)), n_tok * E, E, B);
}

void z_loss_grad(void* stream, double* dlogits_TE, const double* lse_T, const double* softmax_TE,
                 double coeff, int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E >= 1,
                   "[z_loss_grad] " + shape(n_tok, E) + ": needs tokens >= 0 and experts >= 1");
  if (n_tok == 0) return;
  launch("z_loss_grad", kernels::z_loss_grad, stride_grid(n_tok * E), dim3(unsigned(kBlock)), 0,
         stream, dlogits_TE, lse_T, softmax_TE, coeff, n_tok * E, E);
}

template void aux_loss_value<int64_t>(void*, double*, const double*, const int64_t*, int64_t,
                                      int64_t, int64_t);
template void aux_loss_value<double>(void*, double*, const double*, const double*, int64_t, int64_t,
                                     int64_t);
template void aux_loss_grad<int64_t>(void*, double*, const int64_t*, double, int64_t, int64_t);
template void aux_loss_grad<double>(void*, double*, const double*, double, int64_t, int64_t);

}  // namespace moecore::ops::cuda
