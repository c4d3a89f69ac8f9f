// The row pieces of the vocab-parallel cross entropy (Megatron's vocab_parallel_cross_entropy):
// each TP rank holds the logits of its vocabulary slice [v0, v0 + Vl) of a chunk of m tokens,
// z_MV [m, Vl], never the whole vocabulary. Per token the caller combines the pieces over the
// TP group between them (the collectives are not ops):
//   vocab_ce_row_max -> all-reduce max -> vocab_ce_row_sums -> all-reduce sum
//   -> vocab_ce_finish (log-sum-exp, loss, the report's sum)
// and in the backward vocab_ce_grad turns the local logits into the local columns of
// (softmax - onehot) * dloss with the global log-sum-exp. With the whole vocabulary on one rank
// (v0 = 0, Vl = V) the pieces are the fused head's softmax rows (ops/cross_entropy.h), which
// the model keeps using there.
// A slice may be empty (Vl = 0): a TP rank whose share of the padded vocabulary holds padding
// only (the padding is not part of the model, so no logit of it exists). Its row maxima are -inf
// and its sums 0, the identities of the all-reduces, and its gradient rows have no element.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// This rank's columns [v0, v0 + Vl) of a vocabulary of V (the target check's bound): the
// model's columns of its share of the padded vocabulary, none (Vl = 0, v0 anywhere) for a share
// of padding only.
struct VocabSlice {
  int64_t v0 = 0, Vl = 0, V = 0;
  // Throws naming the three numbers unless 0 <= v0, 0 <= Vl and (Vl = 0 or v0 + Vl <= V), V >= 1
  // (defined in
  // ops/cpu/vocab_parallel_ce_ref.cpp: this header is also compiled by nvcc, which cannot
  // build core/check.h's fmt format strings).
  void check() const;
};

namespace cpu {  // the CPU fast paths (ops/cpu/vocab_parallel_ce.cpp)
template <typename T>
void vocab_ce_row_max(T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs);
template <typename T>
void vocab_ce_row_sums(double* sums_2M, const T* z_MV, const T* max_M, const int32_t* target_M,
                       int64_t m, const VocabSlice& vs);
template <typename T>
void vocab_ce_finish(double* sum, T* loss_M, T* lse_M, const T* max_M, const double* sums_2M,
                     const int32_t* target_M, int64_t m);
template <typename T>
void vocab_ce_grad(T* z_MV, const int32_t* target_M, const T* lse_M, T dloss, int64_t m,
                   const VocabSlice& vs);
}  // namespace cpu
// The CUDA kernels (ops/cuda/vocab_parallel_ce.cu); `stream` is the context's. The maxima, the
// target logits and the finish are the CPU's bits (exact, or the same formula and the same serial
// row-order sum); the exp sums and the gradient are within the dtype's tolerance. A target >= V
// cannot throw inside a step on a device: its target logit (so its loss) is NaN instead.
namespace cuda {
template <typename T>
void vocab_ce_row_max(void* stream, T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs);
template <typename T>
void vocab_ce_row_sums(void* stream, double* sums_2M, const T* z_MV, const T* max_M,
                       const int32_t* target_M, int64_t m, const VocabSlice& vs);
template <typename T>
void vocab_ce_finish(void* stream, double* sum, T* loss_M, T* lse_M, const T* max_M,
                     const double* sums_2M, const int32_t* target_M, int64_t m);
template <typename T>
void vocab_ce_grad(void* stream, T* z_MV, const int32_t* target_M, const T* lse_M, const T* dloss,
                   int64_t m, const VocabSlice& vs);
}  // namespace cuda

// max_M[i] = max over this rank's columns of z_MV[i] (to be all-reduced with max); -inf for an
// empty slice.
template <typename T>
void vocab_ce_row_max(const Exec& ex, DevPtr<T> max_M, DevPtr<const T> z_MV, int64_t m,
                      const VocabSlice& vs) {
  if (ex.on_cpu()) return cpu::vocab_ce_row_max(raw_ptr(max_M), raw_ptr(z_MV), m, vs);
  return cuda::vocab_ce_row_max(ex.stream, raw_ptr(max_M), raw_ptr(z_MV), m, vs);
}
template <typename T>
void vocab_ce_row_max_ref(T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs);

