// add, bias (plain and grouped) and the QKV layout: fast == reference (bitwise where the op is
// exact: add, the bias forward, the QKV copies; the bias backwards within f32 rounding of the
// f64-accumulating reference, and bitwise at any thread count), serial and OpenMP sizes, guard
// bytes, aliasing, finite differences of the bias backwards.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/add.h"
#include "ops/bias.h"
#include "ops/qkv_layout.h"
#include "ops/token_layout.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::Guarded;
using moecore::testing::kF32Atol;
using moecore::testing::kF32Rtol;
using moecore::testing::random_vec;

TEST(Add, FastEqualsRefAndAliasesEitherInput) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}, (int64_t{1} << 16) + 5}) {
    SCOPED_TRACE(n);
    auto a = random_vec<float>(n, 1), b = random_vec<float>(n, 2);
    Guarded<float> y(n), y_ref(n);
    add<float>(cpu_exec(), y.data(), a.data(), b.data(), n);
    add_ref(y_ref.data(), a.data(), b.data(), n);
    EXPECT_EQ(y.vec(), y_ref.vec());
    EXPECT_TRUE(y.intact() && y_ref.intact());
    std::vector<float> in_a = a, in_b = b;
    add<float>(cpu_exec(), in_a.data(), in_a.data(), b.data(), n);  // y is a
    add<float>(cpu_exec(), in_b.data(), a.data(), in_b.data(), n);  // y is b
    EXPECT_EQ(in_a, y_ref.vec());
    EXPECT_EQ(in_b, y_ref.vec());
  }
  auto a = random_vec<double>(5, 3), b = random_vec<double>(5, 4);
  std::vector<double> y(5);
  add<double>(cpu_exec(), y.data(), a.data(), b.data(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(y[i], a[i] + b[i]);
}

TEST(Bias, ForwardExactBackwardAccurateAndThreadInvariant) {
  struct Shape {
    int64_t M, N;
  };
  for (Shape s : {Shape{0, 3}, Shape{1, 1}, Shape{13, 7}, Shape{300, 70}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << s.M << " N=" << s.N);
    auto y0 = random_vec<float>(s.M * s.N, 5), b = random_vec<float>(s.N, 6);
    Guarded<float> y(s.M * s.N), y_ref(s.M * s.N);
    for (int64_t i = 0; i < s.M * s.N; ++i) y[i] = y_ref[i] = y0[i];
    bias_forward<float>(cpu_exec(), y.data(), b.data(), s.M, s.N);
    bias_forward_ref(y_ref.data(), b.data(), s.M, s.N);
    EXPECT_EQ(y.vec(), y_ref.vec());
    auto db0 = random_vec<float>(s.N, 7);  // the gradient accumulates
    std::vector<float> by_threads[2];
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      Guarded<float> db(s.N);
      for (int64_t i = 0; i < s.N; ++i) db[i] = db0[i];
      bias_backward<float>(cpu_exec(), db.data(), y0.data(), s.M, s.N);
      EXPECT_TRUE(db.intact());
      by_threads[threads - 1] = db.vec();
    }
    omp_set_num_threads(1);
    EXPECT_EQ(by_threads[0], by_threads[1]) << "1 vs 2 threads";
    std::vector<float> db_ref = db0;
    bias_backward_ref(db_ref.data(), y0.data(), s.M, s.N);
    EXPECT_TRUE(all_close(by_threads[0], db_ref, kF32Rtol * (1 + s.M), kF32Atol * (1 + s.M)));
  }
}

// f64 central finite differences of L(b) = sum(R * (y0 + bias(b))): dL/db =
// bias_backward(cpu_exec(), R).
TEST(Bias, BackwardMatchesFiniteDifferences) {
  const int64_t M = 5, N = 3;
  auto y0 = random_vec<double>(M * N, 11), R = random_vec<double>(M * N, 12);
  auto b = random_vec<double>(N, 13);
  auto loss = [&] {
    std::vector<double> y = y0;
    bias_forward<double>(cpu_exec(), y.data(), b.data(), M, N);
    double l = 0;
    for (int64_t i = 0; i < M * N; ++i) l += R[i] * y[i];
    return l;
  };
  std::vector<double> db(N, 0.0);
  bias_backward<double>(cpu_exec(), db.data(), R.data(), M, N);
  for (int64_t n = 0; n < N; ++n) {
    const double e = 1e-6, keep = b[n];
    b[n] = keep + e;
    const double up = loss();
    b[n] = keep - e;
    const double down = loss();
    b[n] = keep;
    EXPECT_NEAR(db[n], (up - down) / (2 * e), 1e-8) << "column " << n;
  }
}

