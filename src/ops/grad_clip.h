// The global gradient norm and Megatron's clip coefficient (clip_grad_norm), computed where the
// sums of squares are, so the update takes its coefficient without a host round trip:
//   norm = sqrt(0 + sum_sq[0] + ... + sum_sq[n - 1])   (added in that order)
//   coeff = max_norm / (norm + 1e-6) when max_norm > 0 and that is below 1, else 1.
// A non-finite norm sets step->skip = 1 (ops::adamw_step then leaves every weight and moment as
// it is) and coeff = 1; the host finds it in the step's results, after the step.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/adamw.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void grad_clip(double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
               double max_norm);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. One thread, the CPU's double arithmetic in the same order: bitwise.
namespace cuda {
void grad_clip(void* stream, double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
               double max_norm);
}  // namespace cuda

// norm: one double (the norm before clipping); step: its grad_scale and skip are written.
inline void grad_clip(const Exec& ex, DevPtr<double> norm, DevPtr<AdamWStep> step,
                      DevPtr<const double> sum_sq, int64_t n_parts, double max_norm) {
  if (ex.on_cpu())
    return cpu::grad_clip(raw_ptr(norm), raw_ptr(step), raw_ptr(sum_sq), n_parts, max_norm);
  return cuda::grad_clip(ex.stream, raw_ptr(norm), raw_ptr(step), raw_ptr(sum_sq), n_parts,
                         max_norm);
}
void grad_clip_ref(double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
                   double max_norm);

}  // namespace moecore::ops
