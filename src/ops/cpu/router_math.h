// Scalar functions shared by the router ops' fast paths and references (ops/cpu/router_*.cpp):
// one definition, so that both round the same way.
#pragma once

#include <cmath>

#include "ops/router_scores.h"

namespace moecore::ops::router_math {

inline double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
// log(1 + e^x) without overflow.
inline double softplus(double x) {
  return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}
// The elementwise score functions.
inline double score(ScoreFn f, double logit) {
  return f == ScoreFn::Sigmoid ? sigmoid(logit) : std::sqrt(softplus(logit));
}
// d score / d logit for the elementwise score functions, from the logit and the score.
inline double dscore_dlogit(ScoreFn f, double logit, double score) {
  if (f == ScoreFn::Sigmoid) return score * (1.0 - score);
  return sigmoid(logit) / (2.0 * score);  // d sqrt(softplus(l)) / dl
}

}  // namespace moecore::ops::router_math
