// Cases: the element-wise and layout ops: SwiGLU and the element-wise activations (with and
// without the routing prob, and their bf16 / bf16w forms), RMSNorm and LayerNorm (and their
// forward_bf16w), add, bias (plain and grouped), the QKV layout, the token layout, the
// f32 <-> bf16 casts (NaN, inf, denormals, ties), sum of squares and AdamW
// (with and without the bf16 copies). Sizes 0 / 1 / odd / not a multiple of 8, and one above
// each op's OpenMP threshold.
#include <bit>
#include <cmath>
#include <random>

#include "backend_case.h"
#include "ops/activation.h"
#include "ops/adamw.h"
#include "ops/add.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/layernorm.h"
#include "ops/qkv_layout.h"
#include "ops/rmsnorm.h"
#include "ops/sum_squares.h"
#include "ops/swiglu.h"
#include "ops/token_layout.h"

namespace moecore::backend_test {
namespace {

struct NF {
  int64_t N, F;
};
// N = 0 (an expert with no tokens), N = 1, odd N, F not a multiple of 8, a parallel shape.
const NF kSwiGluShapes[] = {{0, 5}, {1, 1}, {1, 7}, {13, 37}, {64, 300}};

// An activation's outputs against its reference's; dp is written only with p (else it keeps
// its -1 fill).
template <typename T>
void expect_activation(const Guarded<T>& a, const std::vector<T>& a_ref, const Guarded<T>& dh,
                       const std::vector<T>& dh_ref, const Guarded<T>& dp,
                       const std::vector<T>& dp_ref, bool with_p) {
  expect_close(a, a_ref.data(), "a");
  expect_close(dh, dh_ref.data(), "dh");
  if (with_p) {
    expect_close(dp, dp_ref.data(), "dp");
  } else {
    for (int64_t n = 0; n < dp.size(); ++n) EXPECT_EQ(dp[n], T(-1)) << "dp written without p";
  }
}

// The backward takes the same h as the forward; dp is written only with p.
template <typename T>
void swiglu_case(const Exec& ex) {
  uint32_t seed = 1;
  for (auto [N, F] : kSwiGluShapes) {
    const auto h = random_vec<T>(N * 2 * F, seed++, -6, 6);  // both tails of the sigmoid
    const auto p = random_vec<T>(N, seed++, 0, 1);
    const auto da = random_vec<T>(N * F, seed++);
    for (bool with_p : {true, false}) {
      BACKEND_TRACE("N=" << N << " F=" << F << " p=" << with_p);
      const T* pp = with_p ? p.data() : nullptr;
      std::vector<T> a_ref(N * F), dh_ref(N * 2 * F), dp_ref(N, T(-1));
      ops::swiglu_forward_ref(a_ref.data(), h.data(), pp, N, F);
      ops::swiglu_backward_ref(dh_ref.data(), dp_ref.data(), da.data(), h.data(), pp, N, F);
      Guarded<T> a = nan_out<T>(N * F), dh = nan_out<T>(N * 2 * F), dp(N, T(-1));
      Staging st(ex);
      ops::swiglu_forward<T>(ex, st.out(a), st.in(h), st.in_or_null(pp, N), N, F);
      ops::swiglu_backward<T>(ex, st.out(dh), st.out(dp), st.in(da), st.in(h),
                              st.in_or_null(pp, N), N, F);
      st.back();
      expect_activation(a, a_ref, dh, dh_ref, dp, dp_ref, with_p);
    }
  }
}

// No plain loop of its own: the bf16 forms are specified as the cast of the f32 op's outputs
// (bitwise, ops/swiglu.h), and the f32 op is checked against its reference in swiglu_f32.
void swiglu_bf16_case(const Exec& ex) {
  uint32_t seed = 20;
  for (auto [N, F] : kSwiGluShapes) {
    const auto h = random_vec<float>(N * 2 * F, seed++, -6, 6);
    const auto p = random_vec<float>(N, seed++, 0, 1);
    const auto da = random_vec<float>(N * F, seed++);
    for (bool with_p : {true, false}) {
      BACKEND_TRACE("N=" << N << " F=" << F << " p=" << with_p);
      const float* pp = with_p ? p.data() : nullptr;
      Guarded<float> a = nan_out<float>(N * F), dh = nan_out<float>(N * 2 * F), dp(N, -1.f);
      Guarded<uint16_t> a16(N * F), dh16(N * 2 * F);
      Guarded<float> dp16(N, -1.f);
      Guarded<float> aw = nan_out<float>(N * F), dhw = nan_out<float>(N * 2 * F), dpw(N, -1.f);
      Staging st(ex);
      const float* h_d = st.in(h);
      const float* p_d = st.in_or_null(pp, N);
      const float* da_d = st.in(da);
      ops::swiglu_forward<float>(ex, st.out(a), h_d, p_d, N, F);
      ops::swiglu_backward<float>(ex, st.out(dh), st.out(dp), da_d, h_d, p_d, N, F);
      ops::swiglu_forward_bf16(ex, as_bf16(st.out(a16)), h_d, p_d, N, F);
      ops::swiglu_backward_bf16(ex, as_bf16(st.out(dh16)), st.out(dp16), da_d, h_d, p_d, N, F);
      ops::swiglu_forward_bf16w(ex, st.out(aw), h_d, p_d, N, F);
      ops::swiglu_backward_bf16w(ex, st.out(dhw), st.out(dpw), da_d, h_d, p_d, N, F);
      st.back();
      const auto a16_want = to_bf16(a.vec()), dh16_want = to_bf16(dh.vec());
      const auto aw_want = bf16_rounded(a.vec()), dhw_want = bf16_rounded(dh.vec());

      expect_bitwise(a16, reinterpret_cast<const uint16_t*>(a16_want.data()), "a16");
      expect_bitwise(dh16, reinterpret_cast<const uint16_t*>(dh16_want.data()), "dh16");
      expect_bitwise(dp16, dp.data(), "dp (bf16 kernel)");  // -1 where p is null: unwritten
      expect_bitwise(aw, aw_want.data(), "a (bf16w)");
      expect_bitwise(dhw, dhw_want.data(), "dh (bf16w)");
      expect_bitwise(dpw, dp.data(), "dp (bf16w kernel)");
    }
  }
}

const ops::Activation kElementwiseActs[] = {ops::Activation::GeLU, ops::Activation::GeLUTanh,
                                            ops::Activation::SquaredReLU};

// As swiglu_case, for every element-wise activation: h [N, F].
template <typename T>
void activation_case(const Exec& ex) {
  uint32_t seed = 200;
  for (ops::Activation act : kElementwiseActs) {
    for (auto [N, F] : kSwiGluShapes) {
      const auto h = random_vec<T>(N * F, seed++, -6, 6);
      const auto p = random_vec<T>(N, seed++, 0, 1);
      const auto da = random_vec<T>(N * F, seed++);
      for (bool with_p : {true, false}) {
        BACKEND_TRACE(ops::activation_name(act) << " N=" << N << " F=" << F << " p=" << with_p);
        const T* pp = with_p ? p.data() : nullptr;
        std::vector<T> a_ref(N * F), dh_ref(N * F), dp_ref(N, T(-1));
        ops::activation_forward_ref(act, a_ref.data(), h.data(), pp, N, F);
        ops::activation_backward_ref(act, dh_ref.data(), dp_ref.data(), da.data(), h.data(), pp, N,
                                     F);
        Guarded<T> a = nan_out<T>(N * F), dh = nan_out<T>(N * F), dp(N, T(-1));
        Staging st(ex);
        ops::activation_forward<T>(ex, act, st.out(a), st.in(h), st.in_or_null(pp, N), N, F);
        ops::activation_backward<T>(ex, act, st.out(dh), st.out(dp), st.in(da), st.in(h),
                                    st.in_or_null(pp, N), N, F);
        st.back();
        expect_activation(a, a_ref, dh, dh_ref, dp, dp_ref, with_p);
      }
    }
  }
}

// As swiglu_bf16_case: the bf16 forms are specified as the cast of the f32 op's outputs.
void activation_bf16_case(const Exec& ex) {
  uint32_t seed = 300;
  for (ops::Activation act : kElementwiseActs) {
    for (auto [N, F] : kSwiGluShapes) {
      const auto h = random_vec<float>(N * F, seed++, -6, 6);
      const auto p = random_vec<float>(N, seed++, 0, 1);
      const auto da = random_vec<float>(N * F, seed++);
      for (bool with_p : {true, false}) {
        BACKEND_TRACE(ops::activation_name(act) << " N=" << N << " F=" << F << " p=" << with_p);
        const float* pp = with_p ? p.data() : nullptr;
        Guarded<float> a = nan_out<float>(N * F), dh = nan_out<float>(N * F), dp(N, -1.f);
        Guarded<uint16_t> a16(N * F), dh16(N * F);
        Guarded<float> dp16(N, -1.f);
        Guarded<float> aw = nan_out<float>(N * F), dhw = nan_out<float>(N * F), dpw(N, -1.f);
        Staging st(ex);
        const float* h_d = st.in(h);
        const float* p_d = st.in_or_null(pp, N);
        const float* da_d = st.in(da);
        ops::activation_forward<float>(ex, act, st.out(a), h_d, p_d, N, F);
        ops::activation_backward<float>(ex, act, st.out(dh), st.out(dp), da_d, h_d, p_d, N, F);
        ops::activation_forward_bf16(ex, act, as_bf16(st.out(a16)), h_d, p_d, N, F);
        ops::activation_backward_bf16(ex, act, as_bf16(st.out(dh16)), st.out(dp16), da_d, h_d,
                                      p_d, N, F);
        ops::activation_forward_bf16w(ex, act, st.out(aw), h_d, p_d, N, F);
        ops::activation_backward_bf16w(ex, act, st.out(dhw), st.out(dpw), da_d, h_d, p_d, N, F);
        st.back();
        const auto a16_want = to_bf16(a.vec()), dh16_want = to_bf16(dh.vec());
        const auto aw_want = bf16_rounded(a.vec()), dhw_want = bf16_rounded(dh.vec());

        expect_bitwise(a16, reinterpret_cast<const uint16_t*>(a16_want.data()), "a16");
        expect_bitwise(dh16, reinterpret_cast<const uint16_t*>(dh16_want.data()), "dh16");
        expect_bitwise(dp16, dp.data(), "dp (bf16 kernel)");
        expect_bitwise(aw, aw_want.data(), "a (bf16w)");
        expect_bitwise(dhw, dhw_want.data(), "dh (bf16w)");
        expect_bitwise(dpw, dp.data(), "dp (bf16w kernel)");
      }
    }
  }
}

struct TH {
  int64_t T, H;
};
// T = 1, odd T, H not a multiple of 8, shapes big enough for the parallel branch.
const TH kNormShapes[] = {{1, 1}, {1, 7}, {13, 37}, {3, 130}, {64, 256}, {70, 300}};
constexpr double kEps = 1e-6;

// The backward takes the reference forward's rstd; dw accumulates from a non-zero start.
// kBackward false: the forward alone (its own case, so a backend with the forward's kernel but
// not the backward's runs it; the forward is checked before the backward runs either way).
template <typename T, bool kBackward>
void rmsnorm_case(const Exec& ex) {
  uint32_t seed = 30;
  for (auto [T_, H] : kNormShapes) {
    BACKEND_TRACE("T=" << T_ << " H=" << H);
    const auto x = random_vec<T>(T_ * H, seed++, -2, 2);
    const auto w = random_vec<T>(H, seed++, 0.5, 1.5);
    const auto dy = random_vec<T>(T_ * H, seed++);
    const auto dw0 = random_vec<T>(H, seed++);
    std::vector<T> y_ref(T_ * H), rstd_ref(T_), dx_ref(T_ * H), dw_ref = dw0;
    ops::rmsnorm_forward_ref(y_ref.data(), rstd_ref.data(), x.data(), w.data(), T_, H, kEps);
    ops::rmsnorm_backward_ref(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(),
                              rstd_ref.data(), T_, H);
    Guarded<T> y = nan_out<T>(T_ * H), rstd = nan_out<T>(T_), dx = nan_out<T>(T_ * H),
               dw = guarded(dw0);
    Staging st(ex);
    ops::rmsnorm_forward<T>(ex, st.out(y), st.out(rstd), st.in(x), st.in(w), T_, H, kEps);
    st.back();
    expect_close(y, y_ref.data(), "y");
    expect_close(rstd, rstd_ref.data(), "rstd");
    if (!kBackward) continue;
    ops::rmsnorm_backward<T>(ex, st.out(dx), st.out(dw), st.in(dy), st.in(x), st.in(w),
                             st.in(rstd_ref), T_, H);
    st.back();
    expect_close(dx, dx_ref.data(), "dx");
    expect_close(dw, dw_ref.data(), "dw (accumulated)");
  }
}

// Specified as round_f32_to_bf16 of rmsnorm_forward's y, with the same rstd (ops/rmsnorm.h):
// bitwise against the backend's f32 forward, which rmsnorm_f32 checks against the reference.
void rmsnorm_bf16w_case(const Exec& ex) {
  uint32_t seed = 40;
  for (auto [T_, H] : kNormShapes) {
    BACKEND_TRACE("T=" << T_ << " H=" << H);
    const auto x = random_vec<float>(T_ * H, seed++, -2, 2);
    const auto w = random_vec<float>(H, seed++, 0.5, 1.5);
    Guarded<float> y = nan_out<float>(T_ * H), rstd = nan_out<float>(T_);
    Guarded<float> y16 = nan_out<float>(T_ * H), rstd16 = nan_out<float>(T_);
    Staging st(ex);
    ops::rmsnorm_forward<float>(ex, st.out(y), st.out(rstd), st.in(x), st.in(w), T_, H, kEps);
    ops::rmsnorm_forward_bf16w(ex, st.out(y16), st.out(rstd16), st.in(x), st.in(w), T_, H, kEps);
    st.back();
    const auto y_want = bf16_rounded(y.vec());
    expect_bitwise(y16, y_want.data(), "y (bf16 values)");
    expect_bitwise(rstd16, rstd.data(), "rstd");
  }
}

// Both gains (w, and 1 + w zero-centred); x away from 0 so the mean matters. The backward
// takes the reference forward's mean and rstd; dw and db accumulate from a non-zero start.
template <typename T>
void layernorm_case(const Exec& ex) {
  uint32_t seed = 60;
  for (bool zc : {false, true}) {
    for (auto [T_, H] : kNormShapes) {
      BACKEND_TRACE("T=" << T_ << " H=" << H << " zero_centered=" << zc);
      const auto x = random_vec<T>(T_ * H, seed++, -1, 3);
      const auto w = zc ? random_vec<T>(H, seed++, -0.5, 0.5) : random_vec<T>(H, seed++, 0.5, 1.5);
      const auto b = random_vec<T>(H, seed++);
      const auto dy = random_vec<T>(T_ * H, seed++);
      const auto dw0 = random_vec<T>(H, seed++), db0 = random_vec<T>(H, seed++);
      std::vector<T> y_ref(T_ * H), mean_ref(T_), rstd_ref(T_), dx_ref(T_ * H), dw_ref = dw0,
                                                                                db_ref = db0;
      ops::layernorm_forward_ref(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(),
                                 b.data(), T_, H, kEps, zc);
      ops::layernorm_backward_ref(dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(),
                                  w.data(), mean_ref.data(), rstd_ref.data(), T_, H, zc);
      Guarded<T> y = nan_out<T>(T_ * H), mean = nan_out<T>(T_), rstd = nan_out<T>(T_),
                 dx = nan_out<T>(T_ * H), dw = guarded(dw0), db = guarded(db0);
      Staging st(ex);
      ops::layernorm_forward<T>(ex, st.out(y), st.out(mean), st.out(rstd), st.in(x), st.in(w),
                                st.in(b), T_, H, kEps, zc);
      ops::layernorm_backward<T>(ex, st.out(dx), st.out(dw), st.out(db), st.in(dy), st.in(x),
                                 st.in(w), st.in(mean_ref), st.in(rstd_ref), T_, H, zc);
      st.back();
      expect_close(y, y_ref.data(), "y");
      expect_close(mean, mean_ref.data(), "mean");
      expect_close(rstd, rstd_ref.data(), "rstd");
      expect_close(dx, dx_ref.data(), "dx");
      expect_close(dw, dw_ref.data(), "dw (accumulated)");
      expect_close(db, db_ref.data(), "db (accumulated)");
    }
  }
}

// Specified as round_f32_to_bf16 of layernorm_forward's y, with the same mean and rstd
// (ops/layernorm.h): bitwise against the backend's f32 forward, which layernorm_f32 checks.
void layernorm_bf16w_case(const Exec& ex) {
  uint32_t seed = 80;
  for (bool zc : {false, true}) {
    for (auto [T_, H] : kNormShapes) {
      BACKEND_TRACE("T=" << T_ << " H=" << H << " zero_centered=" << zc);
      const auto x = random_vec<float>(T_ * H, seed++, -2, 2);
      const auto w = random_vec<float>(H, seed++, 0.5, 1.5);
      const auto b = random_vec<float>(H, seed++);
      Guarded<float> y = nan_out<float>(T_ * H), mean = nan_out<float>(T_),
                     rstd = nan_out<float>(T_);
      Guarded<float> y16 = nan_out<float>(T_ * H), mean16 = nan_out<float>(T_),
                     rstd16 = nan_out<float>(T_);
      Staging st(ex);
      ops::layernorm_forward<float>(ex, st.out(y), st.out(mean), st.out(rstd), st.in(x), st.in(w),
                                    st.in(b), T_, H, kEps, zc);
      ops::layernorm_forward_bf16w(ex, st.out(y16), st.out(mean16), st.out(rstd16), st.in(x),
                                   st.in(w), st.in(b), T_, H, kEps, zc);
      st.back();
      const auto y_want = bf16_rounded(y.vec());
      expect_bitwise(y16, y_want.data(), "y (bf16 values)");
      expect_bitwise(mean16, mean.data(), "mean");
      expect_bitwise(rstd16, rstd.data(), "rstd");
    }
  }
}

const int64_t kSizes[] = {0, 1, 37, (int64_t{1} << 16) + 5};

// Exact per element: bitwise, also with y aliasing a or b. int64 (the router's dropped pairs of
// several capacity groups): values up to 2^40, outputs poisoned with the smallest int64.
template <typename T>
void add_one(const Exec& ex) {
  constexpr bool kInt = std::is_integral_v<T>;
  const double range = kInt ? 0x1p40 : 1.0;
  uint32_t seed = 50;
  for (int64_t n : kSizes) {
    BACKEND_TRACE((kInt ? "i64" : dtype_name<T>()) << " n=" << n);
    const auto a = random_vec<T>(n, seed++, -range, range),
               b = random_vec<T>(n, seed++, -range, range);
    std::vector<T> y_ref(n);
    ops::add_ref(y_ref.data(), a.data(), b.data(), n);
    Guarded<T> y = kInt ? Guarded<T>(n, std::numeric_limits<T>::min()) : nan_out<T>(n),
               ya = guarded(a), yb = guarded(b);
    Staging st(ex);
    // The aliased buffers staged once, as outputs (the order of a call's arguments is unspecified).
    T* ya_d = st.out(ya);
    T* yb_d = st.out(yb);
    ops::add<T>(ex, st.out(y), st.in(a), st.in(b), n);
    ops::add<T>(ex, ya_d, ya_d, st.in(b), n);
    ops::add<T>(ex, yb_d, st.in(a), yb_d, n);
    st.back();
    expect_bitwise(y, y_ref.data(), "y");
    expect_bitwise(ya, y_ref.data(), "y aliasing a");
    expect_bitwise(yb, y_ref.data(), "y aliasing b");
  }
}

// Forward exact (bitwise); backward sums rows in f32 vs the f64-accumulating reference.
template <typename T>
void bias_one(const Exec& ex) {
  struct MN {
    int64_t M, N;
  };
  uint32_t seed = 60;
  for (MN s : {MN{0, 3}, MN{1, 1}, MN{13, 7}, MN{100, 70}, MN{300, 37}}) {
    BACKEND_TRACE(dtype_name<T>() << " M=" << s.M << " N=" << s.N);
    const auto y0 = random_vec<T>(s.M * s.N, seed++), b = random_vec<T>(s.N, seed++);
    const auto db0 = random_vec<T>(s.N, seed++);
    std::vector<T> y_ref = y0, db_ref = db0;
    ops::bias_forward_ref(y_ref.data(), b.data(), s.M, s.N);
    ops::bias_backward_ref(db_ref.data(), y0.data(), s.M, s.N);
    Guarded<T> y = guarded(y0), db = guarded(db0);
    Staging st(ex);
    ops::bias_forward<T>(ex, st.out(y), st.in(b), s.M, s.N);
    ops::bias_backward<T>(ex, st.out(db), st.in(y0), s.M, s.N);
    st.back();
    expect_bitwise(y, y_ref.data(), "y");
    expect_close(db, db_ref.data(), "db (accumulated)");
  }
}

// Grouped bias: empty groups first, in the middle and last, rows past the groups (untouched),
// one shape above the threshold. Forward bitwise without p (an exact add); with p, and the
// accumulated backwards, within the dtype's tolerance of the f64 reference.
template <typename T>
void grouped_bias_one(const Exec& ex) {
  struct Case {
    std::vector<int64_t> m_G;
    int64_t extra_rows, C;
  };
  uint32_t seed = 400;
  for (const Case& c : {Case{{}, 0, 3}, Case{{0, 0}, 2, 5}, Case{{1}, 0, 1},
                        Case{{0, 4, 0, 7, 0}, 3, 13}, Case{{200, 0, 90, 1}, 0, 70}}) {
    const int64_t G = static_cast<int64_t>(c.m_G.size()), C = c.C;
    int64_t N = c.extra_rows;
    for (int64_t m : c.m_G) N += m;
    const auto y0 = random_vec<T>(N * C, seed++), b = random_vec<T>(G * C, seed++);
    const auto p = random_vec<T>(N, seed++, 0, 1), dy = random_vec<T>(N * C, seed++);
    const auto db0 = random_vec<T>(G * C, seed++), dp0 = random_vec<T>(N, seed++);
    for (bool with_p : {true, false}) {
      BACKEND_TRACE(dtype_name<T>() << " G=" << G << " N=" << N << " C=" << C << " p=" << with_p);
      const T* pp = with_p ? p.data() : nullptr;
      std::vector<T> y_ref = y0, db_ref = db0, dp_ref = dp0;
      ops::grouped_bias_forward_ref(y_ref.data(), b.data(), pp, c.m_G.data(), G, C);
      ops::grouped_bias_backward_ref(db_ref.data(), dp_ref.data(), dy.data(), b.data(), pp,
                                     c.m_G.data(), G, C);
      Guarded<T> y = guarded(y0), db = guarded(db0), dp = guarded(dp0);
      Staging st(ex);
      ops::grouped_bias_forward<T>(ex, st.out(y), st.in(b), st.in_or_null(pp, N), st.in(c.m_G), G,
                                   C);
      ops::grouped_bias_backward<T>(ex, st.out(db), st.out(dp), st.in(dy), st.in(b),
                                    st.in_or_null(pp, N), st.in(c.m_G), G, C);
      st.back();
      if (with_p) {
        expect_close(y, y_ref.data(), "y");
      } else {
        expect_bitwise(y, y_ref.data(), "y");
      }
      expect_close(db, db_ref.data(), "db (accumulated)");
      expect_close(dp, dp_ref.data(), "dp (accumulated)");
    }
  }
}

// Pure copies: bitwise; fuse(split(f)) == f.
template <typename T>
void qkv_one(const Exec& ex) {
  uint32_t seed = 70;
  for (ops::QkvShape s :
       {ops::QkvShape{1, 1, 1, 1}, ops::QkvShape{5, 4, 2, 3}, ops::QkvShape{7, 6, 6, 2},
        ops::QkvShape{13, 6, 2, 5}, ops::QkvShape{64, 8, 2, 16}}) {
    BACKEND_TRACE(dtype_name<T>() << " T=" << s.n_tok << " Hq=" << s.Hq << " Hkv=" << s.Hkv
                                  << " D=" << s.D);
    const int64_t nq = s.n_tok * s.Hq * s.D, nkv = s.n_tok * s.Hkv * s.D, nf = nq + 2 * nkv;
    const auto fused = random_vec<T>(nf, seed++);
    std::vector<T> q_ref(nq), k_ref(nkv), v_ref(nkv), f_ref(nf);
    ops::split_qkv_ref(q_ref.data(), k_ref.data(), v_ref.data(), fused.data(), s);
    Guarded<T> q = nan_out<T>(nq), k = nan_out<T>(nkv), v = nan_out<T>(nkv);
    Staging st(ex);
    ops::split_qkv<T>(ex, st.out(q), st.out(k), st.out(v), st.in(fused), s);
    st.back();
    expect_bitwise(q, q_ref.data(), "q");
    expect_bitwise(k, k_ref.data(), "k");
    expect_bitwise(v, v_ref.data(), "v");
    const auto gq = random_vec<T>(nq, seed++), gk = random_vec<T>(nkv, seed++),
               gv = random_vec<T>(nkv, seed++);
    ops::fuse_qkv_ref(f_ref.data(), gq.data(), gk.data(), gv.data(), s);
    Guarded<T> f = nan_out<T>(nf), back = nan_out<T>(nf);
    ops::fuse_qkv<T>(ex, st.out(f), st.in(gq), st.in(gk), st.in(gv), s);
    ops::fuse_qkv<T>(ex, st.out(back), st.in(q_ref), st.in(k_ref), st.in(v_ref), s);
    st.back();
    expect_bitwise(f, f_ref.data(), "fused");
    expect_bitwise(back, fused.data(), "fuse(split(f))");
  }
}

// Ignored (negative) targets are kept in place and not counted.
void token_layout_case(const Exec& ex) {
  for (auto [B, S] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {8, 64}, {0, 4}, {5, 13}}) {
    BACKEND_TRACE("B=" << B << " S=" << S);
    std::vector<int32_t> ids(B * S), tg(B * S);
    for (int64_t i = 0; i < B * S; ++i) {
      ids[i] = static_cast<int32_t>(i * 7 % 101);
      tg[i] = i % 5 == 3 ? -1 : i % 7 == 2 ? -100 : static_cast<int32_t>(i % 97);
    }
    std::vector<int32_t> ids_ref(B * S), tg_ref(B * S);
    int64_t counted_ref = -1;
    ops::tokens_to_sequence_major_ref(ids_ref.data(), tg_ref.data(), &counted_ref, ids.data(),
                                      tg.data(), B, S);
    Guarded<int32_t> ids_T(B * S, -7), tg_T(B * S, -7);
    Guarded<int64_t> counted(1, -1);
    Staging st(ex);
    ops::tokens_to_sequence_major(ex, st.out(ids_T), st.out(tg_T), st.out(counted), st.in(ids),
                                  st.in(tg), B, S);
    st.back();
    expect_bitwise(ids_T, ids_ref.data(), "ids_T");
    expect_bitwise(tg_T, tg_ref.data(), "targets_T");
    expect_bitwise(counted, &counted_ref, "counted");
  }
}

// Multi-token prediction's roll: ids (fill 0, no count) and targets (fill -1, counted), shifts
// of 0, within and past the tokens.
void roll_tokens_case(const Exec& ex) {
  for (auto [n, shift] : {std::pair<int64_t, int64_t>{0, 1}, {1, 1}, {15, 3}, {15, 0}, {64, 16},
                          {10, 12}, {1000, 7}}) {
    BACKEND_TRACE("n=" << n << " shift=" << shift);
    std::vector<int32_t> in(n);
    for (int64_t i = 0; i < n; ++i) in[i] = i % 5 == 3 ? -1 : static_cast<int32_t>(i * 7 % 101);
    for (int32_t fill : {0, -1}) {
      const bool count = fill < 0;
      std::vector<int32_t> want(n);
      int64_t counted_ref = -1;
      ops::roll_tokens_ref(want.data(), count ? &counted_ref : nullptr, in.data(), n, shift, fill);
      Guarded<int32_t> out(n, -7);
      Guarded<int64_t> counted(1, -3);
      Staging st(ex);
      ops::roll_tokens(ex, st.out(out), count ? st.out(counted) : DevPtr<int64_t>(nullptr),
                       st.in(in), n, shift, fill);
      st.back();
      expect_bitwise(out, want.data(), "out");
      if (count) expect_bitwise(counted, &counted_ref, "counted");
    }
  }
}

float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}

