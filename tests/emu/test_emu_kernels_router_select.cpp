// The router selection kernels (src/ops/cuda/router_select.cu) in the grid emulator: every result
// bitwise the op's `_ref` on the same inputs, as the CPU fast path's are (tests/ops/): the key, the
// group mask with tied and -inf keys, Sinkhorn's cost and factors, the top-K prefix, capacity's
// kept slots, probs and dropped count with tied probs, by probs and by position; with NaN- or
// sentinel-filled guarded outputs, scratch kept within its guards, and bitwise the same in every
// resume order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/router_select.h"

namespace moecore {
namespace {

using emu_test::append;
using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
::testing::AssertionResult same_bits(const Guarded<T>& got, const std::vector<T>& want) {
  if (bytes_of(got.data(), size_t(got.size())) == bytes_of(want.data(), want.size()))
    return ::testing::AssertionSuccess();
  for (int64_t i = 0; i < got.size(); ++i) {
    if (bytes_of(&got[i], 1) != bytes_of(&want[size_t(i)], 1))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << +got[i] << " vs " << +want[size_t(i)];
  }
  return ::testing::AssertionFailure() << "sizes differ";
}

TEST(EmuKernelsRouterSelect, RoutingKeyIsTheReferenceBitwise) {
  struct TE {
    int64_t T, E;
  };
  uint32_t seed = 500;
  for (auto [T, E] : {TE{1, 1}, TE{13, 7}, TE{70, 33}, TE{0, 4}}) {
    const std::vector<double> src = random_vec<double>(T * E, seed++, -5, 5);
    const std::vector<float> off = random_vec<float>(E, seed++);
    for (bool sub : {false, true}) {
      for (const float* o : {static_cast<const float*>(nullptr), off.data()}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " subtract=" +
                       std::to_string(sub) + " offset=" + std::to_string(o != nullptr) +
                       " in_place=" + std::to_string(in_place));
          std::vector<double> k_ref(size_t(T * E));
          ops::routing_key_ref(k_ref.data(), src.data(), o, sub, T, E);
          Guarded<double> k(T * E);
          const std::string diff = order_dependence([&] {
            Guarded<double> k1(T * E, NAN);
            if (in_place) std::copy(src.begin(), src.end(), k1.data());
            ops::cuda::routing_key(nullptr, k1.data(), in_place ? k1.data() : src.data(), o, sub, T,
                                   E);
            k = k1;
            return bytes_of(k1.data(), size_t(T * E));
          });
          EXPECT_EQ(diff, "");
          EXPECT_TRUE(k.intact());
          EXPECT_TRUE(same_bits(k, k_ref));
        }
      }
    }
  }
}

