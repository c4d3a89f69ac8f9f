#include <algorithm>
#include <numeric>
#include <random>

#include "layer_testing.h"
#include "testing.h"

namespace moecore::testing {

namespace {

// FNV-1a: a seed from a tensor's name that is the same on every platform (std::hash is not).
uint64_t name_seed(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

::testing::AssertionResult check_gradient_at(const std::function<double()>& loss,
                                             DevPtr<double> x_dev, DevPtr<const double> grad_dev,
                                             const std::vector<int64_t>& indices,
                                             const std::string& what, double h, double rtol,
                                             double atol) {
  double* x = host(x_dev);
  const double* grad = host(grad_dev);
  for (int64_t i : indices) {
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

::testing::AssertionResult check_gradient(const std::function<double()>& loss, DevPtr<double> x_dev,
                                          DevPtr<const double> grad_dev, int64_t n,
                                          const std::string& what, int64_t max_checks, double h,
                                          double rtol, double atol) {
  double* x = host(x_dev);
  const double* grad = host(grad_dev);
  if (n == 0) return ::testing::AssertionSuccess();
  int64_t stride = std::max<int64_t>(1, n / max_checks);
  std::vector<int64_t> idx;
  // Odd offset so strided checks do not always land on the same column of a matrix.
  for (int64_t i = (stride > 1 ? stride / 2 : 0); i < n; i += stride) idx.push_back(i);
  return check_gradient_at(loss, x, grad, idx, what, h, rtol, atol);
}

GroupedShape grouped_shape(const std::vector<int64_t>& shape) {
  GroupedShape s;
  const size_t d = shape.size();
  if (d >= 1) s.C = shape[d - 1];
  if (d >= 2) s.R = shape[d - 2];
  for (size_t i = 0; i + 2 < d; ++i) s.G *= shape[i];
  return s;
}

std::vector<int64_t> covering_indices(const GroupedShape& s, int64_t per_group, uint64_t seed) {
  std::vector<int64_t> idx;
  if (s.numel() == 0) return idx;
  const int64_t RC = s.R * s.C;
  const int64_t cover = std::max(s.R, s.C);
  const int64_t want = std::min(RC, std::max(cover, per_group));
  std::mt19937_64 gen(seed);
  std::vector<int64_t> pr(s.R), pc(s.C), rest;
  std::vector<char> used(RC);
  for (int64_t g = 0; g < s.G; ++g) {
    std::iota(pr.begin(), pr.end(), 0);
    std::iota(pc.begin(), pc.end(), 0);
    std::shuffle(pr.begin(), pr.end(), gen);
    std::shuffle(pc.begin(), pc.end(), gen);
    std::fill(used.begin(), used.end(), 0);
    for (int64_t i = 0; i < cover; ++i) {
      int64_t e = pr[i % s.R] * s.C + pc[i % s.C];
      used[e] = 1;
      idx.push_back(g * RC + e);
    }
    if (want > cover) {
      rest.clear();
      for (int64_t e = 0; e < RC; ++e) {
        if (!used[e]) rest.push_back(e);
      }
      std::shuffle(rest.begin(), rest.end(), gen);
      for (int64_t i = 0; i < want - cover; ++i) idx.push_back(g * RC + rest[i]);
    }
  }
  return idx;
}

::testing::AssertionResult covers_every_row_and_column(const std::vector<int64_t>& idx,
                                                       const GroupedShape& s) {
  std::vector<char> seen(s.numel(), 0), row(s.G * s.R, 0), col(s.G * s.C, 0);
  for (int64_t i : idx) {
    if (i < 0 || i >= s.numel()) {
      return ::testing::AssertionFailure() << "index " << i << " outside [0, " << s.numel() << ")";
    }
    if (seen[i]) return ::testing::AssertionFailure() << "index " << i << " repeated";
    seen[i] = 1;
    const int64_t g = i / (s.R * s.C), r = i / s.C % s.R, c = i % s.C;
    row[g * s.R + r] = 1;
    col[g * s.C + c] = 1;
  }
  for (int64_t g = 0; g < s.G; ++g) {
    for (int64_t r = 0; r < s.R; ++r) {
      if (!row[g * s.R + r]) {
        return ::testing::AssertionFailure() << "group " << g << " row " << r << " never hit";
      }
    }
    for (int64_t c = 0; c < s.C; ++c) {
      if (!col[g * s.C + c]) {
        return ::testing::AssertionFailure() << "group " << g << " column " << c << " never hit";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult check_gradient(const std::function<double()>& loss, DevPtr<double> x_dev,
                                          DevPtr<const double> grad_dev,
                                          const std::vector<int64_t>& shape,
                                          const std::string& what, int64_t min_checks, double h,
                                          double rtol, double atol) {
  double* x = host(x_dev);
  const double* grad = host(grad_dev);
  const GroupedShape s = grouped_shape(shape);
  const int64_t per_group = (min_checks + s.G - 1) / s.G;
  return check_gradient_at(loss, x, grad, covering_indices(s, per_group, name_seed(what)), what,
                           h, rtol, atol);
}

::testing::AssertionResult check_layer_gradients(ParamRegistry& params,
                                                 const std::function<double()>& loss,
                                                 const std::function<void()>& backward,
                                                 std::initializer_list<InputGrad> inputs,
                                                 int64_t min_checks) {
  loss();
  params.zero_grads();
  backward();
  for (const InputGrad& in : inputs) {
    auto r = check_gradient(loss, in.x, in.dx, in.n, in.name, std::max<int64_t>(min_checks, 64));
    if (!r) return r;
  }
  return check_param_gradients(params, loss, min_checks);
}

}  // namespace moecore::testing