// Ties (both parities, both signs), carries into the exponent, FLT_MAX -> inf, +-inf, quiet and
// signalling NaNs (payload only in the low bits, all-ones payload, negative), +-0, denormals.
const uint32_t kSpecialBits[] = {
    0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf808000u, 0xbf818000u,
    0x3fffffffu, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xff800001u,
    0x7fffffffu, 0x00000000u, 0x80000000u, 0x00000001u, 0x00018000u, 0x00008000u, 0x807fffffu};

std::vector<float> cast_inputs(int64_t n, uint32_t seed) {
  auto x = random_vec<float>(n, seed, -1e3, 1e3);
  for (int64_t i = 0; i < n && i < int64_t(std::size(kSpecialBits)); ++i) {
    x[i * 3 % n] = from_bits(kSpecialBits[i]);
  }
  return x;
}

// Every cast is exact given the rounding rule: bitwise (NaN payloads included).
void cast_case(const Exec& ex) {
  uint32_t seed = 80;
  for (int64_t n : kSizes) {
    BACKEND_TRACE("n=" << n);
    const auto x = cast_inputs(n, seed++);
    std::vector<bf16> y_ref(n);
    ops::cast_f32_to_bf16_ref(y_ref.data(), x.data(), n);
    std::vector<float> r_ref(n);
    ops::round_f32_to_bf16_ref(r_ref.data(), x.data(), n);
    Guarded<uint16_t> y(n);
    Guarded<float> r = nan_out<float>(n), in_place = guarded(x);
    Staging st(ex);
    ops::cast_f32_to_bf16(ex, as_bf16(st.out(y)), st.in(x), n);
    ops::round_f32_to_bf16(ex, st.out(r), st.in(x), n);
    float* in_place_d = st.out(in_place);
    ops::round_f32_to_bf16(ex, in_place_d, in_place_d, n);
    st.back();
    expect_bitwise(y, reinterpret_cast<const uint16_t*>(y_ref.data()), "f32 -> bf16");
    expect_bitwise(r, r_ref.data(), "round f32 to bf16 values");
    expect_bitwise(in_place, r_ref.data(), "round in place");
  }
  // bf16 -> f32 over every bit pattern.
  std::vector<bf16> all(1 << 16);
  for (int64_t i = 0; i < (1 << 16); ++i) all[i].bits = static_cast<uint16_t>(i);
  std::vector<float> w_ref(all.size());
  ops::cast_bf16_to_f32_ref(w_ref.data(), all.data(), 1 << 16);
  Guarded<float> w = nan_out<float>(1 << 16);
  Staging st(ex);
  ops::cast_bf16_to_f32(ex, st.out(w), st.in(all), 1 << 16);
  st.back();
  expect_bitwise(w, w_ref.data(), "bf16 -> f32, all 65536 patterns");
}

