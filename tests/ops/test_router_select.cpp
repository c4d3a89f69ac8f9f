// Router selection: the key (bias added, beta subtracted) bitwise against the reference; the
// group mask on a hand example and fast == reference on random keys (ties included); Sinkhorn
// fast == reference and doubly stochastic; the top-K prefix; capacity dropping by probs and by
// position against the reference's repeated selection (K = 1, K = E, experts with no tokens,
// every pair over capacity), with guard bytes.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/router_select.h"

namespace moecore::testing {
namespace {

TEST(RouterSelect, RoutingKeyMatchesRef) {
  for (auto [T, E] : {std::pair<int64_t, int64_t>{1, 1}, {13, 7}, {70, 256}, {0, 4}}) {
    auto src = random_vec<double>(T * E, 1, -5, 5);
    auto off = random_vec<float>(E, 2);
    for (bool sub : {false, true}) {
      const float* no_offset = nullptr;
      for (const float* o : {no_offset, static_cast<const float*>(off.data())}) {
        Guarded<double> k(T * E), k_r(T * E);
        ops::routing_key(cpu_exec(), k.data(), src.data(), o, sub, T, E);
        ops::routing_key_ref(k_r.data(), src.data(), o, sub, T, E);
        EXPECT_EQ(k.vec(), k_r.vec());
        EXPECT_TRUE(k.intact() && k_r.intact());
        if (!o) {
          EXPECT_EQ(k.vec(), src);
        }
      }
    }
  }
}

TEST(RouterSelect, GroupMaskHandExample) {
  // E = 6 in G = 3 groups of 2, group_topk 1, K = 2 (top-2 of each group summed).
  std::vector<double> key = {0.1, 0.2, 0.9, -0.5, 0.3, 0.35};  // sums 0.3, 0.4, 0.65
  std::vector<double> scratch(6);
  ops::group_limited_mask(cpu_exec(), key.data(), scratch.data(), 1, 6, 3, 1, 2);
  EXPECT_EQ(key, (std::vector<double>{-INFINITY, -INFINITY, -INFINITY, -INFINITY, 0.3, 0.35}));
  // Tied groups: the lower group stays.
  std::vector<double> tie = {1.0, 0.0, 0.0, 1.0};
  ops::group_limited_mask(cpu_exec(), tie.data(), scratch.data(), 1, 4, 2, 1, 1);
  EXPECT_EQ(tie, (std::vector<double>{1.0, 0.0, -INFINITY, -INFINITY}));
}

TEST(RouterSelect, GroupMaskMatchesRef) {
  struct Case {
    int64_t T, E, G, g, K;
  };
  for (auto c : {Case{1, 1, 1, 1, 1}, Case{13, 8, 4, 2, 2}, Case{9, 12, 3, 3, 3},
                 Case{17, 64, 8, 4, 8}, Case{5, 30, 5, 1, 6}, Case{7, 8, 8, 8, 8}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " G=" << c.G
                                      << " g=" << c.g << " K=" << c.K);
    auto key = random_vec<double>(c.T * c.E, 3, -2, 2);
    for (int64_t i = 0; i < c.T * c.E; i += 3) key[i] = std::round(key[i]);  // ties
    Guarded<double> k(c.T * c.E), scratch(c.T * c.E);
    for (int64_t i = 0; i < c.T * c.E; ++i) k[i] = key[i];
    std::vector<double> k_r = key;
    ops::group_limited_mask(cpu_exec(), k.data(), scratch.data(), c.T, c.E, c.G, c.g, c.K);
    ops::group_limited_mask_ref(k_r.data(), c.T, c.E, c.G, c.g, c.K);
    EXPECT_EQ(k.vec(), k_r);
    EXPECT_TRUE(k.intact() && scratch.intact());
    for (int64_t t = 0; t < c.T; ++t) {  // exactly g groups stay
      int64_t kept = 0;
      for (int64_t e = 0; e < c.E; ++e) kept += std::isfinite(k[t * c.E + e]);
      EXPECT_EQ(kept, c.g * (c.E / c.G));
    }
  }
}

TEST(RouterSelect, GroupMaskRejectsBadGroups) {
  std::vector<double> key(12), scratch(12);
  EXPECT_THROW(ops::group_limited_mask(cpu_exec(), key.data(), scratch.data(), 1, 12, 5, 1, 1),
               moecore::Error);
}

TEST(RouterSelect, SinkhornMatchesRefAndBalances) {
  for (auto [T, E] : {std::pair<int64_t, int64_t>{1, 1}, {16, 4}, {40, 7}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " E=" << E);
    auto l = random_vec<double>(T * E, 4, -2, 2);
    Guarded<double> c(T * E), c_r(T * E), d0(T), d0_r(T), d1(2 * E), d1_r(2 * E);
    ops::sinkhorn_balance(cpu_exec(), c.data(), d0.data(), d1.data(), l.data(), T, E);
    ops::sinkhorn_balance_ref(c_r.data(), d0_r.data(), d1_r.data(), l.data(), T, E);
    EXPECT_EQ(c.vec(), c_r.vec());
    for (auto* g : {&c, &c_r, &d0, &d0_r, &d1, &d1_r}) EXPECT_TRUE(g->intact());
    // Columns sum to ~1/E after the last column update (rows to ~1/T within the tolerance).
    for (int64_t e = 0; e < E; ++e) {
      double col = 0;
      for (int64_t t = 0; t < T; ++t) col += c[t * E + e];
      EXPECT_NEAR(col, 1.0 / E, 1e-6);
    }
  }
}

TEST(RouterSelect, TopkPrefix) {
  const std::vector<int32_t> idx1 = {3, 1, 0, 2, 0, 1};  // T = 2, K1 = 3
  Guarded<int32_t> idx(4), idx_r(4);
  ops::topk_prefix(cpu_exec(), idx.data(), idx1.data(), 2, 2, 3);
  ops::topk_prefix_ref(idx_r.data(), idx1.data(), 2, 2, 3);
  EXPECT_EQ(idx.vec(), (std::vector<int32_t>{3, 1, 2, 0}));
  EXPECT_EQ(idx_r.vec(), idx.vec());
  EXPECT_TRUE(idx.intact() && idx_r.intact());
}

TEST(RouterSelect, CapacityHandExample) {
  // T = 4, K = 1, E = 2, capacity 1: expert 0 gets tokens 0, 1, 3; expert 1 token 2.
  const std::vector<int32_t> routed = {0, 0, 1, 0};
  const std::vector<double> p0 = {0.2, 0.7, 0.5, 0.7};
  for (bool by_probs : {true, false}) {
    std::vector<int32_t> idx(4), cand(4);
    std::vector<int64_t> off(5);
    std::vector<double> p = p0;
    int64_t dropped = -1;
    ops::apply_capacity(cpu_exec(), idx.data(), p.data(), &dropped, cand.data(), off.data(),
                        routed.data(), 4, 1, 2, 1, by_probs);
    EXPECT_EQ(dropped, 2);
    if (by_probs) {  // the largest prob; the tie of tokens 1 and 3 to the lower token
      EXPECT_EQ(idx, (std::vector<int32_t>{-1, 0, 1, -1}));
      EXPECT_EQ(p, (std::vector<double>{0, 0.7, 0.5, 0}));
    } else {  // the first in token order
      EXPECT_EQ(idx, (std::vector<int32_t>{0, -1, 1, -1}));
      EXPECT_EQ(p, (std::vector<double>{0.2, 0, 0.5, 0}));
    }
  }
}

TEST(RouterSelect, CapacityMatchesRef) {
  struct Case {
    int64_t T, K, E, cap;
  };
  std::mt19937 gen(5);
  for (auto c : {Case{1, 1, 1, 1}, Case{13, 2, 8, 3}, Case{13, 4, 4, 10}, Case{20, 1, 7, 2},
                 Case{50, 3, 9, 1}, Case{8, 2, 3, 0}, Case{30, 2, 5, 100}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " K=" << c.K << " E=" << c.E
                                      << " cap=" << c.cap);
    // Distinct experts per token, skewed towards the low experts (some experts get none).
    std::vector<int32_t> routed(c.T * c.K);
    std::vector<int32_t> perm(c.E);
    for (int64_t t = 0; t < c.T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.begin() + std::min<int64_t>(c.E, c.K + 1), gen);
      for (int64_t k = 0; k < c.K; ++k) routed[t * c.K + k] = perm[k];
    }
    auto p0 = random_vec<double>(c.T * c.K, 6, 0, 1);
    for (int64_t i = 0; i < c.T * c.K; i += 4) p0[i] = 0.5;  // ties
    for (bool by_probs : {true, false}) {
      Guarded<int32_t> idx(c.T * c.K), idx_r(c.T * c.K), cand(c.T * c.K);
      Guarded<int64_t> off(2 * c.E + 1);
      Guarded<double> p(c.T * c.K), p_r(c.T * c.K);
      for (int64_t i = 0; i < c.T * c.K; ++i) p[i] = p_r[i] = p0[i];
      int64_t d = -1, d_r = -1;
      ops::apply_capacity(cpu_exec(), idx.data(), p.data(), &d, cand.data(), off.data(),
                          routed.data(), c.T, c.K, c.E, c.cap, by_probs);
      ops::apply_capacity_ref(idx_r.data(), p_r.data(), &d_r, routed.data(), c.T, c.K, c.E, c.cap,
                              by_probs);
      EXPECT_EQ(idx.vec(), idx_r.vec());
      EXPECT_EQ(p.vec(), p_r.vec());
      EXPECT_EQ(d, d_r);
      for (auto* g : {&idx, &idx_r, &cand}) EXPECT_TRUE(g->intact());
      EXPECT_TRUE(off.intact() && p.intact() && p_r.intact());
      if (c.cap == 0) {
        EXPECT_EQ(idx.vec(), routed);  // dropless
      }
      std::vector<int64_t> load(c.E);
      for (int32_t e : idx.vec()) {
        if (e >= 0) ++load[e];
      }
      for (int64_t e = 0; e < c.E && c.cap > 0; ++e) EXPECT_LE(load[e], c.cap);
    }
  }
}

}  // namespace
}  // namespace moecore::testing
