// Helpers for layer tests in f64: set up a registry + arena the way the model does, and check
// every parameter gradient against central finite differences.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "ops/dropout.h"
#include "testing.h"

namespace moecore::testing {

// n token ids (or targets) drawn uniformly from [0, V).
inline std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids(n);
  for (auto& i : ids) i = static_cast<int32_t>(gen() % V);
  return ids;
}

// Two micro-batches of n tokens, as the pipeline-composition tests feed the whole model and its
// stages: ids and targets from fixed seeds, each micro-batch its own dropout counters.
struct MicroBatches {
  std::vector<std::vector<int32_t>> ids, targets;
  std::vector<ops::DropoutCounters> counters;
};
inline MicroBatches two_micro_batches(int64_t n, int64_t V) {
  MicroBatches m;
  for (uint32_t mb = 0; mb < 2; ++mb) {
    m.ids.push_back(random_ids(n, V, 30 + mb));
    m.targets.push_back(random_ids(n, V, 40 + mb));
    m.counters.push_back(ops::DropoutCounters{1, 2 * static_cast<int64_t>(mb)});
  }
  return m;
}

// Plans the arena for the registry's parameters plus whatever `layer_buffers` allocates, and
// initializes the parameters from `seed`.
template <typename LayerBuffers>
void plan_layer(Arena& arena, ParamRegistry& params, uint64_t seed, LayerBuffers&& layer_buffers) {
  arena.plan([&](Arena& a) {
    params.allocate(a);
    layer_buffers(a);
  });
  params.init(seed);
}

struct InputGrad {
  double* x;
  const double* dx;
  int64_t n;
  const char* name;
};

// Runs loss() once, zeroes the parameter gradients, runs backward(), then checks every listed
// input gradient (strided, at least 64 elements) and every parameter gradient (every row and
// column, at least `min_checks` elements each) against finite differences of loss().
::testing::AssertionResult check_layer_gradients(ParamRegistry& params,
                                                 const std::function<double()>& loss,
                                                 const std::function<void()>& backward,
                                                 std::initializer_list<InputGrad> inputs,
                                                 int64_t min_checks = 24);

// Checks each parameter's accumulated gradient (registry must hold the gradient of loss())
// at every row and every column of each weight matrix (each expert's, for [E, N, K] grouped
// weights), at least `min_checks` elements per parameter (see covering_indices).
inline ::testing::AssertionResult check_param_gradients(ParamRegistry& params,
                                                        const std::function<double()>& loss,
                                                        int64_t min_checks = 24) {
  for (Param& p : params.params()) {
    auto r = check_gradient(loss, p.data_as<double>(), p.grad_as<double>(), p.local_shape(),
                            p.name(), min_checks);
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
