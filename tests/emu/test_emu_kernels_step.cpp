// The step's scalar and conversion kernels in the grid emulator (src/ops/cuda/grad_clip.cu,
// numeric_guard.cu, convert_f64.cu, step_report.cu) bitwise against their `_ref` oracles (each
// output one rounding or one writer), and the bf16 forms of the MLP activations (swiglu.cu,
// activation.cu) bitwise the cast of the f32 kernels' outputs, dp the f32 kernel's; every one in
// every resume order with NaN-poisoned guarded outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/activation.h"
#include "ops/cast.h"
#include "ops/convert_f64.h"
#include "ops/grad_clip.h"
#include "ops/numeric_guard.h"
#include "ops/step_report.h"
#include "ops/swiglu.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_bits(const T* got, const T* want, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
}

const std::vector<int64_t> kSizes = {0, 1, 31, 33, 257, 5000};  // 5000: more than one block

TEST(EmuKernelsStep, GradClipIsTheReferenceBitwise) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<double>> parts = {
      {}, {4.0}, {1e-3, 2.5, 7.25}, {1e6, 3.0}, {inf, 1.0}, {NAN}, {0.0, 0.0}};
  for (const std::vector<double>& sum_sq : parts) {
    for (double max_norm : {0.0, 1.0, 1e9}) {
      SCOPED_TRACE("parts=" + std::to_string(sum_sq.size()) + " max_norm=" +
                   std::to_string(max_norm));
      double want_norm = NAN;
      ops::AdamWStep want{1e-3, 3, -7.0, 5};
      ops::grad_clip_ref(&want_norm, &want, sum_sq.data(), int64_t(sum_sq.size()), max_norm);
      double norm = NAN;
      ops::AdamWStep got{1e-3, 3, -7.0, 5};
      EXPECT_EQ(order_dependence([&] {
                  ops::cuda::grad_clip(nullptr, &norm, &got, sum_sq.data(), int64_t(sum_sq.size()),
                                       max_norm);
                  auto b = bytes_of(&norm, 1);
                  const auto s = bytes_of(&got.grad_scale, 1);
                  b.insert(b.end(), s.begin(), s.end());
                  b.push_back(uint8_t(got.skip));
                  return b;
                }),
                "");
      expect_bits(&norm, &want_norm, 1, "norm");
      expect_bits(&got.grad_scale, &want.grad_scale, 1, "grad_scale");
      EXPECT_EQ(got.skip, want.skip);
      EXPECT_EQ(got.lr, want.lr);
      EXPECT_EQ(got.step, want.step);
    }
  }
  double norm = 0;
  ops::AdamWStep s;
  EXPECT_THROW(ops::cuda::grad_clip(nullptr, &norm, &s, nullptr, -1, 1.0), Error);
  EXPECT_THROW(ops::cuda::grad_clip(nullptr, &norm, &s, nullptr, 0, -1.0), Error);
}

// A NaN or an Inf at the first, a middle and the last element (past the first block), or none;
// the flag is an OR: a raised flag stays raised.
template <typename T>
void check_flag_nonfinite() {
  for (int64_t n : kSizes) {
    for (T bad : {T(0), std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                  -std::numeric_limits<T>::infinity()}) {
      for (int64_t at : {int64_t(0), n / 2, n - 1}) {
        if (n == 0 && at != 0) continue;
        std::vector<T> x = random_vec<T>(n, 91, -1e30, 1e30);
        if (n > 0) x[size_t(at)] = bad;
        for (int32_t start : {0, 1}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " bad=" + std::to_string(double(bad)) +
                       " at=" + std::to_string(at) + " flag=" + std::to_string(start));
          int32_t want = start;
          ops::flag_nonfinite_ref(&want, x.data(), n);
          Guarded<int32_t> flag(1, start);
          EXPECT_EQ(order_dependence([&] {
                      flag[0] = start;
                      ops::cuda::flag_nonfinite(nullptr, flag.data(), x.data(), n);
                      return bytes_of(flag.data(), 1);
                    }),
                    "");
          EXPECT_TRUE(flag.intact());
          EXPECT_EQ(flag[0], want);
        }
      }
    }
  }
}