// With max_M the global row maxima: sums_2M[i] = sum over this rank's columns of
// exp(z - max_i) (f64; 0 for an empty slice), sums_2M[m + i] = the target's logit when this
// rank holds it, else 0 (ignored targets, < 0: 0). Both halves are all-reduced with sum, in one
// call. Targets >= V are refused.
template <typename T>
void vocab_ce_row_sums(const Exec& ex, DevPtr<double> sums_2M, DevPtr<const T> z_MV,
                       DevPtr<const T> max_M, DevPtr<const int32_t> target_M, int64_t m,
                       const VocabSlice& vs) {
  if (ex.on_cpu())
    return cpu::vocab_ce_row_sums(raw_ptr(sums_2M), raw_ptr(z_MV), raw_ptr(max_M),
                                  raw_ptr(target_M), m, vs);
  return cuda::vocab_ce_row_sums(ex.stream, raw_ptr(sums_2M), raw_ptr(z_MV), raw_ptr(max_M),
                                 raw_ptr(target_M), m, vs);
}
template <typename T>
void vocab_ce_row_sums_ref(double* sums_2M, const T* z_MV, const T* max_M, const int32_t* target_M,
                           int64_t m, const VocabSlice& vs);

// From the reduced values: lse_M = max + log(sum exp), loss_M = lse - target logit (0 for
// ignored targets), and *sum += the losses in row order (a chunk's rows after the previous
// chunk's: the serial token-order sum of the fused head).
template <typename T>
void vocab_ce_finish(const Exec& ex, DevPtr<double> sum, DevPtr<T> loss_M, DevPtr<T> lse_M,
                     DevPtr<const T> max_M, DevPtr<const double> sums_2M,
                     DevPtr<const int32_t> target_M, int64_t m) {
  if (ex.on_cpu())
    return cpu::vocab_ce_finish(raw_ptr(sum), raw_ptr(loss_M), raw_ptr(lse_M), raw_ptr(max_M),
                                raw_ptr(sums_2M), raw_ptr(target_M), m);
  return cuda::vocab_ce_finish(ex.stream, raw_ptr(sum), raw_ptr(loss_M), raw_ptr(lse_M),
                               raw_ptr(max_M), raw_ptr(sums_2M), raw_ptr(target_M), m);
}
template <typename T>
void vocab_ce_finish_ref(double* sum, T* loss_M, T* lse_M, const T* max_M, const double* sums_2M,
                         const int32_t* target_M, int64_t m);

// The backward's rows, in place: z_MV (this rank's logits) -> (exp(z - lse) - [v0 + j ==
// target]) * dloss on this rank's columns; ignored tokens' rows are zeros. dloss is read from
// memory (ops::loss_grad_scale's).
template <typename T>
void vocab_ce_grad(const Exec& ex, DevPtr<T> z_MV, DevPtr<const int32_t> target_M,
                   DevPtr<const T> lse_M, DevPtr<const T> dloss, int64_t m, const VocabSlice& vs) {
  if (ex.on_cpu())
    return cpu::vocab_ce_grad(raw_ptr(z_MV), raw_ptr(target_M), raw_ptr(lse_M), *raw_ptr(dloss), m,
                              vs);
  return cuda::vocab_ce_grad(ex.stream, raw_ptr(z_MV), raw_ptr(target_M), raw_ptr(lse_M),
                             raw_ptr(dloss), m, vs);
}
template <typename T>
void vocab_ce_grad_ref(T* z_MV, const int32_t* target_M, const T* lse_M, T dloss, int64_t m,
                       const VocabSlice& vs);

}  // namespace moecore::ops
