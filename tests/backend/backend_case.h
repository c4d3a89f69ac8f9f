// The backend test harness (ggml's test-backend-ops): a table of op cases with awkward shapes,
// each run on every backend (the CPU always, CUDA where built and visible) against the plain-loop
// `_ref` oracles. A case fills its inputs from fixed seeds, runs the op on the backend's Exec
// into guarded outputs, runs the reference into separate ones, and compares: index / count
// outputs and exact ops bitwise, floating outputs with the dtype's row of docs/numerics.md.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "core/exec.h"

namespace moecore::backend_test {

using testing::Guarded;
using testing::random_vec;

// One backend the table runs on. `available` false: every case on it is reported as not run,
// with `why`.
struct Backend {
  std::string name;  // "cpu", "cuda": the prefix of the test names
  bool available = false;
  std::string why;
  Exec ex;
};
// The CPU, then CUDA (available when this is a CUDA build and a device is visible).
const std::vector<Backend>& backends();

// One row of the table. `ops` names the op functions (src/ops/*.h, taking `const Exec&`) that
// `run` calls on the backend: the coverage test checks their union against the headers.
struct OpCase {
  std::string name;  // [a-z0-9_]: the test name after the backend's
  std::vector<std::string> ops;
  std::function<void(const Exec&)> run;
};
const std::vector<OpCase>& op_cases();

// The table, one function per family of ops (cases_*.cpp).
void add_gemm_cases(std::vector<OpCase>& out);
void add_gemm_bf16_cases(std::vector<OpCase>& out);
void add_moe_cases(std::vector<OpCase>& out);
void add_elementwise_cases(std::vector<OpCase>& out);
void add_dropout_cases(std::vector<OpCase>& out);  // cases_dropout.cpp
void add_model_cases(std::vector<OpCase>& out);
void add_router_cases(std::vector<OpCase>& out);          // cases_router.cpp
void add_router_balance_cases(std::vector<OpCase>& out);  // cases_router_balance.cpp
void add_step_cases(std::vector<OpCase>& out);            // cases_step.cpp

// The dtype's tolerance (tests/common/tolerances.h): f32 fast vs f32 reference, f64 vs f64.
template <typename T>
struct Tol {
  static constexpr double rtol = std::is_same_v<T, float> ? testing::kF32Rtol : testing::kF64Rtol;
  static constexpr double atol = std::is_same_v<T, float> ? testing::kF32Atol : testing::kF64Atol;
};

template <typename T>
const char* dtype_name() {
  return std::is_same_v<T, float> ? "f32" : "f64";
}

// Guard bytes on both sides of a backend output are intact.
template <typename T>
void expect_intact(const Guarded<T>& g, const std::string& what) {
  EXPECT_TRUE(g.intact()) << what << ": written outside its " << g.size() << " elements";
}

// |got - want| <= atol + rtol |want| element by element (the worst element named), and the
// guards of `got` intact.
template <typename T, typename R>
void expect_close(const Guarded<T>& got, const R* want, const std::string& what,
                  double rtol = Tol<T>::rtol, double atol = Tol<T>::atol) {
  EXPECT_TRUE(testing::all_close(got.data(), want, got.size(), rtol, atol)) << what;
  expect_intact(got, what);
}
template <typename T, typename R>
void expect_close(const Guarded<T>& got, const Guarded<R>& want, const std::string& what,
                  double rtol = Tol<T>::rtol, double atol = Tol<T>::atol) {
  expect_close(got, want.data(), what, rtol, atol);
}

// Bit for bit (NaN payloads and signed zeros included) over n elements; names the first
// element that differs.
template <typename T>
::testing::AssertionResult same_bits(const T* got, const T* want, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(got + i, want + i, sizeof(T)) != 0) {
      auto f = ::testing::AssertionFailure() << "element " << i << " of " << n << " differs: ";
      if constexpr (std::is_arithmetic_v<T>) {
        f << +got[i] << " vs " << +want[i];
      }
      return f;
    }
  }
  return ::testing::AssertionSuccess();
}
template <typename T>
void expect_bitwise(const Guarded<T>& got, const T* want, const std::string& what, int64_t n = -1) {
  EXPECT_TRUE(same_bits(got.data(), want, n < 0 ? got.size() : n)) << what;
  expect_intact(got, what);
}
template <typename T>
void expect_bitwise(const Guarded<T>& got, const Guarded<T>& want, const std::string& what,
                    int64_t n = -1) {
  expect_bitwise(got, want.data(), what, n);
}

// A guarded buffer holding v (n = v.size()).
template <typename T>
Guarded<T> guarded(const std::vector<T>& v) {
  Guarded<T> g(static_cast<int64_t>(v.size()));
  std::copy(v.begin(), v.end(), g.data());
  return g;
}
// A guarded output filled with NaN, so an element the op forgets to assign fails the comparison.
template <typename T>
Guarded<T> nan_out(int64_t n) {
  return Guarded<T>(n, std::numeric_limits<T>::quiet_NaN());
}

// bf16 buffers are guarded as their bits (bf16 has no operator==).
inline bf16* as_bf16(uint16_t* p) {
  return reinterpret_cast<bf16*>(p);
}
inline const bf16* as_bf16(const uint16_t* p) {
  return reinterpret_cast<const bf16*>(p);
}
// A routing map [T, K] with distinct experts per token (as top-k gives); drop > 0 marks that
// fraction of the slots dropped (-1). Seeded, so every backend sees the same map.
std::vector<int32_t> distinct_experts(int64_t T, int64_t K, int64_t E, double drop,
                                      uint32_t seed);
std::vector<bf16> to_bf16(const std::vector<float>& x);        // cast_f32_to_bf16_ref
std::vector<float> bf16_rounded(const std::vector<float>& x);  // round_f32_to_bf16_ref

// The scope of one shape inside a case, for failure messages.
#define BACKEND_TRACE(...) SCOPED_TRACE(::testing::Message() << __VA_ARGS__)

}  // namespace moecore::backend_test
