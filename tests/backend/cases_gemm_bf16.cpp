// Cases: the bf16 GEMMs (gemm_bf16, linear_*_bf16, grouped_gemm_bf16, grouped_gemm_wgrad_bf16)
// and the bf16 head (head_loss_bf16, below), against the f32 plain loops on the same bf16
// values, as tests/ops/test_gemm_bf16.cpp: both sides multiply the same bf16 inputs and
// accumulate in f32 / f64, so only the summation order differs and the tolerance is the f32 one
// (docs/numerics.md, "bf16 GEMM vs loop"). On the CPU each case runs on every bf16 GEMM path
// that exists here (widen always, native from AVX-512 up); workspaces are planned after the path
// is set and NaN-filled, so reading workspace the path did not write shows.
#include <omp.h>
#include <algorithm>
#include <cmath>

#include <cstdio>
#include <random>

#include "common/bf16_gemm_paths.h"
#include "backend_case.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::backend_test {
namespace {

using ops::Bf16GemmPath;
using ops::gemm_ref;

// Runs `body` once per bf16 GEMM path available here, restoring the process's choice.
void on_each_path(const std::function<void()>& body) {
  testing::for_each_bf16_gemm_path(
      [&](Bf16GemmPath path) {
        BACKEND_TRACE("bf16 path " << ops::bf16_gemm_path_name(path));
        body();
      },
      {Bf16GemmPath::Widen, Bf16GemmPath::Native});
}

Guarded<float> nan_ws(int64_t n) {
  return nan_out<float>(n);
}

void gemm_bf16_case(const Exec& ex) {
  on_each_path([&] {
    struct Shape {
      int64_t M, N, K;
    };
    uint32_t seed = 1;
    for (Shape s : {Shape{1, 1, 1}, Shape{7, 13, 5}, Shape{33, 17, 129}, Shape{64, 48, 96}}) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          for (float beta : {0.f, 1.f}) {
            BACKEND_TRACE("M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta
                               << " tb=" << tb << " beta=" << beta);
            const int64_t lda = (ta ? s.M : s.K) + 3, ldb = (tb ? s.K : s.N) + 2, ldc = s.N + 1;
            const auto A = to_bf16(random_vec<float>((ta ? s.K : s.M) * lda, seed++));
            const auto B = to_bf16(random_vec<float>((tb ? s.N : s.K) * ldb, seed++));
            const auto C0 = random_vec<float>(s.M * ldc, seed++);
            Guarded<float> c = guarded(C0);
            std::vector<float> c_ref = C0;
            Guarded<float> ws = nan_ws(ops::gemm_bf16_workspace_elems(ex, s.M, s.N, s.K));
            {
              Staging st(ex);
              ops::gemm_bf16(ex, ta, tb, s.M, s.N, s.K, st.in(A), lda, st.in(B), ldb, beta,
                             st.out(c), ldc, st.out(ws));
              st.back();
            }
            ops::gemm_bf16_ref(ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, beta,
                               c_ref.data(), ldc);
            expect_close(c, c_ref.data(), "C (padding columns included)");
            expect_intact(ws, "ws32");
            if (ta == 0 && tb == 1 && beta == 0.f) {
              // The weight operand given already widened (b32): the same C, bitwise.
              std::vector<float> B32(B.size());
              ops::cast_bf16_to_f32_ref(B32.data(), B.data(), static_cast<int64_t>(B.size()));
              Guarded<float> c32 = guarded(C0);
              {
                Staging st(ex);
                ops::gemm_bf16(ex, ta, tb, s.M, s.N, s.K, st.in(A), lda, st.in(B), ldb, beta,
                               st.out(c32), ldc, st.out(ws), st.in(B32));
                st.back();
              }
              expect_bitwise(c32, c, "C with b32");
            }
          }
        }
      }
    }
  });
}