TEST(EmuKernelsStep, GuardsAreTheReferenceBitwise) {
  check_flag_nonfinite<float>();
  check_flag_nonfinite<double>();
  const double inf = std::numeric_limits<double>::infinity();
  for (double value : {0.0, 2.0, -2.0, 3.0, -5.0, inf, -inf, double(NAN)}) {
    for (double threshold : {2.0, 4.0, inf}) {
      for (int32_t start : {0, 1}) {
        int32_t want = start;
        ops::flag_at_least_ref(&want, &value, &threshold);
        Guarded<int32_t> flag(1, start);
        ops::cuda::flag_at_least(nullptr, flag.data(), &value, &threshold);
        EXPECT_TRUE(flag.intact());
        EXPECT_EQ(flag[0], want) << value << " >= " << threshold << " from " << start;
      }
    }
  }
  const std::vector<std::vector<int32_t>> flag_sets = {{}, {0}, {0, 0, 0}, {0, 2, 0}, {0, 0, 1}};
  for (const std::vector<int32_t>& flags : flag_sets) {
    for (int32_t start : {0, 1}) {
      ops::AdamWStep want{1e-3, 2, 0.5, start}, got = want;
      ops::skip_if_flagged_ref(&want, flags.data(), int64_t(flags.size()));
      ops::cuda::skip_if_flagged(nullptr, &got, flags.data(), int64_t(flags.size()));
      EXPECT_EQ(got.skip, want.skip) << flags.size() << " flags from " << start;
      EXPECT_EQ(got.grad_scale, want.grad_scale);
    }
  }
  int32_t flag = 0;
  ops::AdamWStep s;
  EXPECT_THROW(ops::cuda::flag_nonfinite<float>(nullptr, &flag, nullptr, -1), Error);
  EXPECT_THROW(ops::cuda::skip_if_flagged(nullptr, &s, &flag, -1), Error);
}

template <typename T>
void check_convert(int64_t n) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const std::vector<T> x = random_vec<T>(n, 92, -3.0, 3.0), factor = random_vec<T>(n, 93);
  const std::vector<double> xd = random_vec<double>(n, 94, -3.0, 3.0);
  const std::vector<T> y0 = random_vec<T>(n, 95);

  std::vector<double> widen_ref(static_cast<size_t>(n));
  ops::widen_to_f64_ref(widen_ref.data(), x.data(), n);
  Guarded<double> widen(n, NAN);
  EXPECT_EQ(order_dependence([&] {
              ops::cuda::widen_to_f64(nullptr, widen.data(), x.data(), n);
              return bytes_of(widen.data(), size_t(n));
            }),
            "");
  EXPECT_TRUE(widen.intact());
  expect_bits(widen.data(), widen_ref.data(), n, "widen_to_f64");

  std::vector<T> narrow_ref(static_cast<size_t>(n));
  ops::narrow_from_f64_ref(narrow_ref.data(), xd.data(), n);
  Guarded<T> narrow(n, T(NAN));
  EXPECT_EQ(order_dependence([&] {
              ops::cuda::narrow_from_f64(nullptr, narrow.data(), xd.data(), n);
              return bytes_of(narrow.data(), size_t(n));
            }),
            "");
  EXPECT_TRUE(narrow.intact());
  expect_bits(narrow.data(), narrow_ref.data(), n, "narrow_from_f64");

  for (bool with_factor : {false, true}) {
    const T* f = with_factor ? factor.data() : nullptr;
    std::vector<T> add_ref = y0;
    ops::add_from_f64_ref(add_ref.data(), xd.data(), f, n);
    Guarded<T> add(n);
    EXPECT_EQ(order_dependence([&] {
                std::copy(y0.begin(), y0.end(), add.data());
                ops::cuda::add_from_f64(nullptr, add.data(), xd.data(), f, n);
                return bytes_of(add.data(), size_t(n));
              }),
              "");
    EXPECT_TRUE(add.intact());
    expect_bits(add.data(), add_ref.data(), n,
                with_factor ? "add_from_f64 with a factor" : "add_from_f64");
  }
}

TEST(EmuKernelsStep, ConversionsAreTheReferenceBitwise) {
  for (int64_t n : kSizes) {
    check_convert<float>(n);
    check_convert<double>(n);
  }
  double y = 0;
  float x = 0;
  EXPECT_THROW(ops::cuda::widen_to_f64(nullptr, &y, &x, -1), Error);
  EXPECT_THROW(ops::cuda::narrow_from_f64(nullptr, &x, &y, -1), Error);
  EXPECT_THROW(ops::cuda::add_from_f64(nullptr, &x, &y, static_cast<const float*>(nullptr), -1),
               Error);
}