// f64 sums against the long double reference: the bound of tests/ops/test_sum_squares.cpp,
// 1e-13 relative (f64 summation over n non-negative terms: about log2(n) + 32 roundings of
// 2^-53), tighter than kF64Rtol; exact on small integers.
template <typename T>
void sum_squares_one(const Exec& ex) {
  constexpr double kSumSquaresRtol = 1e-13;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1} << 14,
                    (int64_t{1} << 18) + 7}) {
    BACKEND_TRACE(dtype_name<T>() << " n=" << n);
    const auto x = random_vec<T>(n, 9, -3.0, 3.0);
    double want = -1;
    ops::sum_squares_ref(&want, x.data(), n);
    Guarded<double> got(1, -1.0);
    Staging st(ex);
    ops::sum_squares<T>(ex, st.out(got), st.in(x), n);
    st.back();
    expect_close(got, &want, "sum of squares", kSumSquaresRtol, 0.0);
  }
  std::vector<T> small = {1, -2, 3, 4};
  Guarded<double> got(1, -1.0);
  const double want = 30.0;
  Staging st(ex);
  ops::sum_squares<T>(ex, st.out(got), st.in(small), 4);
  st.back();
  expect_bitwise(got, &want, "small integers: exact");
}

// Over ranges (the distributed optimizer's owned shards): empty ranges, one across a block
// boundary; the bound of sum_squares_one; one range gives sum_squares' bits.
template <typename T>
void sum_squares_ranges_one(const Exec& ex) {
  constexpr double kSumSquaresRtol = 1e-13;
  const int64_t n = (int64_t{1} << 15) + 100;
  const auto x = random_vec<T>(n, 11, -2.0, 2.0);
  const std::vector<ops::ElemRange> ranges = {{5, 0},
                                              {7, 31},
                                              {100, (int64_t{1} << 14) + 9},
                                              {int64_t{1} << 15, 0},
                                              {(int64_t{1} << 15) + 1, 99}};
  BACKEND_TRACE(dtype_name<T>() << " " << ranges.size() << " ranges");
  double want = -1;
  ops::sum_squares_ranges_ref(&want, x.data(), ranges.data(),
                              static_cast<int64_t>(ranges.size()));
  // The ranges stay a host list (ops/sum_squares.h).
  Guarded<double> got(1, -1.0);
  Staging st(ex);
  const T* x_d = st.in(x);
  ops::sum_squares_ranges<T>(ex, st.out(got), x_d, ranges.data(),
                             static_cast<int64_t>(ranges.size()));
  st.back();
  expect_close(got, &want, "sum of squares over ranges", kSumSquaresRtol, 0.0);
  const ops::ElemRange all{3, n - 3};
  Guarded<double> whole(1, -1.0), one(1, -2.0);
  ops::sum_squares<T>(ex, st.out(whole), x_d + 3, n - 3);
  ops::sum_squares_ranges<T>(ex, st.out(one), x_d, &all, 1);
  st.back();
  expect_bitwise(one, whole.data(), "one range == sum_squares");
}

