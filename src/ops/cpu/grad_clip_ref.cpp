// Plain reference of the clip coefficient (ops/grad_clip.h), straight from the formula.
#include <algorithm>
#include <cmath>

#include "ops/grad_clip.h"

namespace moecore::ops {

void grad_clip_ref(double* norm, AdamWStep* step, const double* sum_sq, int64_t n_parts,
                   double max_norm) {
  double s = 0.0;
  for (int64_t i = 0; i < n_parts; ++i) s = s + sum_sq[i];
  *norm = std::sqrt(s);
  const bool finite = std::isfinite(*norm);
  step->skip = finite ? 0 : 1;
  step->grad_scale = finite && max_norm > 0 ? std::min(1.0, max_norm / (*norm + 1e-6)) : 1.0;
}

}  // namespace moecore::ops
