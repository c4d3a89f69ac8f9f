// Output head fused with cross entropy, chunked over tokens: logits = h W^T exist only for
// `chunk` tokens at a time ([chunk, V] workspace), never for the whole batch. The forward
// saves the log-sum-exp per token; the backward recomputes each chunk's logits.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

#include "core/dtype.h"

namespace moecore::ops {

struct HeadLossShape {
  int64_t n_tok = 0, H = 0, V = 0, chunk = 256;
};

int64_t head_loss_workspace_elems(const HeadLossShape& s);

// --bf16: the head GEMMs take bf16 inputs and accumulate in f32; softmax and losses stay f32.
// f32 models only. Two forms of the same contract:
//   bf16 operands (w_VH: the bf16 copy of W; h16 [n_tok, H] and dz16 [chunk, V] workspace;
//     ws32 of head_loss_bf16_workspace_elems for the widen GEMM path, none on the native one);
//   widened operands (w_VH_wide set: W's bf16 values in f32, Param::data16w): h's bf16 values
//     go to h32 [n_tok, H], the dlogits are rounded to bf16 values in place in the workspace,
//     and the GEMMs are f32 GEMMs (h16, dz16, ws32 unused). Bitwise the widen path's results
//     without its widening passes.
// The forward writes h's bf16 form (h16 or h32); the backward reads it as the forward left it
// (like lse_T), so nothing may overwrite it in between.
struct HeadLossBf16 {
  DevPtr<const bf16> w_VH = nullptr;
  DevPtr<bf16> h16 = nullptr;
  DevPtr<bf16> dz16 = nullptr;
  DevPtr<float> ws32 = nullptr;
  DevPtr<const float> w_VH_wide = nullptr;
  DevPtr<float> h32 = nullptr;
};
// ws32 of the bf16-operand form (0 on the native GEMM path).
int64_t head_loss_bf16_workspace_elems(const Exec& ex, const HeadLossShape& s);

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
double head_loss_forward(T* loss_T, T* lse_T, const T* h_TH, const T* w_VH, const int32_t* target_T,
                         const HeadLossShape& s, T* workspace, const HeadLossBf16* bf16 = nullptr);
template <typename T>
void head_loss_backward(T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH, const int32_t* target_T,
                        const T* lse_T, T dloss, const HeadLossShape& s, T* workspace,
                        const HeadLossBf16* bf16 = nullptr);
}  // namespace cpu
// The CUDA paths (ops/cuda/head_loss.cu): the same chunks, the GEMMs through cuBLASLt
// (ops/cuda/gemm.cu; the bf16 forms on the native path, so ws32 is unused), a block per row for
// the log-sum-exp (f64 sums in a fixed tree) or the dlogits, *sum a fixed tree over loss_T in f64
// (independent of the chunk size; not the CPU's serial order, so within f64 rounding of it), dloss
// read on the device. Targets are not checked on the host there (a host sync): a target >= V gives
// NaN loss and gradients.
namespace cuda {
template <typename T>
void head_loss_forward(const Exec& ex, double* sum, T* loss_T, T* lse_T, const T* h_TH,
                       const T* w_VH, const int32_t* target_T, const HeadLossShape& s, T* workspace,
                       const HeadLossBf16* bf16);
template <typename T>
void head_loss_backward(const Exec& ex, T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH,
                        const int32_t* target_T, const T* lse_T, const T* dloss,
                        const HeadLossShape& s, T* workspace, const HeadLossBf16* bf16);
}  // namespace cuda

// loss_T[t] = lse_t - logit_t[target_t]; *sum = the sum over tokens (in f64, in memory: the step
// report's slot, read on the host after the step). Targets < 0 are ignored (loss 0, no
// gradient).
template <typename T>
void head_loss_forward(const Exec& ex, DevPtr<double> sum, DevPtr<T> loss_T, DevPtr<T> lse_T,
                       DevPtr<const T> h_TH, DevPtr<const T> w_VH, DevPtr<const int32_t> target_T,
                       const HeadLossShape& s, DevPtr<T> workspace,
                       const HeadLossBf16* bf16 = nullptr) {
  if (ex.on_cpu()) {
    *raw_ptr(sum) =
        cpu::head_loss_forward(raw_ptr(loss_T), raw_ptr(lse_T), raw_ptr(h_TH), raw_ptr(w_VH),
                               raw_ptr(target_T), s, raw_ptr(workspace), bf16);
    return;
  }
  return cuda::head_loss_forward(ex, raw_ptr(sum), raw_ptr(loss_T), raw_ptr(lse_T), raw_ptr(h_TH),
                                 raw_ptr(w_VH), raw_ptr(target_T), s, raw_ptr(workspace), bf16);
}
template <typename T>
double head_loss_forward_ref(T* loss_T, T* lse_T, const T* h_TH, const T* w_VH,
                             const int32_t* target_T, const HeadLossShape& s);
// With d(total loss)/d(loss_T[t]) = *dloss for every token (read from memory: the step's
// scale, ops::loss_grad_scale): dh (assigned) and dw (accumulated) of the head + cross entropy.
template <typename T>
void head_loss_backward(const Exec& ex, DevPtr<T> dh_TH, DevPtr<T> dw_VH, DevPtr<const T> h_TH,
                        DevPtr<const T> w_VH, DevPtr<const int32_t> target_T, DevPtr<const T> lse_T,
                        DevPtr<const T> dloss, const HeadLossShape& s, DevPtr<T> workspace,
                        const HeadLossBf16* bf16 = nullptr) {
  if (ex.on_cpu())
    return cpu::head_loss_backward(raw_ptr(dh_TH), raw_ptr(dw_VH), raw_ptr(h_TH), raw_ptr(w_VH),
                                   raw_ptr(target_T), raw_ptr(lse_T), *raw_ptr(dloss), s,
                                   raw_ptr(workspace), bf16);
  return cuda::head_loss_backward(ex, raw_ptr(dh_TH), raw_ptr(dw_VH), raw_ptr(h_TH),
                                  raw_ptr(w_VH), raw_ptr(target_T), raw_ptr(lse_T),
                                  raw_ptr(dloss), s, raw_ptr(workspace), bf16);
}
template <typename T>
void head_loss_backward_ref(T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH,
                            const int32_t* target_T, const T* lse_T, T dloss,
                            const HeadLossShape& s);

}  // namespace moecore::ops
