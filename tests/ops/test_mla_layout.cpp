// MLA's q / k / v layout: fast vs reference bitwise (f32, f64; dv below, equal to and above
// qk + pe, so both zero tails are exercised; one head; no tokens), the layout by hand, fp64 finite
// differences of mla_merge as mla_split's backward (every input), thread counts bitwise, errors.
#include <cstdint>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/mla_layout.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::Guarded;
using moecore::testing::random_vec;
using moecore::testing::ScopedOmpThreads;

const MlaLayoutShape kShapes[] = {
    {0, 2, 4, 2, 4}, {1, 1, 3, 2, 4},  {5, 3, 4, 2, 6},
    {7, 2, 6, 4, 3}, {9, 4, 8, 4, 16}, {300, 4, 16, 8, 16},
};

std::string name(const MlaLayoutShape& s) {
  return "n=" + std::to_string(s.n_tok) + " heads=" + std::to_string(s.heads) +
         " qk=" + std::to_string(s.qk) + " pe=" + std::to_string(s.pe) +
         " dv=" + std::to_string(s.dv);
}

struct Inputs {
  std::vector<double> q_up, q_pe, kv_up, k_pe, dq, dk, dv;
};
Inputs inputs(const MlaLayoutShape& s, uint32_t seed) {
  const int64_t r = s.n_tok * s.heads;
  return Inputs{
      random_vec<double>(r * s.dq(), seed),      random_vec<double>(r * s.pe, seed + 1),
      random_vec<double>(r * s.dkv(), seed + 2), random_vec<double>(s.n_tok * s.pe, seed + 3),
      random_vec<double>(r * s.Dp(), seed + 4),  random_vec<double>(r * s.Dp(), seed + 5),
      random_vec<double>(r * s.Dp(), seed + 6)};
}
template <typename T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
void fast_matches_ref() {
  uint32_t seed = 3;
  for (const MlaLayoutShape& s : kShapes) {
    SCOPED_TRACE(name(s));
    const Inputs in = inputs(s, seed += 11);
    const auto q_up = as<T>(in.q_up), q_pe = as<T>(in.q_pe), kv_up = as<T>(in.kv_up),
               k_pe = as<T>(in.k_pe), dq = as<T>(in.dq), dk = as<T>(in.dk), dv = as<T>(in.dv);
    const int64_t r = s.n_tok * s.heads, nD = r * s.Dp();
    const double c = 0.75;
    Guarded<T> q(nD, T(NAN)), k(nD, T(NAN)), v(nD, T(NAN)), q_r(nD), k_r(nD), v_r(nD);
    cpu::mla_split(q.data(), k.data(), v.data(), q_up.data(), q_pe.data(), kv_up.data(),
                   k_pe.data(), s, c);
    mla_split_ref(q_r.data(), k_r.data(), v_r.data(), q_up.data(), q_pe.data(), kv_up.data(),
                  k_pe.data(), s, c);
    EXPECT_TRUE(q.intact() && k.intact() && v.intact());
    EXPECT_TRUE(all_close(q.data(), q_r.data(), nD, 0, 0)) << "q";
    EXPECT_TRUE(all_close(k.data(), k_r.data(), nD, 0, 0)) << "k";
    EXPECT_TRUE(all_close(v.data(), v_r.data(), nD, 0, 0)) << "v";
    // dq_up's rotated part is not written (rope_mla_backward's): both keep the fill there.
    Guarded<T> dq_up(r * s.dq(), T(7)), dq_pe(r * s.pe, T(NAN)), dkv_up(r * s.dkv(), T(NAN)),
        dk_pe(s.n_tok * s.pe, T(NAN));
    Guarded<T> dq_up_r(r * s.dq(), T(7)), dq_pe_r(r * s.pe), dkv_up_r(r * s.dkv()),
        dk_pe_r(s.n_tok * s.pe);
    cpu::mla_merge(dq_up.data(), dq_pe.data(), dkv_up.data(), dk_pe.data(), dq.data(), dk.data(),
                   dv.data(), s, c);
    mla_merge_ref(dq_up_r.data(), dq_pe_r.data(), dkv_up_r.data(), dk_pe_r.data(), dq.data(),
                  dk.data(), dv.data(), s, c);
    EXPECT_TRUE(dq_up.intact() && dq_pe.intact() && dkv_up.intact() && dk_pe.intact());
    EXPECT_TRUE(all_close(dq_up.data(), dq_up_r.data(), r * s.dq(), 0, 0)) << "dq_up";
    EXPECT_TRUE(all_close(dq_pe.data(), dq_pe_r.data(), r * s.pe, 0, 0)) << "dq_pe";
    EXPECT_TRUE(all_close(dkv_up.data(), dkv_up_r.data(), r * s.dkv(), 0, 0)) << "dkv_up";
    EXPECT_TRUE(all_close(dk_pe.data(), dk_pe_r.data(), s.n_tok * s.pe, 0, 0)) << "dk_pe";
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = s.qk; j < s.dq(); ++j) ASSERT_EQ(dq_up[i * s.dq() + j], T(7));
  }
}