// linear_forward_bf16 / linear_backward_bf16 vs gemm_ref on the rounded values; the widened
// weight (w32) and pre-rounded x (x_rounded) forms give the same results bitwise; dx may be null.
void linear_bf16_case(const Exec& ex) {
  on_each_path([&] {
    struct Shape {
      int64_t M, N, K;
    };
    uint32_t seed = 100;
    for (Shape s : {Shape{1, 1, 1}, Shape{19, 24, 40}, Shape{23, 16, 37}}) {
      const auto [M, N, K] = s;
      BACKEND_TRACE("M=" << M << " N=" << N << " K=" << K);
      const auto x = random_vec<float>(M * K, seed++), w = random_vec<float>(N * K, seed++);
      const auto dy = random_vec<float>(M * N, seed++), dw0 = random_vec<float>(N * K, seed++);
      const auto w16 = to_bf16(w);
      const auto xr = bf16_rounded(x), wr = bf16_rounded(w), dyr = bf16_rounded(dy);
      std::vector<float> y_ref(M * N), dx_ref(M * K), dw_ref = dw0;
      gemm_ref<float>(false, true, M, N, K, 1.f, xr.data(), K, wr.data(), K, 0.f, y_ref.data(), N);
      gemm_ref<float>(false, false, M, K, N, 1.f, dyr.data(), N, wr.data(), K, 0.f, dx_ref.data(),
                      K);
      gemm_ref<float>(true, false, N, K, M, 1.f, dyr.data(), N, xr.data(), K, 1.f, dw_ref.data(),
                      K);
      Guarded<float> ws = nan_ws(ops::linear_bf16_workspace_elems(ex, M, N, K));
      Guarded<uint16_t> x16(M * K), dy16(M * N);
      Guarded<float> y = nan_out<float>(M * N), dx = nan_out<float>(M * K), dw = guarded(dw0);
      {
        Staging st(ex);
        ops::linear_forward_bf16(ex, st.out(y), st.in(x), st.in(w16), M, N, K, as_bf16(st.out(x16)),
                                 st.out(ws));
        ops::linear_backward_bf16(ex, st.out(dx), st.out(dw), st.in(dy), st.in(x), st.in(w16), M, N,
                                  K, as_bf16(st.out(dy16)), as_bf16(st.out(x16)), st.out(ws));
        st.back();
      }
      expect_close(y, y_ref.data(), "y");
      expect_close(dx, dx_ref.data(), "dx");
      expect_close(dw, dw_ref.data(), "dw (accumulated)");
      for (auto* g : {&x16, &dy16}) expect_intact(*g, "x16 / dy16");
      expect_intact(ws, "ws32");

      std::vector<float> w32(N * K);
      ops::cast_bf16_to_f32_ref(w32.data(), w16.data(), N * K);
      for (int form = 0; form < 3; ++form) {  // w32; x_rounded; both
        BACKEND_TRACE("form " << (form == 0 ? "w32" : form == 1 ? "x_rounded" : "w32+x_rounded"));
        const float* wide = form == 1 ? nullptr : w32.data();
        const bool x_rounded = form >= 1;
        const std::vector<float>& x_in = x_rounded ? xr : x;
        Guarded<float> y2 = nan_out<float>(M * N), dx2 = nan_out<float>(M * K), dw2 = guarded(dw0);
        {
          Staging st(ex);
          ops::linear_forward_bf16(ex, st.out(y2), st.in(x_in), st.in(w16), M, N, K,
                                   as_bf16(st.out(x16)), st.out(ws), st.in_or_null(wide, N * K),
                                   x_rounded);
          ops::linear_backward_bf16(ex, st.out(dx2), st.out(dw2), st.in(dy), st.in(x_in),
                                    st.in(w16), M, N, K, as_bf16(st.out(dy16)),
                                    as_bf16(st.out(x16)), st.out(ws), st.in_or_null(wide, N * K),
                                    x_rounded);
          st.back();
        }
        expect_bitwise(y2, y, "y");
        expect_bitwise(dx2, dx, "dx");
        expect_bitwise(dw2, dw, "dw");
      }
      Guarded<float> dw3 = guarded(dw0);
      {
        Staging st(ex);
        ops::linear_backward_bf16(ex, nullptr, st.out(dw3), st.in(dy), st.in(x), st.in(w16), M, N,
                                  K, as_bf16(st.out(dy16)), as_bf16(st.out(x16)), st.out(ws));
        st.back();
      }
      expect_close(dw3, dw_ref.data(), "dw without dx");
    }
  });
}

const std::vector<std::vector<int64_t>> kBf16Groups = {
    {0, 9, 11, 0, 8}, {0, 30, 1, 0, 0}, {0, 0, 0, 0, 0}, {7}, {3, 1, 4, 1, 5, 9, 2, 6}};

