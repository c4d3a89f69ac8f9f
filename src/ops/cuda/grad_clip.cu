// The global gradient norm and the clip coefficient on the GPU: one thread adds the few sums of
// squares in list order (the CPU's order: 0 + s0 + s1 + ...), takes the IEEE square root and
// writes the coefficient and the skip flag into the step's scalars on the device, so the update
// reads them without a host round trip. The same double arithmetic as the CPU's: bitwise.
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/grad_clip.h"

namespace moecore::ops::cuda {

namespace kernels {
__global__ void grad_clip(double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
                          double max_norm) {
  double s = 0.0;
  for (int64_t i = 0; i < n_parts; ++i) s += sum_sq[i];
  const double nrm = std::sqrt(s);
  *norm = nrm;
  const int32_t skip = std::isfinite(nrm) ? 0 : 1;
  step->skip = skip;
  double c = 1.0;
  if (!skip && max_norm > 0) {
    const double q = max_norm / (nrm + 1e-6);
    if (q < 1.0) c = q;
  }
  step->grad_scale = c;
}
}  // namespace kernels

void grad_clip(void* stream, double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
               double max_norm) {
  MOE_KERNEL_CHECK(n_parts >= 0 && max_norm >= 0,
                   "[grad_clip] n_parts=" + std::to_string(n_parts) +
                       " max_norm=" + std::to_string(max_norm) + " (both >= 0: fix --clip-grad)");
  launch("grad_clip", kernels::grad_clip, dim3(1), dim3(1), 0, stream, norm, step, sum_sq, n_parts,
         max_norm);
}

}  // namespace moecore::ops::cuda
