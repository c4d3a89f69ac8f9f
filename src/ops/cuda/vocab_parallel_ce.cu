// The vocab-parallel cross entropy's rows on the GPU (ops/vocab_parallel_ce.h), as the fused
// head's row kernels (ops/cuda/head_loss.cu): one block per row for the maxima, the exp sums (f64:
// each thread's elements in order, then the block's fixed tree) and the gradient; the finish in
// one block whose rows are computed in parallel and summed by one thread in row order (the CPU's
// serial sum, so its bits are the CPU's). No atomics: bitwise the same run to run.
// Targets are not checked on the host (that would be a sync): a target >= V gives a NaN target
// logit, so a NaN loss (the step's non-finite guard stops there); the CPU refuses it.
#include <cmath>
#include <limits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/vocab_parallel_ce.h"

namespace moecore::ops::cuda {

namespace kernels {

constexpr int kRowBlock = 256;

__device__ __forceinline__ float exp_of(float x) {
  return expf(x);
}
__device__ __forceinline__ double exp_of(double x) {
  return exp(x);
}

// Block i: max_M[i] = the max of row i (every thread starts from the row's first element, so a
// NaN there gives NaN and NaNs elsewhere are passed over, as on the CPU); -inf for an empty
// slice (a TP rank of padding only: the all-reduce's identity).
template <typename T>
__global__ void vocab_ce_row_max(T* max_M, const T* z_MV, int64_t Vl) {
  __shared__ T shared[kRowBlock / 32 + 1];
  const T* z = z_MV + int64_t(blockIdx.x) * Vl;
  T mx = Vl > 0 ? z[0] : -std::numeric_limits<T>::infinity();
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) mx = z[v] > mx ? z[v] : mx;
  mx = block_max(mx, shared);
  if (threadIdx.x == 0) max_M[blockIdx.x] = mx;
}

// Block i: sums_2M[i] = sum of exp(z - max_i) over the row (f64), sums_2M[m + i] = the target's
// logit when this slice holds it, else 0; NaN for a target >= V.
template <typename T>
__global__ void vocab_ce_row_sums(double* sums_2M, const T* z_MV, const T* max_M,
                                  const int32_t* target_M, int64_t m, int64_t v0, int64_t Vl,
                                  int64_t V) {
  __shared__ double shared[kRowBlock / 32 + 1];
  const int64_t i = blockIdx.x;
  const T* z = z_MV + i * Vl;
  const T mx = max_M[i];
  double part = 0;
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) part += double(exp_of(T(z[v] - mx)));
  const double se = block_sum(part, shared);
  if (threadIdx.x == 0) {
    const int64_t tgt = target_M[i], local = tgt - v0;
    sums_2M[i] = se;
    sums_2M[m + i] = tgt >= V                               ? double(NAN)
                     : tgt >= 0 && local >= 0 && local < Vl ? double(z[local])
                                                            : 0.0;
  }
}

// One block: the rows' log-sum-exp and loss in parallel, then thread 0 adds the losses to *sum
// in row order.
template <typename T>
__global__ void vocab_ce_finish(double* sum, T* loss_M, T* lse_M, const T* max_M,
                                const double* sums_2M, const int32_t* target_M, int64_t m) {
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const double lse = double(max_M[i]) + log(sums_2M[i]);
    lse_M[i] = T(lse);
    loss_M[i] = target_M[i] >= 0 ? T(lse - sums_2M[m + i]) : T(0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = *sum;
    for (int64_t i = 0; i < m; ++i) total += double(loss_M[i]);
    *sum = total;
  }
}

// Block i: row i in place, z -> (exp(z - lse) - [v0 + v == target]) * dloss; the target's entry
// rounds as (e - 1) * dloss, as on the CPU; an ignored row (target < 0) zeros. Each element is
// read and written by the same thread.
template <typename T>
__global__ void vocab_ce_grad(T* z_MV, const int32_t* target_M, const T* lse_M, const T* dloss,
                              int64_t v0, int64_t Vl) {
  const int64_t i = blockIdx.x;
  T* z = z_MV + i * Vl;
  const int64_t tgt = target_M[i];
  const T d = *dloss, lse = lse_M[i];
  for (int64_t v = threadIdx.x; v < Vl; v += blockDim.x) {
    if (tgt < 0) {
      z[v] = T(0);
      continue;
    }
    const T e = exp_of(T(z[v] - lse));
    z[v] = v0 + v == tgt ? (e - T(1)) * d : e * d;
  }
}

}  // namespace kernels