int64_t rows_of(const std::vector<int64_t>& m) {
  int64_t r = 0;
  for (int64_t v : m) r += v;
  return r;
}

void grouped_bf16_case(const Exec& ex) {
  on_each_path([&] {
    const int64_t N = 20, K = 36;
    uint32_t seed = 200;
    for (const auto& m : kBf16Groups) {
      const int64_t G = static_cast<int64_t>(m.size()), rows = rows_of(m);
      const auto x = random_vec<float>(rows * K, seed++), w = random_vec<float>(G * N * K, seed++);
      const auto x16 = to_bf16(x), w16 = to_bf16(w);
      const auto xr = bf16_rounded(x), wr = bf16_rounded(w);
      std::vector<float> w32(G * N * K);
      ops::cast_bf16_to_f32_ref(w32.data(), w16.data(), G * N * K);
      for (bool trans_w : {false, true}) {
        BACKEND_TRACE("G=" << G << " rows=" << rows << " trans_w=" << trans_w);
        std::vector<float> y_ref(rows * N);
        ops::grouped_gemm_ref<float>(m.data(), G, N, K, xr.data(), wr.data(), trans_w,
                                     y_ref.data());
        Guarded<float> ws =
            nan_ws(ops::grouped_gemm_bf16_workspace_elems(ex, rows, N, K, omp_get_max_threads()));
        Guarded<float> y = nan_out<float>(rows * N), y32 = nan_out<float>(rows * N);
        {
          Staging st(ex);
          const StagedGroupedWorkspace gws(ex, st, G);
          ops::grouped_gemm_bf16(ex, st.in(m), G, N, K, st.in(x16), st.in(w16), trans_w, st.out(y),
                                 st.out(ws), nullptr, {gws.data, gws.bytes});
          ops::grouped_gemm_bf16(ex, st.in(m), G, N, K, st.in(x16), st.in(w16), trans_w,
                                 st.out(y32), st.out(ws), st.in(w32), {gws.data, gws.bytes});
          st.back();
        }
        expect_close(y, y_ref.data(), "y");
        expect_bitwise(y32, y, "y with w32");
        expect_intact(ws, "ws32");
      }
    }
  });
}

