#include <algorithm>

#include "layer_testing.h"
#include "testing.h"

namespace moecore::testing {

::testing::AssertionResult check_gradient(const std::function<double()>& loss, double* x,
                                          const double* grad, int64_t n, const std::string& what,
                                          int64_t max_checks, double h, double rtol,
                                          double atol) {
  if (n == 0) return ::testing::AssertionSuccess();
  int64_t stride = std::max<int64_t>(1, n / max_checks);
  // Odd offset so strided checks do not always land on the same column of a matrix.
  for (int64_t i = (stride > 1 ? stride / 2 : 0); i < n; i += stride) {
    double saved = x[i];
    x[i] = saved + h;
    double lp = loss();
    x[i] = saved - h;
    double lm = loss();
    x[i] = saved;
    double fd = (lp - lm) / (2 * h);
    double tol = atol + rtol * std::max(std::abs(fd), std::abs(grad[i]));
    if (!(std::abs(fd - grad[i]) <= tol)) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: analytic " << grad[i] << " vs finite difference " << fd
             << " (|diff| " << std::abs(fd - grad[i]) << " > " << tol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult check_layer_gradients(ParamRegistry& params,
                                                 const std::function<double()>& loss,
                                                 const std::function<void()>& backward,
                                                 std::initializer_list<InputGrad> inputs,
                                                 int64_t max_checks) {
  loss();
  params.zero_grads();
  backward();
  for (const InputGrad& in : inputs) {
    auto r = check_gradient(loss, in.x, in.dx, in.n, in.name, std::max<int64_t>(max_checks, 64));
    if (!r) return r;
  }
  return check_param_gradients(params, loss, max_checks);
}

}  // namespace moecore::testing
