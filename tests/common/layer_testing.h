// Helpers for layer tests in f64: set up a registry + arena the way the model does, and check
// every parameter gradient against central finite differences.
#pragma once

#include <functional>
#include <string>

#include "core/arena.h"
#include "core/param_registry.h"
#include "testing.h"

namespace moecore::testing {

// Checks each parameter's accumulated gradient (registry must hold the gradient of loss()).
inline ::testing::AssertionResult check_param_gradients(ParamRegistry& params,
                                                        const std::function<double()>& loss,
                                                        int64_t max_checks = 24) {
  for (Param& p : params.params()) {
    auto r = check_gradient(loss, p.data_as<double>(), p.grad_as<double>(), p.local_numel(),
                            p.name(), max_checks);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

// sum_i y[i] * r[i].
inline double weighted_sum(const double* y, const std::vector<double>& r) {
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += y[i] * r[i];
  return s;
}

}  // namespace moecore::testing