TEST(EmuKernelsStep, StepReportIsTheReferenceBitwise) {
  for (int64_t counted : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000003)}) {
    float want = NAN, got = NAN;
    double want_d = NAN, got_d = NAN;
    ops::loss_grad_scale_ref(&want, &counted, 0.75);
    ops::loss_grad_scale_ref(&want_d, &counted, 0.75);
    ops::cuda::loss_grad_scale(nullptr, &got, &counted, 0.75);
    ops::cuda::loss_grad_scale(nullptr, &got_d, &counted, 0.75);
    expect_bits(&got, &want, 1, "dloss f32, counted " + std::to_string(counted));
    expect_bits(&got_d, &want_d, 1, "dloss f64, counted " + std::to_string(counted));
  }
  // No experts, one, fewer than a warp, more than one block (256 threads).
  for (int64_t E : {0, 1, 7, 300}) {
    for (bool with_aux : {false, true}) {
      SCOPED_TRACE("E=" + std::to_string(E) + (with_aux ? " with aux" : " no aux"));
      const double aux = 0.125, z = 3.5;
      const int64_t dropped = 11;
      std::vector<int64_t> layer(static_cast<size_t>(E)), tokens0(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) {
        layer[size_t(e)] = 3 * e + 1;
        tokens0[size_t(e)] = 1000 + e;
      }
      const ops::MicroBatchReport r0{1.5, 40, 0.25, 0.5, 2, 1};
      ops::MicroBatchReport want = r0, got = r0;
      std::vector<int64_t> want_tokens = tokens0;
      ops::report_moe_layer_ref(&want, want_tokens.data(), with_aux ? &aux : nullptr, &z, &dropped,
                                layer.data(), E);
      Guarded<int64_t> tokens(E);
      EXPECT_EQ(order_dependence([&] {
                  got = r0;
                  std::copy(tokens0.begin(), tokens0.end(), tokens.data());
                  ops::cuda::report_moe_layer(nullptr, &got, tokens.data(),
                                              with_aux ? &aux : nullptr, &z, &dropped,
                                              layer.data(), E);
                  auto b = bytes_of(tokens.data(), size_t(E));
                  const auto r = bytes_of(&got, 1);
                  b.insert(b.end(), r.begin(), r.end());
                  return b;
                }),
                "");
      EXPECT_TRUE(tokens.intact());
      expect_bits(tokens.data(), want_tokens.data(), E, "tokens_E");
      EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << "the report's scalars";
    }
  }
  ops::MicroBatchReport r;
  EXPECT_THROW(ops::cuda::report_moe_layer(nullptr, &r, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, -1),
               Error);
}

// The bf16 forms of one MLP activation: run the f32 kernels, then the bf16 and the widened forms,
// each in every resume order; their outputs must be the casts of the f32 outputs, bit for bit.
struct Forms {
  int64_t width;  // of h and dh
  std::function<void(float*, const float*, const float*)> fwd;
  std::function<void(float*, float*, const float*, const float*, const float*)> bwd;
  std::function<void(uint16_t*, const float*, const float*)> fwd16;
  std::function<void(uint16_t*, float*, const float*, const float*, const float*)> bwd16;
  std::function<void(float*, const float*, const float*)> fwdw;
  std::function<void(float*, float*, const float*, const float*, const float*)> bwdw;
};

void check_forms(const Forms& op, int64_t N, int64_t F, bool with_p) {
  SCOPED_TRACE("rows=" + std::to_string(N) + " F=" + std::to_string(F) +
               (with_p ? " with p" : " p null"));
  const int64_t W = op.width;
  const std::vector<float> h = random_vec<float>(N * W, 96, -4.0, 4.0);
  const std::vector<float> da = random_vec<float>(N * F, 97);
  const std::vector<float> p_vals = random_vec<float>(N, 98, 0.1, 1.0);
  const float* p = with_p ? p_vals.data() : nullptr;
  Guarded<float> a(N * F, NAN), dh(N * W, NAN), dp(N, NAN);
  op.fwd(a.data(), h.data(), p);
  op.bwd(dh.data(), dp.data(), da.data(), h.data(), p);
  std::vector<uint16_t> a16_want(size_t(N * F)), dh16_want(size_t(N * W));
  for (int64_t i = 0; i < N * F; ++i) a16_want[size_t(i)] = ops::f32_to_bf16_bits(a[i]);
  for (int64_t i = 0; i < N * W; ++i) dh16_want[size_t(i)] = ops::f32_to_bf16_bits(dh[i]);

  Guarded<uint16_t> a16(N * F, uint16_t(0x7fc1)), dh16(N * W, uint16_t(0x7fc1));
  Guarded<float> dp16(N, NAN), aw(N * F, NAN), dhw(N * W, NAN), dpw(N, NAN);
  EXPECT_EQ(order_dependence([&] {
              op.fwd16(a16.data(), h.data(), p);
              op.bwd16(dh16.data(), dp16.data(), da.data(), h.data(), p);
              op.fwdw(aw.data(), h.data(), p);
              op.bwdw(dhw.data(), dpw.data(), da.data(), h.data(), p);
              auto out = bytes_of(a16.data(), size_t(N * F));
              for (const auto& b :
                   {bytes_of(dh16.data(), size_t(N * W)), bytes_of(dp16.data(), size_t(N)),
                    bytes_of(aw.data(), size_t(N * F)), bytes_of(dhw.data(), size_t(N * W)),
                    bytes_of(dpw.data(), size_t(N))})
                out.insert(out.end(), b.begin(), b.end());
              return out;
            }),
            "");
  EXPECT_TRUE(a16.intact() && dh16.intact() && dp16.intact() && aw.intact() && dhw.intact() &&
              dpw.intact())
      << "written outside the elements";
  expect_bits(a16.data(), a16_want.data(), N * F, "a16");
  expect_bits(dh16.data(), dh16_want.data(), N * W, "dh16");
  std::vector<float> a_wide(size_t(N * F)), dh_wide(size_t(N * W));
  for (int64_t i = 0; i < N * F; ++i) a_wide[size_t(i)] = ops::bf16_bits_to_f32(a16_want[size_t(i)]);
  for (int64_t i = 0; i < N * W; ++i) dh_wide[size_t(i)] = ops::bf16_bits_to_f32(dh16_want[size_t(i)]);
  expect_bits(aw.data(), a_wide.data(), N * F, "a widened");
  expect_bits(dhw.data(), dh_wide.data(), N * W, "dh widened");
  expect_bits(dp16.data(), dp.data(), N, "dp of the bf16 form");  // NaN when not asked for
  expect_bits(dpw.data(), dp.data(), N, "dp of the widened form");
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},   {3, 5},    {7, 33},
                                                          {4, 257}, {2, 1000}, {3, 0}, {0, 7}};