// fuse_qkv is split_qkv's adjoint (the QKV projection's gradient): <split(f), g> = <f, fuse(g)>
// in f64.
// Group sizes with empty groups first, in the middle and last, and rows past the last group
// (dropped slots: untouched); one shape above the OpenMP threshold.
struct GroupedBiasCase {
  std::vector<int64_t> m_G;
  int64_t extra_rows, C;
};
const GroupedBiasCase kGroupedBiasCases[] = {{{}, 0, 3},
                                             {{0, 0}, 2, 5},
                                             {{1}, 0, 1},
                                             {{0, 4, 0, 7, 0}, 3, 13},
                                             {{200, 0, 90, 1}, 0, 70}};

int64_t rows_of(const std::vector<int64_t>& m_G) {
  int64_t n = 0;
  for (int64_t m : m_G) n += m;
  return n;
}

TEST(GroupedBias, FastMatchesRefAndIsThreadInvariant) {
  for (const auto& gc : kGroupedBiasCases) {
    for (bool with_p : {true, false}) {
      const int64_t G = static_cast<int64_t>(gc.m_G.size()), C = gc.C;
      const int64_t N = rows_of(gc.m_G) + gc.extra_rows;
      SCOPED_TRACE(::testing::Message() << "G=" << G << " N=" << N << " C=" << C
                                        << " p=" << with_p);
      auto y0 = random_vec<float>(N * C, 21), b = random_vec<float>(G * C, 22);
      auto p = random_vec<float>(N, 23, 0, 1), dy = random_vec<float>(N * C, 24);
      auto db0 = random_vec<float>(G * C, 25), dp0 = random_vec<float>(N, 26);
      const float* pp = with_p ? p.data() : nullptr;
      std::vector<float> y_ref = y0, db_ref = db0, dp_ref = dp0;
      grouped_bias_forward_ref(y_ref.data(), b.data(), pp, gc.m_G.data(), G, C);
      grouped_bias_backward_ref(db_ref.data(), dp_ref.data(), dy.data(), b.data(), pp,
                                gc.m_G.data(), G, C);
      std::vector<float> by_threads[3][3];
      for (int threads : {1, 2, 3}) {
        moecore::testing::ScopedOmpThreads t(threads);
        Guarded<float> y(N * C), db(G * C), dp(N);
        for (int64_t i = 0; i < N * C; ++i) y[i] = y0[i];
        for (int64_t i = 0; i < G * C; ++i) db[i] = db0[i];
        for (int64_t i = 0; i < N; ++i) dp[i] = dp0[i];
        grouped_bias_forward<float>(cpu_exec(), y.data(), b.data(), pp, gc.m_G.data(), G, C);
        grouped_bias_backward<float>(cpu_exec(), db.data(), dp.data(), dy.data(), b.data(), pp,
                                     gc.m_G.data(), G, C);
        EXPECT_TRUE(y.intact() && db.intact() && dp.intact());
        by_threads[threads - 1][0] = y.vec();
        by_threads[threads - 1][1] = db.vec();
        by_threads[threads - 1][2] = dp.vec();
      }
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(by_threads[0][k], by_threads[1][k]) << "1 vs 2 threads, output " << k;
        EXPECT_EQ(by_threads[0][k], by_threads[2][k]) << "1 vs 3 threads, output " << k;
      }
      // Without p the forward adds b exactly; with p, s b rounds once more than the reference.
      if (with_p) {
        EXPECT_TRUE(all_close(by_threads[0][0], y_ref, kF32Rtol, kF32Atol)) << "y";
      } else {
        EXPECT_EQ(by_threads[0][0], y_ref) << "y";
      }
      // db sums a group's rows in f32 against the f64 reference (as Bias's backward), dp a row's
      // C columns.
      const double rows = 1.0 + (G == 0 ? 0 : *std::max_element(gc.m_G.begin(), gc.m_G.end()));
      EXPECT_TRUE(all_close(by_threads[0][1], db_ref, kF32Rtol * rows, kF32Atol * rows)) << "db";
      EXPECT_TRUE(all_close(by_threads[0][2], dp_ref, kF32Rtol * (1 + C), kF32Atol * (1 + C)))
          << "dp";
      for (int64_t n = rows_of(gc.m_G); n < N; ++n) {
        EXPECT_EQ(by_threads[0][0][n * C], y0[n * C]) << "row past the groups written";
        EXPECT_EQ(by_threads[0][2][n], dp0[n]) << "dp past the groups written";
      }
      if (!with_p) {
        EXPECT_EQ(by_threads[0][2], dp0) << "dp written without p";
      }
    }
  }
}

