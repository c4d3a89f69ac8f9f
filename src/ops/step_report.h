// The step report's ops. A training step's results (each micro-batch's loss, counted tokens,
// aux and z values, dropped slots, tokens per expert) are written by the step's ops into
// planned memory, never returned to the host mid-step; the host reads the report once, after
// the step. The loss gradient's per-micro-batch scale (1 / counted tokens) is computed from the
// counted tokens in that memory, not passed by value.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// The multi-token prediction depths a report slot has room for (--mtp-num-layers at most).
inline constexpr int kMaxMtpDepths = 8;

// One micro-batch's slot of the step report (plain data: the host zeroes nothing, the forward
// clears it with ops::zero).
struct MicroBatchReport {
  double lm_loss_sum = 0;  // sum of the cross entropy over the counted tokens
  int64_t counted = 0;     // tokens whose target counts (>= 0)
  double aux_value = 0;    // sum over MoE layers of the first listed aux type's value
  double z_value = 0;      // sum over MoE layers of mean_t lse_t^2
  int64_t dropped = 0;     // (token, slot) pairs dropped by capacity, summed over MoE layers
  int64_t moe_layers = 0;  // MoE layers that reported
  // Multi-token prediction, per depth k = 1..D at [k - 1]: the sum of the cross entropy of the
  // token k + 1 positions ahead over its counted positions, and their count (the targets rolled
  // by k that count).
  double mtp_loss_sum[kMaxMtpDepths] = {};
  int64_t mtp_counted[kMaxMtpDepths] = {};
};

// Depth j's fields of a slot (address arithmetic, nothing is read: member_ptr's for an array).
inline DevPtr<double> mtp_loss_sum_ptr(DevPtr<MicroBatchReport> r, int64_t j) {
  return DevPtr<double>(&raw_ptr(r)->mtp_loss_sum[j]);
}
inline DevPtr<int64_t> mtp_counted_ptr(DevPtr<MicroBatchReport> r, int64_t j) {
  return DevPtr<int64_t>(&raw_ptr(r)->mtp_counted[j]);
}

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void loss_grad_scale(T* dloss, const int64_t* counted, double scale);
void report_moe_layer(MicroBatchReport* r, int64_t* tokens_E, const double* aux_value,
                      const double* z_value, const int64_t* dropped, const int64_t* layer_tokens_E,
                      int64_t E);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. One writer per output element: bitwise the references.
namespace cuda {
template <typename T>
void loss_grad_scale(void* stream, T* dloss, const int64_t* counted, double scale);
void report_moe_layer(void* stream, MicroBatchReport* r, int64_t* tokens_E,
                      const double* aux_value, const double* z_value, const int64_t* dropped,
                      const int64_t* layer_tokens_E, int64_t E);
}  // namespace cuda

// *dloss = T(scale / *counted), 0 when nothing counts: d(loss)/d(each token's CE) of the mean
// cross entropy, times the step's gradient scale.
template <typename T>
void loss_grad_scale(const Exec& ex, DevPtr<T> dloss, DevPtr<const int64_t> counted, double scale) {
  if (ex.on_cpu()) return cpu::loss_grad_scale(raw_ptr(dloss), raw_ptr(counted), scale);
  return cuda::loss_grad_scale(ex.stream, raw_ptr(dloss), raw_ptr(counted), scale);
}
template <typename T>
void loss_grad_scale_ref(T* dloss, const int64_t* counted, double scale);

// One MoE layer's routing results added into its micro-batch's report: aux_value (null: the
// layer lists no aux type) and z_value, dropped, tokens per expert [E], and one more layer.
inline void report_moe_layer(const Exec& ex, DevPtr<MicroBatchReport> r, DevPtr<int64_t> tokens_E,
                             DevPtr<const double> aux_value, DevPtr<const double> z_value,
                             DevPtr<const int64_t> dropped, DevPtr<const int64_t> layer_tokens_E,
                             int64_t E) {
  if (ex.on_cpu())
    return cpu::report_moe_layer(raw_ptr(r), raw_ptr(tokens_E), raw_ptr(aux_value),
                                 raw_ptr(z_value), raw_ptr(dropped), raw_ptr(layer_tokens_E), E);
  return cuda::report_moe_layer(ex.stream, raw_ptr(r), raw_ptr(tokens_E), raw_ptr(aux_value),
                                raw_ptr(z_value), raw_ptr(dropped), raw_ptr(layer_tokens_E), E);
}
void report_moe_layer_ref(MicroBatchReport* r, int64_t* tokens_E, const double* aux_value,
                          const double* z_value, const int64_t* dropped,
                          const int64_t* layer_tokens_E, int64_t E);

}  // namespace moecore::ops