Forms swiglu_forms(int64_t N, int64_t F) {
  using namespace ops::cuda;
  const auto b16 = [](uint16_t* x) { return reinterpret_cast<bf16*>(x); };
  return {2 * F,
          [=](float* a, const float* h, const float* p) { swiglu_forward(nullptr, a, h, p, N, F); },
          [=](float* dh, float* dp, const float* da, const float* h, const float* p) {
            swiglu_backward(nullptr, dh, dp, da, h, p, N, F);
          },
          [=](uint16_t* a, const float* h, const float* p) {
            swiglu_forward_bf16(nullptr, b16(a), h, p, N, F);
          },
          [=](uint16_t* dh, float* dp, const float* da, const float* h, const float* p) {
            swiglu_backward_bf16(nullptr, b16(dh), dp, da, h, p, N, F);
          },
          [=](float* a, const float* h, const float* p) {
            swiglu_forward_bf16w(nullptr, a, h, p, N, F);
          },
          [=](float* dh, float* dp, const float* da, const float* h, const float* p) {
            swiglu_backward_bf16w(nullptr, dh, dp, da, h, p, N, F);
          }};
}

Forms activation_forms(ops::Activation act, int64_t N, int64_t F) {
  using namespace ops::cuda;
  const auto b16 = [](uint16_t* x) { return reinterpret_cast<bf16*>(x); };
  return {F,
          [=](float* a, const float* h, const float* p) {
            activation_forward(nullptr, act, a, h, p, N, F);
          },
          [=](float* dh, float* dp, const float* da, const float* h, const float* p) {
            activation_backward(nullptr, act, dh, dp, da, h, p, N, F);
          },
          [=](uint16_t* a, const float* h, const float* p) {
            activation_forward_bf16(nullptr, act, b16(a), h, p, N, F);
          },
          [=](uint16_t* dh, float* dp, const float* da, const float* h, const float* p) {
            activation_backward_bf16(nullptr, act, b16(dh), dp, da, h, p, N, F);
          },
          [=](float* a, const float* h, const float* p) {
            activation_forward_bf16w(nullptr, act, a, h, p, N, F);
          },
          [=](float* dh, float* dp, const float* da, const float* h, const float* p) {
            activation_backward_bf16w(nullptr, act, dh, dp, da, h, p, N, F);
          }};
}

TEST(EmuKernelsStep, Bf16FormsAreTheCastsOfTheF32KernelsBitwise) {
  for (auto [N, F] : kShapes) {
    for (bool with_p : {true, false}) {
      check_forms(swiglu_forms(N, F), N, F, with_p);
      for (ops::Activation act :
           {ops::Activation::GeLU, ops::Activation::GeLUTanh, ops::Activation::SquaredReLU}) {
        SCOPED_TRACE(ops::activation_name(act));
        check_forms(activation_forms(act, N, F), N, F, with_p);
      }
    }
  }
  float a = 0;
  bf16 a16;
  EXPECT_THROW(ops::cuda::swiglu_forward_bf16(nullptr, &a16, &a, nullptr, -1, 1), Error);
  EXPECT_THROW(ops::cuda::activation_forward_bf16w(nullptr, ops::Activation::SwiGLU, &a, &a,
                                                   nullptr, 1, 1),
               Error);
}

}  // namespace
}  // namespace moecore