// f64 central finite differences of L(b, p) = sum(R * (y0 + grouped_bias(b, p))).
TEST(GroupedBias, BackwardMatchesFiniteDifferences) {
  const std::vector<int64_t> m_G = {3, 0, 2, 4};
  const int64_t G = 4, C = 5, N = 9;
  auto y0 = random_vec<double>(N * C, 31), R = random_vec<double>(N * C, 32);
  auto b = random_vec<double>(G * C, 33), p = random_vec<double>(N, 34, 0.1, 1);
  auto loss = [&] {
    std::vector<double> y = y0;
    grouped_bias_forward<double>(cpu_exec(), y.data(), b.data(), p.data(), m_G.data(), G, C);
    double l = 0;
    for (int64_t i = 0; i < N * C; ++i) l += R[i] * y[i];
    return l;
  };
  std::vector<double> db(G * C, 0.0), dp(N, 0.0);
  grouped_bias_backward<double>(cpu_exec(), db.data(), dp.data(), R.data(), b.data(), p.data(),
                                m_G.data(), G, C);
  EXPECT_TRUE(moecore::testing::check_gradient(loss, b.data(), db.data(), {G, C}, "db"));
  EXPECT_TRUE(moecore::testing::check_gradient(loss, p.data(), dp.data(), N, "dp"));
  for (int64_t c = 0; c < C; ++c) EXPECT_EQ(db[1 * C + c], 0.0) << "the empty group's bias";
}

TEST(QkvLayout, FuseIsTheAdjointOfSplit) {
  const QkvShape s{3, 4, 2, 2};
  const int64_t nq = s.n_tok * s.Hq * s.D, nkv = s.n_tok * s.Hkv * s.D, nf = nq + 2 * nkv;
  auto f = random_vec<double>(nf, 14), gq = random_vec<double>(nq, 15);
  auto gk = random_vec<double>(nkv, 16), gv = random_vec<double>(nkv, 17);
  std::vector<double> q(nq), k(nkv), v(nkv), fused(nf);
  split_qkv<double>(cpu_exec(), q.data(), k.data(), v.data(), f.data(), s);
  fuse_qkv<double>(cpu_exec(), fused.data(), gq.data(), gk.data(), gv.data(), s);
  double lhs = 0, rhs = 0;
  for (int64_t i = 0; i < nq; ++i) lhs += q[i] * gq[i];
  for (int64_t i = 0; i < nkv; ++i) lhs += k[i] * gk[i] + v[i] * gv[i];
  for (int64_t i = 0; i < nf; ++i) rhs += f[i] * fused[i];
  EXPECT_NEAR(lhs, rhs, 1e-12 * (std::abs(lhs) + 1));
}

TEST(QkvLayout, SplitAndFuseEqualTheLayoutDefinitionAndInvertEachOther) {
  for (QkvShape s :
       {QkvShape{1, 1, 1, 1}, QkvShape{5, 4, 2, 3}, QkvShape{7, 6, 6, 2}, QkvShape{64, 8, 2, 16}}) {
    SCOPED_TRACE(::testing::Message()
                 << "T=" << s.n_tok << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " D=" << s.D);
    const int64_t nq = s.n_tok * s.Hq * s.D, nkv = s.n_tok * s.Hkv * s.D, nf = nq + 2 * nkv;
    auto fused = random_vec<float>(nf, 8);
    Guarded<float> q(nq), k(nkv), v(nkv), q_r(nq), k_r(nkv), v_r(nkv), back(nf), back_r(nf);
    split_qkv<float>(cpu_exec(), q.data(), k.data(), v.data(), fused.data(), s);
    split_qkv_ref(q_r.data(), k_r.data(), v_r.data(), fused.data(), s);
    EXPECT_EQ(q.vec(), q_r.vec());
    EXPECT_EQ(k.vec(), k_r.vec());
    EXPECT_EQ(v.vec(), v_r.vec());
    fuse_qkv<float>(cpu_exec(), back.data(), q.data(), k.data(), v.data(), s);
    fuse_qkv_ref(back_r.data(), q.data(), k.data(), v.data(), s);
    EXPECT_EQ(back.vec(), fused);
    EXPECT_EQ(back_r.vec(), fused);
    for (auto* g : {&q, &k, &v, &q_r, &k_r, &v_r, &back, &back_r}) EXPECT_TRUE(g->intact());
  }
  // Megatron's layout, by hand: Hq 4, Hkv 2, D 1: [q0 q1 k0 v0 | q2 q3 k1 v1].
  const std::vector<float> fused = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> q(4), k(2), v(2);
  split_qkv<float>(cpu_exec(), q.data(), k.data(), v.data(), fused.data(), QkvShape{1, 4, 2, 1});
  EXPECT_EQ(q, (std::vector<float>{0, 1, 4, 5}));
  EXPECT_EQ(k, (std::vector<float>{2, 6}));
  EXPECT_EQ(v, (std::vector<float>{3, 7}));
  const QkvShape bad{1, 3, 2, 1};  // 3 query heads over 2 KV heads
  EXPECT_THROW(split_qkv<float>(cpu_exec(), q.data(), k.data(), v.data(), fused.data(), bad),
               moecore::Error);
}