// Three steps from zero moments, weight decay on and off, grad_scale. The fast path works in T
// with folded constants, the reference in f64 with m, v rounded to f32: both dtypes compare with
// the f32 tolerance, as tests/ops/test_adamw.cpp (the moments are f32 either way).
template <typename T>
void adamw_one(const Exec& ex) {
  uint32_t seed = 90;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, (int64_t{1} << 14) + 7}) {
    for (double wd : {0.0, 0.1}) {
      BACKEND_TRACE(dtype_name<T>() << " n=" << n << " wd=" << wd);
      ops::AdamWParams a;
      ops::AdamWStep st;  // staged each step, as the trainer's planned step buffer
      st.lr = 3e-3;
      a.beta2 = 0.95;
      a.weight_decay = wd;
      st.grad_scale = std::is_same_v<T, float> ? 1.0 : 0.5;
      const auto p0 = random_vec<T>(n, seed++);
      Guarded<T> p = guarded(p0);
      Guarded<float> m(n, 0.f), v(n, 0.f);
      std::vector<T> p_ref = p0;
      std::vector<float> m_ref(n, 0.f), v_ref(n, 0.f);
      // p, m, v stay in the backend's memory across the steps; g and the step's scalars are
      // staged per step (their host buffers change).
      Staging state(ex);
      T* p_d = state.out(p);
      float* m_d = state.out(m);
      float* v_d = state.out(v);
      for (int64_t step = 1; step <= 3; ++step) {
        st.step = step;
        const auto g = random_vec<T>(n, seed++, -2.0, 2.0);
        Staging per_step(ex);
        ops::adamw_step<T>(ex, p_d, per_step.in(g), m_d, v_d, n, a, per_step.in(&st, 1));
        ops::adamw_step_ref<T>(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, a, st);
      }
      state.back();
      expect_close(m, m_ref.data(), "m", testing::kF32Rtol, testing::kF32Atol);
      expect_close(v, v_ref.data(), "v", testing::kF32Rtol, testing::kF32Atol);
      expect_close(p, p_ref.data(), "p", testing::kF32Rtol, testing::kF32Atol);
    }
  }
}

