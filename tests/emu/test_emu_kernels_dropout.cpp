// The dropout kernels (src/ops/cuda/dropout.cu) in the grid emulator against their `_ref`
// oracles, bitwise (the keep bits are ops::dropout_words, shared with the CPU; x * factor and the
// explicit fma round once): p = 0, 0.1 and 0.5, counters past 2^32 (taken mod 2^32), rows whose
// width is not a multiple of the 4-column Philox block, a split sequence (s0 > 0), NaN-poisoned
// guarded outputs, in place, in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/dropout.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

enum class Form { Forward, Add, Backward };

template <typename T>
void check_dropout(Form form, double p, int64_t S, int64_t B, int64_t C, int64_t s0) {
  SCOPED_TRACE("form=" + std::to_string(int(form)) + " p=" + std::to_string(p) +
               " S=" + std::to_string(S) + " B=" + std::to_string(B) + " C=" + std::to_string(C) +
               " s0=" + std::to_string(s0));
  const int64_t n = S * B * C;
  const uint64_t key = 0x0123456789abcdefull;
  const ops::DropoutCounters counters{(int64_t(1) << 32) + 7, 3};
  const std::vector<T> x = random_vec<T>(n, 61);
  const std::vector<T> r = random_vec<T>(n, 62);
  std::vector<T> want(static_cast<size_t>(n));
  const auto run_ref = [&](T* y) {
    if (form == Form::Forward)
      ops::dropout_forward_ref(y, x.data(), p, key, &counters, S, B, C, s0);
    if (form == Form::Add)
      ops::dropout_add_forward_ref(y, r.data(), x.data(), p, key, &counters, S, B, C, s0);
    if (form == Form::Backward)
      ops::dropout_backward_ref(y, x.data(), p, key, &counters, S, B, C, s0);
  };
  const auto run = [&](T* y, const T* in, const T* res) {
    if (form == Form::Forward)
      ops::cuda::dropout_forward(nullptr, y, in, p, key, &counters, S, B, C, s0);
    if (form == Form::Add)
      ops::cuda::dropout_add_forward(nullptr, y, res, in, p, key, &counters, S, B, C, s0);
    if (form == Form::Backward)
      ops::cuda::dropout_backward(nullptr, y, in, p, key, &counters, S, B, C, s0);
  };
  run_ref(want.data());
  Guarded<T> y(n, T(NAN));
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n, T(NAN));
    run(y1.data(), x.data(), r.data());
    y = y1;
    return bytes_of(y1.data(), size_t(n));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(n == 0 || std::memcmp(y.data(), want.data(), sizeof(T) * size_t(n)) == 0)
      << "y differs from the reference";
  // In place: y aliases x (forward, backward) or the residual (add).
  Guarded<T> io(n);
  for (int64_t i = 0; i < n; ++i) io[i] = form == Form::Add ? r[size_t(i)] : x[size_t(i)];
  if (form == Form::Add) {
    run(io.data(), x.data(), io.data());
  } else {
    run(io.data(), io.data(), nullptr);
  }
  EXPECT_TRUE(io.intact());
  EXPECT_TRUE(n == 0 || std::memcmp(io.data(), want.data(), sizeof(T) * size_t(n)) == 0)
      << "in place differs from the reference";
}

TEST(EmuKernelsDropout, MatchesTheReferenceBitwiseInEveryOrder) {
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> shapes = {
      {0, 2, 5, 0},   {1, 1, 1, 0},   {3, 2, 7, 0},  {5, 3, 33, 4},
      {2, 2, 130, 0}, {17, 3, 64, 1}, {40, 2, 37, 0}};
  for (Form form : {Form::Forward, Form::Add, Form::Backward}) {
    for (double p : {0.0, 0.1, 0.5}) {
      for (auto [S, B, C, s0] : shapes) {
        check_dropout<float>(form, p, S, B, C, s0);
        check_dropout<double>(form, p, S, B, C, s0);
      }
    }
  }
}

// p == 0 needs no counters (every element kept, scale 1).
TEST(EmuKernelsDropout, NoCountersAtPZero) {
  const std::vector<float> x = random_vec<float>(10, 63);
  Guarded<float> y(10, NAN);
  ops::cuda::dropout_forward<float>(nullptr, y.data(), x.data(), 0.0, 1, nullptr, 2, 1, 5, 0);
  EXPECT_TRUE(y.intact());
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(y[i], x[size_t(i)]);
}

TEST(EmuKernelsDropout, BadArgumentsAreErrors) {
  float v = 0;
  const ops::DropoutCounters c;
  EXPECT_THROW(ops::cuda::dropout_forward<float>(nullptr, &v, &v, 1.0, 1, &c, 1, 1, 1, 0), Error);
  EXPECT_THROW(ops::cuda::dropout_forward<float>(nullptr, &v, &v, 0.1, 1, nullptr, 1, 1, 1, 0),
               Error);
  EXPECT_THROW(ops::cuda::dropout_backward<float>(nullptr, &v, &v, 0.1, 1, &c, 1, -1, 1, 0), Error);
  EXPECT_THROW(ops::cuda::dropout_add_forward<float>(nullptr, &v, &v, &v, -0.1, 1, &c, 1, 1, 1, 0),
               Error);
}

}  // namespace
}  // namespace moecore