TEST(TokenLayout, SequenceMajorEqualsTheDefinitionAndCountsTargets) {
  for (auto [B, S] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {8, 64}, {0, 4}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B << " S=" << S);
    std::vector<int32_t> ids(B * S), tg(B * S);
    for (int64_t i = 0; i < B * S; ++i) {
      ids[i] = static_cast<int32_t>(i * 7 % 101);
      tg[i] = i % 5 == 3 ? -1 : static_cast<int32_t>(i % 97);  // some ignored targets
    }
    Guarded<int32_t> ids_T(B * S), tg_T(B * S), ids_r(B * S), tg_r(B * S);
    int64_t counted = -1, counted_r = -1;
    tokens_to_sequence_major(cpu_exec(), ids_T.data(), tg_T.data(), &counted, ids.data(), tg.data(),
                             B, S);
    tokens_to_sequence_major_ref(ids_r.data(), tg_r.data(), &counted_r, ids.data(), tg.data(), B,
                                 S);
    EXPECT_EQ(ids_T.vec(), ids_r.vec());
    EXPECT_EQ(tg_T.vec(), tg_r.vec());
    EXPECT_EQ(counted, counted_r);
    int64_t expect = 0;
    for (int32_t t : tg) expect += t >= 0;
    EXPECT_EQ(counted, expect);
    if (B > 1) {
      EXPECT_EQ(ids_T[1], ids[S]);  // t = 1 is (s = 0, b = 1): row 1 of [B, S]
    }
    for (auto* g : {&ids_T, &tg_T, &ids_r, &tg_r}) EXPECT_TRUE(g->intact());
  }
}

// Multi-token prediction's roll (Megatron's roll_tensor): position s of every sequence takes
// s + k's value, the last k positions the fill; the count is of the outputs >= 0.
TEST(TokenLayout, RollTokensEqualsTheDefinitionAndCountsWhatCounts) {
  for (auto [B, S, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {3, 5, 1}, {3, 5, 2},
                         {2, 4, 4}, {2, 4, 6}, {8, 64, 3}, {0, 4, 1}, {3, 5, 0}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B << " S=" << S << " k=" << k);
    const int64_t n = B * S;
    std::vector<int32_t> in(n);
    for (int64_t i = 0; i < n; ++i) in[i] = i % 5 == 3 ? -1 : static_cast<int32_t>(i * 7 % 101);
    for (int32_t fill : {0, -1}) {
      Guarded<int32_t> out(n), ref(n);
      int64_t counted = -5, counted_r = -5;
      roll_tokens(cpu_exec(), out.data(), &counted, in.data(), n, k * B, fill);
      roll_tokens_ref(ref.data(), &counted_r, in.data(), n, k * B, fill);
      EXPECT_EQ(out.vec(), ref.vec());
      EXPECT_EQ(counted, counted_r);
      // The definition on [S, B]: (s, b) takes (s + k, b).
      int64_t expect = 0;
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t b = 0; b < B; ++b) {
          const int32_t want = s + k < S ? in[(s + k) * B + b] : fill;
          EXPECT_EQ(out[s * B + b], want) << "s=" << s << " b=" << b;
          expect += want >= 0;
        }
      }
      EXPECT_EQ(counted, expect);
      roll_tokens(cpu_exec(), out.data(), nullptr, in.data(), n, k * B, fill);  // no count
      EXPECT_EQ(out.vec(), ref.vec());
      EXPECT_TRUE(out.intact() && ref.intact());
    }
  }
  int32_t v = 0;
  EXPECT_THROW(roll_tokens(cpu_exec(), &v, nullptr, &v, 1, -1, 0), moecore::Error);
}

// Bad shapes of the layout ops stop with the op's name and the values.
TEST(TokenLayout, SequencePositionsRefuseABatchOfZero) {
  std::vector<int32_t> pos(4);
  try {
    ops::sequence_positions(cpu_exec(), pos.data(), 4, 0);
    ADD_FAILURE() << "B = 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[positions] n_tok=4 B=0"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moecore::ops
