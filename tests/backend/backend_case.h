// The backend test harness (ggml's test-backend-ops): a table of op cases with awkward shapes,
// each run on every backend (the CPU always, CUDA where built and visible) against the plain-loop
// `_ref` oracles. A case fills its inputs from fixed seeds, runs the op on the backend's Exec
// into guarded outputs, runs the reference into separate ones, and compares: index / count
// outputs and exact ops bitwise, floating outputs with the dtype's row of docs/numerics.md.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
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
void add_grouped_gemm_device_cases(std::vector<OpCase>& out);  // cases_grouped_gemm_device.cpp
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

// The backend's own copies of a case's host buffers: device memory on CUDA, the arena's memory on
// the CPU (so both backends run the same staging code). The ops get these, never the host
// buffers (on a GPU a host pointer is an illegal address; the emulated CUDA build refuses one,
// tests/emu/device_memory_emu.h). One Staging per op call or sequence of calls:
//   Staging st(ex);
//   ops::swiglu_forward<T>(ex, st.out(a), st.in(h), st.in_or_null(pp, N), N, F);
//   st.back();  // every out() buffer, guards included, copied back into its Guarded
// A host buffer staged twice (by in() or out(), keyed by its address) gives the same backend
// buffer, so an output fed to the next op, an in-place op and aliased arguments keep their
// meaning. out() copies the Guarded's current contents (the NaN fill, an accumulator's start)
// and its guards; back() returns both, so a write past either end shows in Guarded::intact().
class Staging {
 public:
  explicit Staging(const Exec& ex) : ex_(ex) {}
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  template <typename T>
  const T* in(const T* host, int64_t n) {
    return static_cast<const T*>(stage(host, n * int64_t(sizeof(T)), nullptr));
  }
  template <typename T>
  const T* in(const std::vector<T>& v) {
    return in(v.data(), int64_t(v.size()));
  }
  template <typename T>
  const T* in(const Guarded<T>& g) {
    return in(g.data(), g.size());
  }
  // nullptr for nullptr (an optional argument).
  template <typename T>
  const T* in_or_null(const T* host, int64_t n) {
    return host == nullptr ? nullptr : in(host, n);
  }
  // A buffer the op writes: copied in now (guards included), back into g by back().
  template <typename T>
  T* out(Guarded<T>& g) {
    constexpr int64_t kG = Guarded<T>::kGuard;
    auto* dev = static_cast<T*>(
        stage(g.data() - kG, (g.size() + 2 * kG) * int64_t(sizeof(T)), g.data() - kG));
    return dev + kG;
  }
  // A plain host buffer the op writes, without guards: for the structs a Guarded cannot hold
  // (a MicroBatchReport, an AdamWStep). Numbers go in a Guarded, whose guards catch a stray write.
  template <typename T>
  T* out(T* host, int64_t n) {
    static_assert(!std::is_arithmetic_v<T>, "stage numbers as a Guarded (out(Guarded<T>&))");
    return static_cast<T*>(stage(host, n * int64_t(sizeof(T)), host));
  }
  template <typename T>
  T* out_or_null(Guarded<T>* g) {
    return g == nullptr ? nullptr : out(*g);
  }
  // Waits for the backend and copies every out() buffer back to its host buffer.
  void back();

 private:
  struct Buffer {
    const void* host;
    void* writeback;  // the host buffer back() fills, or null for an input
    void* dev;
    int64_t bytes;
  };
  // The backend buffer of [host, host + bytes): an existing one when host is already staged
  // (an input later written as an output gains the write-back; a stage inside an existing
  // buffer, e.g. a Guarded's data after its guards, is that buffer's interior).
  void* stage(const void* host, int64_t bytes, void* writeback);

  const Exec& ex_;
  std::vector<Buffer> buffers_;
};

// The grouped GEMMs' device-table memory for up to G groups (ops/gemm.h, GroupedGemmWorkspace)
// as a case stages it: guarded (a write past it shows), empty where the backend's path needs none.
// Declared here, defined in cases_grouped_gemm_device.cpp.
struct StagedGroupedWorkspace {
  Guarded<uint8_t> buf;
  std::byte* data = nullptr;
  int64_t bytes = 0;
  StagedGroupedWorkspace(const Exec& ex, Staging& st, int64_t G);
};

// The outputs digest of the running case: every buffer Staging::back() returns, folded in order
// (FNV-1a over its bytes, guards included). Run to run on one backend a case must give the same
// digest; the harness prints it after each case (`[outputs] <case> <digest>`), which the GPU
// check compares between two runs (scripts/gpu_check.sh, stage 1).
uint64_t outputs_digest();
void reset_outputs_digest();

// The scope of one shape inside a case, for failure messages.
#define BACKEND_TRACE(...) SCOPED_TRACE(::testing::Message() << __VA_ARGS__)

}  // namespace moecore::backend_test