TEST(MlaLayout, FastMatchesRefBitwiseF32) {
  fast_matches_ref<float>();
}
TEST(MlaLayout, FastMatchesRefBitwiseF64) {
  fast_matches_ref<double>();
}

// One token, two heads, qk 1, pe 1, dv 3 (Dp 3): q = c [q_nope, q_pe, 0], k = [k_nope, k_pe, 0]
// with k_pe shared, v = kv_up's last three; dk_pe sums the heads.
TEST(MlaLayout, ByHand) {
  const MlaLayoutShape s{1, 2, 1, 1, 3};
  const double q_up[4] = {1, -9, 2, -9};  // per head [nope, (rotated part, not read)]
  const double q_pe[2] = {3, 4};
  const double kv_up[8] = {5, 6, 7, 8, 9, 10, 11, 12};  // per head [k_nope, v0, v1, v2]
  const double k_pe[1] = {13};
  double q[6], k[6], v[6];
  cpu::mla_split(q, k, v, q_up, q_pe, kv_up, k_pe, s, 2.0);
  const double q_want[6] = {2, 6, 0, 4, 8, 0}, k_want[6] = {5, 13, 0, 9, 13, 0},
               v_want[6] = {6, 7, 8, 10, 11, 12};
  EXPECT_TRUE(all_close(q, q_want, 6, 0, 0));
  EXPECT_TRUE(all_close(k, k_want, 6, 0, 0));
  EXPECT_TRUE(all_close(v, v_want, 6, 0, 0));
  const double dq[6] = {1, 2, 3, 4, 5, 6}, dk[6] = {7, 8, 9, 10, 11, 12},
               dv[6] = {13, 14, 15, 16, 17, 18};
  double dq_up[4] = {0, -1, 0, -1}, dq_pe[2], dkv_up[8], dk_pe[1];
  cpu::mla_merge(dq_up, dq_pe, dkv_up, dk_pe, dq, dk, dv, s, 2.0);
  const double dq_up_want[4] = {2, -1, 8, -1}, dq_pe_want[2] = {4, 10},
               dkv_up_want[8] = {7, 13, 14, 15, 10, 16, 17, 18};
  EXPECT_TRUE(all_close(dq_up, dq_up_want, 4, 0, 0));
  EXPECT_TRUE(all_close(dq_pe, dq_pe_want, 2, 0, 0));
  EXPECT_TRUE(all_close(dkv_up, dkv_up_want, 8, 0, 0));
  EXPECT_EQ(dk_pe[0], 8.0 + 11.0);
}