// The bf16-output forms (fc1's h under --bf16): bitwise grouped_gemm_bf16 (widened: the f32
// grouped_gemm on the widened values), grouped_bias_forward and cast_f32_to_bf16 on the same
// context, with and without the bias; the plain loop within a bf16 step. At N and K that the
// device tables take (multiples of 8) and with every group's rows known (rows_per_group, the
// strided-batched form) too: there CUDA writes the bf16 D in the GEMM without a bias
// (desc::GemmTypes::Bf16Bf16), which leaves h32 as it was (asserted: the direct path ran).
void grouped_bf16_out_case(const Exec& ex) {
  on_each_path([&] {
    uint32_t seed = 250;
    struct Form {
      std::vector<int64_t> m;
      int64_t rows_per_group;
    };
    std::vector<Form> forms;
    for (const auto& m : kBf16Groups) forms.push_back({m, 0});
    forms.push_back({{6, 6, 6}, 6});
    for (const auto& [N, K] : {std::pair<int64_t, int64_t>{20, 36}, {24, 40}})
    for (const auto& [m, rpg] : forms) {
      const int64_t G = static_cast<int64_t>(m.size()), rows = rows_of(m);
      const auto x16 = to_bf16(random_vec<float>(rows * K, seed++));
      const auto w16 = to_bf16(random_vec<float>(G * N * K, seed++));
      const auto bias = random_vec<float>(G * N, seed++);
      std::vector<float> x32(rows * K), w32(G * N * K);
      ops::cast_bf16_to_f32_ref(x32.data(), x16.data(), rows * K);
      ops::cast_bf16_to_f32_ref(w32.data(), w16.data(), G * N * K);
      for (bool with_bias : {false, true}) {
        BACKEND_TRACE("N=" << N << " K=" << K << " G=" << G << " rows=" << rows
                           << " rows_per_group=" << rpg << " bias=" << with_bias);
        std::vector<bf16> ref(rows * N);
        ops::grouped_gemm_bf16_out_ref(m.data(), G, N, K, x16.data(), w16.data(), true,
                                       with_bias ? bias.data() : nullptr, ref.data());
        Guarded<float> ws =
            nan_ws(ops::grouped_gemm_bf16_workspace_elems(ex, rows, N, K, omp_get_max_threads()));
        Guarded<float> h32 = nan_out<float>(rows * N), h32w = nan_out<float>(rows * N),
                       f32 = nan_out<float>(rows * N), f32w = nan_out<float>(rows * N);
        const std::vector<float> poison(h32.data(), h32.data() + rows * N);
        Guarded<uint16_t> y(rows * N), yw(rows * N), want(rows * N), want_w(rows * N);
        {
          Staging st(ex);
          const StagedGroupedWorkspace gws(ex, st, G);
          const float* b = with_bias ? st.in(bias) : nullptr;
          // What fc1 ran before: the f32 products, the bias, the cast.
          const int64_t* m_d = st.in(m);
          float* f32_d = st.out(f32);
          float* f32w_d = st.out(f32w);
          ops::grouped_gemm_bf16(ex, m_d, G, N, K, st.in(x16), st.in(w16), true, f32_d, st.out(ws),
                                 nullptr, {gws.data, gws.bytes}, rpg);
          ops::grouped_gemm<float>(ex, m_d, G, N, K, st.in(x32), st.in(w32), true, f32w_d,
                                   {gws.data, gws.bytes}, rpg);
          if (with_bias) {
            ops::grouped_bias_forward<float>(ex, f32_d, b, nullptr, m_d, G, N);
            ops::grouped_bias_forward<float>(ex, f32w_d, b, nullptr, m_d, G, N);
          }
          ops::cast_f32_to_bf16(ex, as_bf16(st.out(want)), f32_d, rows * N);
          ops::cast_f32_to_bf16(ex, as_bf16(st.out(want_w)), f32w_d, rows * N);
          ops::grouped_gemm_bf16_out(ex, m_d, G, N, K, rows, st.in(x16), st.in(w16), true, b,
                                     as_bf16(st.out(y)), st.out(h32), st.out(ws), nullptr,
                                     {gws.data, gws.bytes}, rpg);
          ops::grouped_gemm_widened_bf16_out(ex, m_d, G, N, K, rows, st.in(x32), st.in(w32), true,
                                             b, as_bf16(st.out(yw)), st.out(h32w),
                                             {gws.data, gws.bytes}, rpg);
          st.back();
        }
        expect_bitwise(y, want, "h16");
        expect_bitwise(yw, want_w, "h16 (widened operands)");
        const bool direct = !ex.on_cpu() && !with_bias &&
                            (rpg > 0 || ops::grouped_gemm_device_bf16_output(N, K));
        if (direct && rows > 0) {
          EXPECT_TRUE(same_bits(h32.data(), poison.data(), rows * N))
              << "the bf16 D written in the GEMM leaves h32 as it was";
        }
        int bad = 0;
        for (int64_t i = 0; i < rows * N && bad < 5; ++i) {
          const float got = bf16_to_float(bf16{y[i]}), exp = bf16_to_float(ref[i]);
          if (std::abs(got - exp) > 0.0079f * std::abs(exp) + 1e-5f) {
            ADD_FAILURE() << "h16[" << i << "] " << got << " vs the loop's " << exp;
            ++bad;
          }
        }
      }
    }
  });
}

void grouped_wgrad_bf16_case(const Exec& ex) {
  on_each_path([&] {
    const int64_t N = 20, K = 36;
    uint32_t seed = 300;
    for (const auto& m : kBf16Groups) {
      const int64_t G = static_cast<int64_t>(m.size()), rows = rows_of(m);
      BACKEND_TRACE("G=" << G << " rows=" << rows);
      const auto x = random_vec<float>(rows * K, seed++), dy = random_vec<float>(rows * N, seed++);
      const auto dw0 = random_vec<float>(G * N * K, seed++);
      const auto x16 = to_bf16(x), dy16 = to_bf16(dy);
      const auto xr = bf16_rounded(x), dyr = bf16_rounded(dy);
      std::vector<float> dw_ref = dw0;
      ops::grouped_gemm_wgrad_ref<float>(m.data(), G, N, K, dyr.data(), xr.data(), dw_ref.data());
      Guarded<float> ws = nan_ws(ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, rows, N, K));
      Guarded<float> dw = guarded(dw0);
      {
        Staging st(ex);
        const StagedGroupedWorkspace gws(ex, st, G);
        ops::grouped_gemm_wgrad_bf16(ex, st.in(m), G, N, K, st.in(dy16), st.in(x16), st.out(dw),
                                     st.out(ws), {gws.data, gws.bytes});
        st.back();
      }
      expect_close(dw, dw_ref.data(), "dw (accumulated)");
      expect_intact(ws, "ws32");
    }
  });
}

