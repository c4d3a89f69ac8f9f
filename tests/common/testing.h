// Test helpers: seeded random fills, buffers with guard bytes, per-tensor closeness checks that
// report the worst element, and fp64 central finite differences.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dev_ptr.h"
#include "tolerances.h"

namespace moecore::testing {

// The message of the moecore::Error that f throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A buffer of a layer or arena as a host pointer: the tests run on the CPU backend, whose
// device memory is the host's (the layers themselves have no such access; core/dev_ptr.h).
template <typename T>
T* host(DevPtr<T> p) {
  return raw_ptr(p);
}
template <typename T>
const T* host(DevPtr<const T> p) {
  return raw_ptr(p);
}

template <typename T>
std::vector<T> random_vec(int64_t n, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(gen));
  return v;
}

// ||a - b|| / ||b|| (b the reference).
inline double rel_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

// A buffer of n elements with canary elements on both sides; intact() tells whether an op
// wrote outside [0, n).
template <typename T>
class Guarded {
 public:
  static constexpr int64_t kGuard = 16;
  explicit Guarded(int64_t n, T fill = T(0)) : n_(n), buf_(n + 2 * kGuard, canary()) {
    for (int64_t i = 0; i < n; ++i) buf_[kGuard + i] = fill;
  }
  T* data() { return buf_.data() + kGuard; }
  const T* data() const { return buf_.data() + kGuard; }
  T& operator[](int64_t i) { return buf_[kGuard + i]; }
  const T& operator[](int64_t i) const { return buf_[kGuard + i]; }
  int64_t size() const { return n_; }
  bool intact() const {
    for (int64_t i = 0; i < kGuard; ++i) {
      if (!same(buf_[i]) || !same(buf_[kGuard + n_ + i])) return false;
    }
    return true;
  }
  std::vector<T> vec() const { return std::vector<T>(data(), data() + n_); }

 private:
  static T canary() {
    if constexpr (std::is_floating_point_v<T>) return static_cast<T>(-12345.678);
    else return static_cast<T>(0x5a5a5a5a);
  }
  static bool same(const T& v) {
    if constexpr (std::is_floating_point_v<T>) return v == canary();
    else return v == canary();
  }
  int64_t n_;
  std::vector<T> buf_;
};

// Sets the OpenMP thread count for a scope, so tests exercise the parallel paths even under
// ctest's OMP_NUM_THREADS=1.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedOmpThreads() { omp_set_num_threads(saved_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

// |a - b| <= atol + rtol * |b| elementwise; on failure names the worst element.
template <typename A, typename B>
::testing::AssertionResult all_close(const A* a, const B* b, int64_t n, double rtol, double atol) {
  double worst = -1;
  int64_t wi = -1;
  for (int64_t i = 0; i < n; ++i) {
    double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    double err = std::abs(x - y) - (atol + rtol * std::abs(y));
    if (!(err <= 0) && (std::isnan(err) || err > worst)) {
      worst = std::isnan(err) ? INFINITY : err;
      wi = i;
    }
  }
  if (wi < 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << wi << " of " << n << ": " << static_cast<double>(a[wi]) << " vs "
         << static_cast<double>(b[wi]) << " (rtol " << rtol << ", atol " << atol << ")";
}

template <typename A, typename B>
::testing::AssertionResult all_close(const std::vector<A>& a, const std::vector<B>& b, double rtol,
                                     double atol) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  }
  return all_close(a.data(), b.data(), static_cast<int64_t>(a.size()), rtol, atol);
}

// Checks analytic gradient `grad[i]` of loss() w.r.t. x[i] against fp64 central differences
// for up to `max_checks` indices spread over [0, n) with a stride. loss() must read x.
// For a matrix use the shape-aware overload: a stride that is a multiple of the row length
// lands on the same column every time.
::testing::AssertionResult check_gradient(const std::function<double()>& loss, DevPtr<double> x_dev,
                                          DevPtr<const double> grad_dev, int64_t n,
                                          const std::string& what, int64_t max_checks = 64,
                                          double h = kFdStep, double rtol = kFdRtol,
                                          double atol = kFdAtol);

// A tensor seen as G groups of R x C row-major matrices: [n] -> [1, 1, n], [R, C] -> [1, R, C],
// [d0, ..., R, C] -> [d0 * ..., R, C] (the grouped expert weights [E, N, K]).
struct GroupedShape {
  int64_t G = 1, R = 1, C = 1;
  int64_t numel() const { return G * R * C; }
};
GroupedShape grouped_shape(const std::vector<int64_t>& shape);

// Flat indices into a [G, R, C] tensor that hit every row and every column of every group:
// per group, with seeded permutations pr of the rows and pc of the columns, the pairs
// (pr[i % R], pc[i % C]) for i < max(R, C) (distinct, since i < max(R, C) <= lcm(R, C)), then
// further distinct elements of the group in seeded random order until it has
// min(R * C, max(max(R, C), per_group)) of them. Deterministic in `seed`.
std::vector<int64_t> covering_indices(const GroupedShape& s, int64_t per_group, uint64_t seed);

// Whether `idx` (flat indices into a [G, R, C] tensor) are distinct, in range, and hit every
// (group, row) and every (group, column); names the first one missed.
::testing::AssertionResult covers_every_row_and_column(const std::vector<int64_t>& idx,
                                                       const GroupedShape& s);

// check_gradient at exactly the given indices.
::testing::AssertionResult check_gradient_at(const std::function<double()>& loss,
                                             DevPtr<double> x_dev, DevPtr<const double> grad_dev,
                                             const std::vector<int64_t>& indices,
                                             const std::string& what, double h = kFdStep,
                                             double rtol = kFdRtol, double atol = kFdAtol);

// check_gradient over covering_indices of `shape`: every row and every column of each matrix
// is checked, at least `min_checks` elements in all (capped at the size), in a permutation
// seeded by `what` (so two tensors of one shape are sampled differently).
::testing::AssertionResult check_gradient(const std::function<double()>& loss, DevPtr<double> x_dev,
                                          DevPtr<const double> grad_dev,
                                          const std::vector<int64_t>& shape,
                                          const std::string& what, int64_t min_checks = 24,
                                          double h = kFdStep, double rtol = kFdRtol,
                                          double atol = kFdAtol);

}  // namespace moecore::testing