// loss = <q, Rq> + <k, Rk> + <v, Rv> of mla_split: its gradient in every input is mla_merge of
// (Rq, Rk, Rv), against fp64 central differences.
TEST(MlaLayout, MergeIsTheSplitsBackward) {
  const MlaLayoutShape s{3, 3, 4, 2, 7};  // dv > qk + pe: q and k get zero tails
  Inputs in = inputs(s, 91);
  const int64_t r = s.n_tok * s.heads, nD = r * s.Dp();
  const double c = 1.7;
  std::vector<double> q(nD), k(nD), v(nD);
  auto loss = [&]() {
    mla_split_ref(q.data(), k.data(), v.data(), in.q_up.data(), in.q_pe.data(), in.kv_up.data(),
                  in.k_pe.data(), s, c);
    double acc = 0;
    for (int64_t i = 0; i < nD; ++i) acc += q[i] * in.dq[i] + k[i] * in.dk[i] + v[i] * in.dv[i];
    return acc;
  };
  std::vector<double> dq_up(r * s.dq(), 0.0), dq_pe(r * s.pe), dkv_up(r * s.dkv()),
      dk_pe(s.n_tok * s.pe);
  cpu::mla_merge(dq_up.data(), dq_pe.data(), dkv_up.data(), dk_pe.data(), in.dq.data(),
                 in.dk.data(), in.dv.data(), s, c);
  // q_up's rotated part is not read by the split: its gradient is 0, as left.
  EXPECT_TRUE(check_gradient(loss, in.q_up.data(), dq_up.data(), r * s.dq(), "q_up", r * s.dq()));
  EXPECT_TRUE(check_gradient(loss, in.q_pe.data(), dq_pe.data(), r * s.pe, "q_pe", r * s.pe));
  EXPECT_TRUE(
      check_gradient(loss, in.kv_up.data(), dkv_up.data(), r * s.dkv(), "kv_up", r * s.dkv()));
  EXPECT_TRUE(
      check_gradient(loss, in.k_pe.data(), dk_pe.data(), s.n_tok * s.pe, "k_pe", s.n_tok * s.pe));
}

TEST(MlaLayout, ThreadCountInvariantBitwise) {
  const MlaLayoutShape s{500, 4, 16, 8, 16};
  const Inputs in = inputs(s, 5);
  const auto f = [&](const std::vector<double>& x) { return as<float>(x); };
  const auto q_up = f(in.q_up), q_pe = f(in.q_pe), kv_up = f(in.kv_up), k_pe = f(in.k_pe),
             dq = f(in.dq), dk = f(in.dk), dv = f(in.dv);
  const int64_t r = s.n_tok * s.heads, nD = r * s.Dp();
  auto run = [&](int threads) {
    ScopedOmpThreads scoped(threads);
    std::vector<float> out(3 * nD + r * s.dq() + r * s.pe + r * s.dkv() + s.n_tok * s.pe, 0.0f);
    float* p = out.data();
    cpu::mla_split(p, p + nD, p + 2 * nD, q_up.data(), q_pe.data(), kv_up.data(), k_pe.data(), s,
                   0.5);
    float* m = p + 3 * nD;
    cpu::mla_merge(m, m + r * s.dq(), m + r * s.dq() + r * s.pe,
                   m + r * s.dq() + r * s.pe + r * s.dkv(), dq.data(), dk.data(), dv.data(), s,
                   0.5);
    return out;
  };
  const std::vector<float> one = run(1);
  for (int threads : {2, 3}) EXPECT_TRUE(all_close(run(threads), one, 0, 0)) << threads;
}

TEST(MlaLayout, RejectsBadShapes) {
  float x = 0;
  EXPECT_THROW(cpu::mla_split(&x, &x, &x, &x, &x, &x, &x, MlaLayoutShape{1, 1, 1, 0, 1}, 1.0),
               moecore::Error);
  EXPECT_THROW(cpu::mla_merge(&x, &x, &x, &x, &x, &x, &x, MlaLayoutShape{1, 1, 1, 1, 0}, 1.0),
               moecore::Error);
  EXPECT_THROW(mla_split_ref(&x, &x, &x, &x, &x, &x, &x, MlaLayoutShape{-1, 1, 1, 1, 1}, 1.0),
               moecore::Error);
}

}  // namespace
}  // namespace moecore::ops