// Tied keys (every third rounded to an integer), -inf keys (a masked expert, a whole masked group
// in a row); one group, one expert per group, 256 groups; more rows than a block.
TEST(EmuKernelsRouterSelect, GroupLimitedMaskIsTheReferenceBitwise) {
  struct Case {
    int64_t T, E, G, g, K;
  };
  uint32_t seed = 600;
  for (auto c : {Case{1, 1, 1, 1, 1}, Case{13, 8, 4, 2, 2}, Case{9, 12, 3, 3, 3},
                 Case{17, 64, 8, 4, 8}, Case{5, 30, 5, 1, 6}, Case{7, 8, 8, 8, 8},
                 Case{1, 4, 2, 1, 1}, Case{3, 256, 256, 4, 4}, Case{130, 6, 3, 2, 4}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " G=" +
                 std::to_string(c.G) + " g=" + std::to_string(c.g) + " K=" + std::to_string(c.K));
    std::vector<double> key = random_vec<double>(c.T * c.E, seed++, -2, 2);
    for (int64_t i = 0; i < c.T * c.E; i += 3) key[size_t(i)] = std::round(key[size_t(i)]);
    for (int64_t i = 4; i < c.T * c.E; i += 11) key[size_t(i)] = -INFINITY;
    if (c.T > 1) {
      for (int64_t e = 0; e < c.E / c.G; ++e) key[size_t(c.E + e)] = -INFINITY;
    }
    std::vector<double> k_ref = key;
    ops::group_limited_mask_ref(k_ref.data(), c.T, c.E, c.G, c.g, c.K);
    Guarded<double> k(c.T * c.E), scratch(c.T * c.E);
    const std::string diff = order_dependence([&] {
      Guarded<double> k1(c.T * c.E), scratch1(c.T * c.E, NAN);
      std::copy(key.begin(), key.end(), k1.data());
      ops::cuda::group_limited_mask(nullptr, k1.data(), scratch1.data(), c.T, c.E, c.G, c.g, c.K);
      k = k1;
      scratch = scratch1;
      return bytes_of(k1.data(), size_t(c.T * c.E));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(k.intact());
    EXPECT_TRUE(scratch.intact()) << "scratch written outside its elements";
    EXPECT_TRUE(same_bits(k, k_ref));
  }
}

// The cost and the factors bitwise the reference's (the same sums in the same order); more tokens
// than the block's threads (each thread several rows).
TEST(EmuKernelsRouterSelect, SinkhornIsTheReferenceBitwise) {
  struct TE {
    int64_t T, E;
  };
  uint32_t seed = 700;
  for (auto [T, E] : {TE{1, 1}, TE{16, 4}, TE{40, 7}, TE{5, 40}, TE{1100, 2}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E));
    const std::vector<double> l = random_vec<double>(T * E, seed++, -2, 2);
    std::vector<double> c_ref(size_t(T * E)), d0_ref(static_cast<size_t>(T)), d1_ref(size_t(2 * E));
    ops::sinkhorn_balance_ref(c_ref.data(), d0_ref.data(), d1_ref.data(), l.data(), T, E);
    Guarded<double> c(T * E), d0(T), d1(2 * E);
    const std::string diff = order_dependence([&] {
      Guarded<double> c1(T * E, NAN), d01(T, NAN), d11(2 * E, NAN);
      ops::cuda::sinkhorn_balance(nullptr, c1.data(), d01.data(), d11.data(), l.data(), T, E);
      c = c1;
      d0 = d01;
      d1 = d11;
      std::vector<unsigned char> out;
      append(out, c1);
      append(out, d01);
      append(out, d11);
      return out;
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(c.intact() && d0.intact() && d1.intact()) << "written outside the elements";
    EXPECT_TRUE(same_bits(c, c_ref)) << "cost";
    EXPECT_TRUE(same_bits(d0, d0_ref)) << "d0";
    EXPECT_TRUE(same_bits(d1, d1_ref)) << "d1";
  }
}

TEST(EmuKernelsRouterSelect, TopkPrefixIsTheReferenceBitwise) {
  struct Case {
    int64_t T, K, K1;
  };
  for (auto c : {Case{1, 1, 1}, Case{2, 2, 3}, Case{13, 1, 2}, Case{300, 3, 4}, Case{0, 2, 3}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) +
                 " K1=" + std::to_string(c.K1));
    std::vector<int32_t> idx1(size_t(c.T * c.K1));
    std::iota(idx1.begin(), idx1.end(), 3);
    std::vector<int32_t> idx_ref(size_t(c.T * c.K));
    ops::topk_prefix_ref(idx_ref.data(), idx1.data(), c.T, c.K, c.K1);
    Guarded<int32_t> idx(c.T * c.K);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> i1(c.T * c.K, -7);
      ops::cuda::topk_prefix(nullptr, i1.data(), idx1.data(), c.T, c.K, c.K1);
      idx = i1;
      return bytes_of(i1.data(), size_t(c.T * c.K));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(idx.intact());
    EXPECT_TRUE(same_bits(idx, idx_ref));
  }
}

// Routings skewed towards the low experts (some experts get none), tied probs, by probs and by
// position; capacity 0 (dropless), 1, and above every load; more pairs than a block (the scan's
// chunks) and an expert with more pairs than the block's threads (the ranks' strides).
TEST(EmuKernelsRouterSelect, ApplyCapacityIsTheReferenceBitwise) {
  struct Case {
    int64_t T, K, E, cap;
  };
  std::mt19937 gen(800);
  uint32_t seed = 801;
  for (auto c : {Case{1, 1, 1, 1}, Case{13, 2, 8, 3}, Case{13, 4, 4, 10}, Case{20, 1, 7, 2},
                 Case{50, 3, 9, 1}, Case{8, 2, 3, 0}, Case{30, 2, 5, 100}, Case{4, 1, 2, 1},
                 Case{300, 1, 1, 100}, Case{0, 2, 4, 1}}) {
    std::vector<int32_t> routed(size_t(c.T * c.K)), perm(size_t(c.E));
    for (int64_t t = 0; t < c.T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.begin() + std::min<int64_t>(c.E, c.K + 1), gen);
      for (int64_t k = 0; k < c.K; ++k) routed[size_t(t * c.K + k)] = perm[size_t(k)];
    }
    std::vector<double> p0 = random_vec<double>(c.T * c.K, seed++, 0, 1);
    for (int64_t i = 0; i < c.T * c.K; i += 4) p0[size_t(i)] = 0.5;  // ties
    for (bool by_probs : {true, false}) {
      SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) +
                   " E=" + std::to_string(c.E) + " cap=" + std::to_string(c.cap) +
                   " by_probs=" + std::to_string(by_probs));
      const int64_t TK = c.T * c.K;
      std::vector<int32_t> idx_ref(static_cast<size_t>(TK));
      std::vector<double> p_ref = p0;
      std::vector<int64_t> d_ref(1, -1);
      ops::apply_capacity_ref(idx_ref.data(), p_ref.data(), d_ref.data(), routed.data(), c.T, c.K,
                              c.E, c.cap, by_probs);
      Guarded<int32_t> idx(TK), cand(TK);
      Guarded<double> p(TK);
      Guarded<int64_t> off(2 * c.E + 1), dropped(1);
      const std::string diff = order_dependence([&] {
        Guarded<int32_t> idx1(TK, -7), cand1(TK, -7);
        Guarded<int64_t> off1(2 * c.E + 1, -7), dropped1(1, -7);
        Guarded<double> p1(TK);
        std::copy(p0.begin(), p0.end(), p1.data());
        ops::cuda::apply_capacity(nullptr, idx1.data(), p1.data(), dropped1.data(), cand1.data(),
                                  off1.data(), routed.data(), c.T, c.K, c.E, c.cap, by_probs);
        idx = idx1;
        p = p1;
        dropped = dropped1;
        cand = cand1;
        off = off1;
        std::vector<unsigned char> out;
        append(out, idx1);
        append(out, p1);
        append(out, dropped1);
        return out;
      });
      EXPECT_EQ(diff, "");
      EXPECT_TRUE(idx.intact() && p.intact() && dropped.intact()) << "outputs' guards";
      EXPECT_TRUE(cand.intact() && off.intact()) << "scratch written outside its elements";
      EXPECT_TRUE(same_bits(idx, idx_ref)) << "idx";
      EXPECT_TRUE(same_bits(p, p_ref)) << "probs";
      EXPECT_TRUE(same_bits(dropped, d_ref)) << "dropped";
    }
  }
}

TEST(EmuKernelsRouterSelect, BadArgumentsAreErrors) {
  double v = 0;
  int32_t i = 0;
  int64_t j = 0;
  EXPECT_THROW(ops::cuda::group_limited_mask(nullptr, &v, &v, 1, 6, 4, 1, 1), Error);  // 4 ∤ 6
  EXPECT_THROW(ops::cuda::group_limited_mask(nullptr, &v, &v, 1, 8, 4, 2, 3), Error);  // 2 ∤ 3
  EXPECT_THROW(ops::cuda::group_limited_mask(nullptr, &v, &v, 1, 8, 4, 1, 4), Error);  // 4 > 2
  EXPECT_THROW(ops::cuda::topk_prefix(nullptr, &i, &i, 1, 3, 2), Error);
  EXPECT_THROW(ops::cuda::routing_key(nullptr, &v, &v, nullptr, false, -1, 2), Error);
  EXPECT_THROW(ops::cuda::sinkhorn_balance(nullptr, &v, &v, &v, &v, 1, 0), Error);
  EXPECT_THROW(ops::cuda::apply_capacity(nullptr, &i, &v, &j, &i, &j, &i, 1, 0, 2, 1, true), Error);
}

}  // namespace
}  // namespace moecore