// The --bf16 head (ops/cross_entropy.h, HeadLossBf16), both operand forms, as
// HeadLoss.Bf16PathUsesTheRoundedF32Gradient: on h, W in {-1, -1/2, 0, 1/2, 1} the logits are
// exact in the f32 and the bf16 GEMMs, so the bf16 forward equals the backend's f32 head
// (head_loss_f32 checks that one against the reference) bitwise, and the backward is the bf16
// GEMMs of exactly bf16(the f32 head's dlogits), which the f32 head leaves in its workspace when
// one chunk holds every token: f32 accumulation against f64 sums of the same products. h's bf16
// form (h16 / h32) is the cast of h, bitwise.
void head_loss_bf16_case(const Exec& ex) {
  on_each_path([&] {
    const int64_t H = 8, V = 300;
    for (int64_t T : {int64_t{13}, int64_t{64}}) {  // 64 x 300 takes the parallel branch
      std::mt19937 gen(21);
      auto pick = [&] { return 0.5f * static_cast<float>(static_cast<int>(gen() % 5) - 2); };
      std::vector<float> h(T * H), w(V * H);
      for (auto& x : h) x = pick();
      for (auto& x : w) x = pick();
      std::vector<int32_t> tg(T);
      for (int64_t t = 0; t < T; ++t) tg[t] = t % 5 == 1 ? -1 : static_cast<int32_t>(gen() % V);
      const float dloss = 0.375f;
      const ops::HeadLossShape s32{T, H, V, T};
      Guarded<float> loss(T), lse(T), ws(ops::head_loss_workspace_elems(s32)), dh(T * H),
          dw(V * H, 0.f);
      Guarded<double> total(1, 0.0);
      {
        Staging st(ex);
        ops::head_loss_forward<float>(ex, st.out(total), st.out(loss), st.out(lse), st.in(h),
                                      st.in(w), st.in(tg), s32, st.out(ws));
        ops::head_loss_backward<float>(ex, st.out(dh), st.out(dw), st.in(h), st.in(w), st.in(tg),
                                       st.in(lse), st.in(&dloss, 1), s32, st.out(ws));
        st.back();
      }
      std::vector<double> dh_want(T * H, 0.0), dw_want(V * H, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t v = 0; v < V; ++v) {
          const double dz = bf16_to_float(float_to_bf16(ws[t * V + v]));
          for (int64_t k = 0; k < H; ++k) {
            dh_want[t * H + k] += dz * w[v * H + k];
            dw_want[v * H + k] += dz * h[t * H + k];
          }
        }
      }
      const auto w16 = to_bf16(w), h16_want = to_bf16(h);
      const auto w32 = bf16_rounded(w), h32_want = bf16_rounded(h);
      const ops::HeadLossShape s16{T, H, V, 16};  // chunks of 16: the last one partial
      for (bool widened : {false, true}) {
        BACKEND_TRACE("T=" << T << (widened ? " widened operands" : " bf16 operands"));
        Guarded<uint16_t> h16(T * H), dz16(ops::head_loss_workspace_elems(s16));
        Guarded<float> ws32 = nan_ws(ops::head_loss_bf16_workspace_elems(ex, s16));
        Guarded<float> h32 = nan_out<float>(T * H);
        Guarded<float> loss16 = nan_out<float>(T), lse16 = nan_out<float>(T),
                       ws16 = nan_ws(ops::head_loss_workspace_elems(s16)),
                       dh16 = nan_out<float>(T * H), dw16(V * H, 0.f);
        Guarded<double> total16(1, 0.0);
        {
          Staging st(ex);
          ops::HeadLossBf16 b;
          if (widened) {
            b = ops::HeadLossBf16{.w_VH_wide = st.in(w32), .h32 = st.out(h32)};
          } else {
            b = ops::HeadLossBf16{st.in(w16), as_bf16(st.out(h16)), as_bf16(st.out(dz16)),
                                  st.out(ws32)};
          }
          ops::head_loss_forward<float>(ex, st.out(total16), st.out(loss16), st.out(lse16),
                                        st.in(h), st.in(w), st.in(tg), s16, st.out(ws16), &b);
          ops::head_loss_backward<float>(ex, st.out(dh16), st.out(dw16), st.in(h), st.in(w),
                                         st.in(tg), st.in(lse16), st.in(&dloss, 1), s16,
                                         st.out(ws16), &b);
          st.back();
        }
        EXPECT_EQ(total16[0], total[0]) << "total loss";
        expect_bitwise(loss16, loss, "loss_T");
        expect_bitwise(lse16, lse, "lse_T");
        expect_close(dh16, dh_want.data(), "dh");
        expect_close(dw16, dw_want.data(), "dw");
        if (widened) {
          expect_bitwise(h32, h32_want.data(), "h32");
        } else {
          expect_bitwise(h16, reinterpret_cast<const uint16_t*>(h16_want.data()), "h16");
          expect_intact(dz16, "dz16");
          expect_intact(ws32, "ws32");
        }
        expect_intact(ws16, "workspace");
      }
    }
  });
}

