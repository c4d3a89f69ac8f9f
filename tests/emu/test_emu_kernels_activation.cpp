// The MLP activation kernels (src/ops/cuda/swiglu.cu, activation.cu) in the grid emulator against
// their `_ref` oracles within the dtype's tolerance (docs/numerics.md), with and without the
// routing prob, NaN-poisoned guarded outputs (dp left untouched when it is not asked for), and
// bitwise the same in every resume order (dp's block sums in a fixed tree).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/activation.h"
#include "ops/swiglu.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_near(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (int64_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[size_t(i)], kAtol<T> + kRtol<T> * std::abs(want[size_t(i)]))
        << what << " element " << i;
  }
}

template <typename T>
void expect_all_nan(const Guarded<T>& got, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (int64_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isnan(got[i])) << what << " " << i;
}

// One activation's forward and backward on [N, W] inputs (W = 2F for SwiGLU, F otherwise); the
// kernels and the references are passed in, so SwiGLU and the element-wise ones share the checks.
template <typename T>
struct Op {
  int64_t width;  // of h and dh
  std::function<void(T*, const T*, const T*)> fwd, fwd_ref;
  std::function<void(T*, T*, const T*, const T*, const T*)> bwd, bwd_ref;
};

template <typename T>
void check_op(const Op<T>& op, int64_t N, int64_t F, bool with_p) {
  SCOPED_TRACE("rows=" + std::to_string(N) + " F=" + std::to_string(F) +
               (with_p ? " with p" : " p null"));
  const int64_t W = op.width;
  const std::vector<T> h = random_vec<T>(N * W, 61, -4.0, 4.0);
  const std::vector<T> da = random_vec<T>(N * F, 62);
  const std::vector<T> p_vals = random_vec<T>(N, 63, 0.1, 1.0);
  const T* p = with_p ? p_vals.data() : nullptr;
  std::vector<T> a_ref(size_t(N * F)), dh_ref(size_t(N * W)), dp_ref(size_t(N), T(NAN));
  op.fwd_ref(a_ref.data(), h.data(), p);
  op.bwd_ref(dh_ref.data(), dp_ref.data(), da.data(), h.data(), p);

  Guarded<T> a(N * F, T(NAN)), dh(N * W, T(NAN)), dp(N, T(NAN));
  EXPECT_EQ(order_dependence([&] {
              Guarded<T> a1(N * F, T(NAN)), dh1(N * W, T(NAN)), dp1(N, T(NAN));
              op.fwd(a1.data(), h.data(), p);
              op.bwd(dh1.data(), dp1.data(), da.data(), h.data(), p);
              a = a1;
              dh = dh1;
              dp = dp1;
              std::vector<unsigned char> out = bytes_of(a1.data(), size_t(N * F));
              for (const Guarded<T>* g : {&dh1, &dp1}) {
                const std::vector<unsigned char> b = bytes_of(g->data(), size_t(g->size()));
                out.insert(out.end(), b.begin(), b.end());
              }
              return out;
            }),
            "");
  expect_near(a, a_ref, "a");
  expect_near(dh, dh_ref, "dh");
  if (with_p)
    expect_near(dp, dp_ref, "dp");
  else
    expect_all_nan(dp, "dp (not asked for)");
  // dp not asked for with p given: dh the same, dp untouched.
  if (with_p) {
    Guarded<T> dh2(N * W, T(NAN));
    op.bwd(dh2.data(), nullptr, da.data(), h.data(), p);
    expect_near(dh2, dh_ref, "dh without dp");
  }
}

// One row; rows shorter than a warp; widths not a multiple of the warp, around the block (256)
// and over it (threads take several elements); F = 0 (dp an empty sum); no rows.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},   {3, 5},    {7, 33}, {5, 255},
                                                          {4, 257}, {2, 1000}, {3, 0},  {0, 7}};

template <typename T>
Op<T> swiglu_op(int64_t N, int64_t F) {
  return {2 * F,
          [=](T* a, const T* h, const T* p) { ops::cuda::swiglu_forward(nullptr, a, h, p, N, F); },
          [=](T* a, const T* h, const T* p) { ops::swiglu_forward_ref(a, h, p, N, F); },
          [=](T* dh, T* dp, const T* da, const T* h, const T* p) {
            ops::cuda::swiglu_backward(nullptr, dh, dp, da, h, p, N, F);
          },
          [=](T* dh, T* dp, const T* da, const T* h, const T* p) {
            ops::swiglu_backward_ref(dh, dp, da, h, p, N, F);
          }};
}

template <typename T>
Op<T> activation_op(ops::Activation act, int64_t N, int64_t F) {
  return {F,
          [=](T* a, const T* h, const T* p) {
            ops::cuda::activation_forward(nullptr, act, a, h, p, N, F);
          },
          [=](T* a, const T* h, const T* p) { ops::activation_forward_ref(act, a, h, p, N, F); },
          [=](T* dh, T* dp, const T* da, const T* h, const T* p) {
            ops::cuda::activation_backward(nullptr, act, dh, dp, da, h, p, N, F);
          },
          [=](T* dh, T* dp, const T* da, const T* h, const T* p) {
            ops::activation_backward_ref(act, dh, dp, da, h, p, N, F);
          }};
}

TEST(EmuKernelsActivation, SwigluMatchesTheReferenceInEveryOrder) {
  for (auto [N, F] : kShapes) {
    for (bool with_p : {true, false}) {
      check_op(swiglu_op<float>(N, F), N, F, with_p);
      check_op(swiglu_op<double>(N, F), N, F, with_p);
    }
  }
}

TEST(EmuKernelsActivation, ElementwiseActivationsMatchTheReferenceInEveryOrder) {
  for (ops::Activation act :
       {ops::Activation::GeLU, ops::Activation::GeLUTanh, ops::Activation::SquaredReLU}) {
    SCOPED_TRACE(ops::activation_name(act));
    for (auto [N, F] : kShapes) {
      for (bool with_p : {true, false}) {
        check_op(activation_op<float>(act, N, F), N, F, with_p);
        check_op(activation_op<double>(act, N, F), N, F, with_p);
      }
    }
  }
}

TEST(EmuKernelsActivation, BadArgumentsAreErrors) {
  float v = 0;
  EXPECT_THROW(ops::cuda::swiglu_forward<float>(nullptr, &v, &v, nullptr, -1, 2), Error);
  EXPECT_THROW(ops::cuda::swiglu_backward<float>(nullptr, &v, &v, &v, &v, &v, 2, -1), Error);
  EXPECT_THROW(
      ops::cuda::activation_forward<float>(nullptr, ops::Activation::GeLU, &v, &v, nullptr, 2, -1),
      Error);
  // SwiGLU is gated: the element-wise kernels refuse it.
  EXPECT_THROW(
      ops::cuda::activation_forward<float>(nullptr, ops::Activation::SwiGLU, &v, &v, nullptr, 1, 1),
      Error);
  EXPECT_THROW(ops::cuda::activation_backward<float>(nullptr, ops::Activation::SwiGLU, &v, &v, &v,
                                                     &v, &v, 1, 1),
               Error);
}

}  // namespace
}  // namespace moecore