// The bf16 copies (p16, p16w, either or both): bitwise the cast / rounding of the updated p,
// which itself matches the reference; writing them changes nothing else. A rounding tie in p.
void adamw_bf16_copies(const Exec& ex) {
  uint32_t seed = 120;
  for (int64_t n : {int64_t{1}, int64_t{37}, (int64_t{1} << 14) + 7}) {
    ops::AdamWParams a;
    ops::AdamWStep st;
    st.lr = 3e-3;
    a.weight_decay = 0.1;
    auto p0 = random_vec<float>(n, seed++);
    if (n > 1) p0[1] = 1.0f + std::ldexp(1.0f, -8);
    for (int form = 0; form < 3; ++form) {  // p16; p16w; both
      BACKEND_TRACE("n=" << n << " form=" << (form == 0 ? "p16" : form == 1 ? "p16w" : "both"));
      Guarded<float> p = guarded(p0), m(n, 0.f), v(n, 0.f), p16w(n, -1.f);
      Guarded<uint16_t> p16(n);
      std::vector<float> p_ref = p0, m_ref(n, 0.f), v_ref(n, 0.f);
      Staging state(ex);  // as adamw_one
      float* p_d = state.out(p);
      float* m_d = state.out(m);
      float* v_d = state.out(v);
      bf16* p16_d = form != 1 ? as_bf16(state.out(p16)) : nullptr;
      float* p16w_d = form != 0 ? state.out(p16w) : nullptr;
      for (int64_t step = 1; step <= 2; ++step) {
        st.step = step;
        const auto g = random_vec<float>(n, 200 + static_cast<uint32_t>(step), -2.0, 2.0);
        Staging per_step(ex);
        ops::adamw_step<float>(ex, p_d, per_step.in(g), m_d, v_d, n, a, per_step.in(&st, 1),
                               p16_d, p16w_d);
        ops::adamw_step_ref<float>(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, a, st);
      }
      state.back();
      expect_close(p, p_ref.data(), "p", testing::kF32Rtol, testing::kF32Atol);
      expect_close(m, m_ref.data(), "m", testing::kF32Rtol, testing::kF32Atol);
      expect_close(v, v_ref.data(), "v", testing::kF32Rtol, testing::kF32Atol);
      const std::vector<bf16> p16_want = to_bf16(p.vec());
      const std::vector<float> p16w_want = bf16_rounded(p.vec());
      if (form != 1) {
        expect_bitwise(p16, reinterpret_cast<const uint16_t*>(p16_want.data()), "p16");
      }
      if (form != 0) expect_bitwise(p16w, p16w_want.data(), "p16w");
    }
  }
}

}  // namespace

