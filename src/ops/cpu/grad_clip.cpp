// The clip coefficient on the CPU backend: a handful of scalar operations.
#include <cmath>

#include "core/check.h"
#include "ops/grad_clip.h"

namespace moecore::ops::cpu {

void grad_clip(double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
               double max_norm) {
  MOE_CHECK(n_parts >= 0 && max_norm >= 0, "[grad_clip] n_parts={} max_norm={}", n_parts, max_norm);
  double s = 0.0;
  for (int64_t i = 0; i < n_parts; ++i) s += sum_sq[i];
  const double nrm = std::sqrt(s);
  *norm = nrm;
  step->skip = std::isfinite(nrm) ? 0 : 1;
  double c = 1.0;
  if (!step->skip && max_norm > 0) {
    const double q = max_norm / (nrm + 1e-6);
    if (q < 1.0) c = q;
  }
  step->grad_scale = c;
}

}  // namespace moecore::ops::cpu