namespace {

void check_args(const char* who, int64_t m, const VocabSlice& vs) {
  MOE_KERNEL_CHECK(m >= 0 && m <= 0x7fffffff && vs.v0 >= 0 && vs.Vl >= 0 &&
                       (vs.Vl == 0 || vs.v0 + vs.Vl <= vs.V) && vs.V >= 1 &&
                       vs.V <= int64_t(1) << 31,
                   std::string("[") + who + "] rows m=" + std::to_string(m) +
                       " (0 to 2^31-1), vocabulary slice v0=" + std::to_string(vs.v0) +
                       " Vl=" + std::to_string(vs.Vl) + " of V=" + std::to_string(vs.V) +
                       ": needs 0 <= v0, 0 <= Vl, v0 + Vl <= V unless Vl = 0 (a TP rank of "
                       "padding only), 1 <= V <= 2^31 (int32 targets)");
}

const dim3 kBlock{unsigned(kernels::kRowBlock)};

}  // namespace

template <typename T>
void vocab_ce_row_max(void* stream, T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs) {
  check_args("vocab_ce_row_max", m, vs);
  if (m == 0) return;  // a grid of no blocks is a launch error
  launch("vocab_ce_row_max", kernels::vocab_ce_row_max<T>, dim3(unsigned(m)), kBlock, 0, stream,
         max_M, z_MV, vs.Vl);
}

template <typename T>
void vocab_ce_row_sums(void* stream, double* sums_2M, const T* z_MV, const T* max_M,
                       const int32_t* target_M, int64_t m, const VocabSlice& vs) {
  check_args("vocab_ce_row_sums", m, vs);
  if (m == 0) return;
  launch("vocab_ce_row_sums", kernels::vocab_ce_row_sums<T>, dim3(unsigned(m)), kBlock, 0, stream,
         sums_2M, z_MV, max_M, target_M, m, vs.v0, vs.Vl, vs.V);
}

template <typename T>
void vocab_ce_finish(void* stream, double* sum, T* loss_M, T* lse_M, const T* max_M,
                     const double* sums_2M, const int32_t* target_M, int64_t m) {
  MOE_KERNEL_CHECK(m >= 0, "[vocab_ce_finish] rows m=" + std::to_string(m) + " < 0");
  if (m == 0) return;  // *sum gains nothing
  launch("vocab_ce_finish", kernels::vocab_ce_finish<T>, dim3(1), kBlock, 0, stream, sum, loss_M,
         lse_M, max_M, sums_2M, target_M, m);
}

template <typename T>
void vocab_ce_grad(void* stream, T* z_MV, const int32_t* target_M, const T* lse_M, const T* dloss,
                   int64_t m, const VocabSlice& vs) {
  check_args("vocab_ce_grad", m, vs);
  if (m == 0) return;
  launch("vocab_ce_grad", kernels::vocab_ce_grad<T>, dim3(unsigned(m)), kBlock, 0, stream, z_MV,
         target_M, lse_M, dloss, vs.v0, vs.Vl);
}

#define MOECORE_VOCAB_CE_INSTANTIATE(T)                                                           \
  template void vocab_ce_row_max<T>(void*, T*, const T*, int64_t, const VocabSlice&);             \
  template void vocab_ce_row_sums<T>(void*, double*, const T*, const T*, const int32_t*, int64_t, \
                                     const VocabSlice&);                                          \
  template void vocab_ce_finish<T>(void*, double*, T*, T*, const T*, const double*,               \
                                   const int32_t*, int64_t);                                      \
  template void vocab_ce_grad<T>(void*, T*, const int32_t*, const T*, const T*, int64_t,          \
                                 const VocabSlice&);
MOECORE_VOCAB_CE_INSTANTIATE(float)
MOECORE_VOCAB_CE_INSTANTIATE(double)
#undef MOECORE_VOCAB_CE_INSTANTIATE

}  // namespace moecore::ops::cuda