void add_elementwise_cases(std::vector<OpCase>& out) {
  out.push_back({"swiglu_f32", {"swiglu_forward", "swiglu_backward"}, swiglu_case<float>});
  out.push_back({"swiglu_f64", {"swiglu_forward", "swiglu_backward"}, swiglu_case<double>});
  out.push_back({"swiglu_bf16",
                 {"swiglu_forward", "swiglu_backward", "swiglu_forward_bf16",
                  "swiglu_backward_bf16", "swiglu_forward_bf16w", "swiglu_backward_bf16w"},
                 swiglu_bf16_case});
  out.push_back({"activation_f32", {"activation_forward", "activation_backward"},
                 activation_case<float>});
  out.push_back({"activation_f64", {"activation_forward", "activation_backward"},
                 activation_case<double>});
  out.push_back({"activation_bf16",
                 {"activation_forward", "activation_backward", "activation_forward_bf16",
                  "activation_backward_bf16", "activation_forward_bf16w",
                  "activation_backward_bf16w"},
                 activation_bf16_case});
  out.push_back({"rmsnorm_forward_f32", {"rmsnorm_forward"}, rmsnorm_case<float, false>});
  out.push_back({"rmsnorm_forward_f64", {"rmsnorm_forward"}, rmsnorm_case<double, false>});
  out.push_back(
      {"rmsnorm_f32", {"rmsnorm_forward", "rmsnorm_backward"}, rmsnorm_case<float, true>});
  out.push_back(
      {"rmsnorm_f64", {"rmsnorm_forward", "rmsnorm_backward"}, rmsnorm_case<double, true>});
  out.push_back(
      {"rmsnorm_forward_bf16w", {"rmsnorm_forward", "rmsnorm_forward_bf16w"}, rmsnorm_bf16w_case});
  out.push_back(
      {"layernorm_f32", {"layernorm_forward", "layernorm_backward"}, layernorm_case<float>});
  out.push_back(
      {"layernorm_f64", {"layernorm_forward", "layernorm_backward"}, layernorm_case<double>});
  out.push_back({"layernorm_forward_bf16w",
                 {"layernorm_forward", "layernorm_forward_bf16w"},
                 layernorm_bf16w_case});
  out.push_back({"add", {"add"}, [](const Exec& ex) {
                   add_one<float>(ex);
                   add_one<double>(ex);
                   add_one<int64_t>(ex);
                 }});
  out.push_back({"bias", {"bias_forward", "bias_backward"}, [](const Exec& ex) {
                   bias_one<float>(ex);
                   bias_one<double>(ex);
                 }});
  out.push_back({"grouped_bias", {"grouped_bias_forward", "grouped_bias_backward"},
                 [](const Exec& ex) {
                   grouped_bias_one<float>(ex);
                   grouped_bias_one<double>(ex);
                 }});
  out.push_back({"qkv_layout", {"split_qkv", "fuse_qkv"}, [](const Exec& ex) {
                   qkv_one<float>(ex);
                   qkv_one<double>(ex);
                 }});
  out.push_back({"sequence_positions", {"sequence_positions"}, [](const Exec& ex) {
                   for (auto [n, B] : {std::pair<int64_t, int64_t>{0, 1}, {1, 1}, {12, 3},
                                       {13, 4}, {70000, 8}}) {
                     BACKEND_TRACE("n=" << n << " B=" << B);
                     std::vector<int32_t> want(n);
                     ops::sequence_positions_ref(want.data(), n, B);
                     Guarded<int32_t> pos(n, -7);
                     Staging st(ex);
                     ops::sequence_positions(ex, st.out(pos), n, B);
                     st.back();
                     expect_bitwise(pos, want.data(), "positions");
                   }
                 }});
  out.push_back({"roll_tokens", {"roll_tokens"}, roll_tokens_case});
  out.push_back({"tokens_to_sequence_major_ignored_targets",
                 {"tokens_to_sequence_major"},
                 token_layout_case});
  out.push_back({"cast_bf16_specials",
                 {"cast_f32_to_bf16", "cast_bf16_to_f32", "round_f32_to_bf16"},
                 cast_case});
  out.push_back({"sum_squares", {"sum_squares"}, [](const Exec& ex) {
                   sum_squares_one<float>(ex);
                   sum_squares_one<double>(ex);
                 }});
  out.push_back({"sum_squares_ranges", {"sum_squares_ranges"}, [](const Exec& ex) {
                   sum_squares_ranges_one<float>(ex);
                   sum_squares_ranges_one<double>(ex);
                 }});
  out.push_back({"adamw", {"adamw_step"}, [](const Exec& ex) {
                   adamw_one<float>(ex);
                   adamw_one<double>(ex);
                 }});
  out.push_back({"adamw_bf16_copies", {"adamw_step"}, adamw_bf16_copies});
}

}  // namespace moecore::backend_test