// The context's path and the workspace it plans: the CPU's process-wide choice with the widen
// path's f32 operands, none on the native path; a device backend takes bf16 operands natively
// (no workspace, whatever the host chose).
void bf16_gemm_path_case(const Exec& ex) {
  on_each_path([&] {
    const Bf16GemmPath want = ex.on_cpu() ? ops::bf16_gemm_path() : Bf16GemmPath::Native;
    EXPECT_EQ(ops::bf16_gemm_path(ex), want);
    const bool widen = want == Bf16GemmPath::Widen;
    const int64_t M = 7, N = 13, K = 5;
    EXPECT_EQ(ops::gemm_bf16_workspace_elems(ex, M, N, K), widen ? M * K + K * N : 0);
    EXPECT_EQ(ops::linear_bf16_workspace_elems(ex, M, N, K),
              widen ? std::max(M * K + N * K, M * N + std::max(N * K, M * K)) : 0);
    EXPECT_EQ(ops::grouped_gemm_bf16_workspace_elems(ex, M, N, K, 3),
              widen ? M * K + 3 * N * K : 0);
    EXPECT_EQ(ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, M, N, K), widen ? M * (N + K) : 0);
    const ops::HeadLossShape s{M, K, N, 4};
    EXPECT_EQ(ops::head_loss_bf16_workspace_elems(ex, s),
              widen ? std::max({4 * K + K * N, 4 * N + N * K, N * 4 + 4 * K}) : 0);
  });
}

}  // namespace

void add_gemm_bf16_cases(std::vector<OpCase>& out) {
  out.push_back({"gemm_bf16", {"gemm_bf16"}, gemm_bf16_case});
  out.push_back({"linear_bf16", {"linear_forward_bf16", "linear_backward_bf16"}, linear_bf16_case});
  out.push_back({"grouped_gemm_bf16", {"grouped_gemm_bf16"}, grouped_bf16_case});
  out.push_back({"grouped_gemm_bf16_out",
                 {"grouped_gemm_bf16_out", "grouped_gemm_widened_bf16_out",
                  "grouped_bias_round_bf16"},
                 grouped_bf16_out_case});
  out.push_back({"grouped_gemm_wgrad_bf16", {"grouped_gemm_wgrad_bf16"}, grouped_wgrad_bf16_case});
  out.push_back(
      {"head_loss_bf16", {"head_loss_forward", "head_loss_backward"}, head_loss_bf16_case});
  out.push_back({"bf16_gemm_path",
                 {"bf16_gemm_path", "gemm_bf16_workspace_elems", "linear_bf16_workspace_elems",
                  "grouped_gemm_bf16_workspace_elems", "grouped_gemm_wgrad_bf16_workspace_elems",
                  "head_loss_bf16_workspace_elems"},
                 bf16_gemm_path_case});
}

}  // namespace moecore::backend_test
