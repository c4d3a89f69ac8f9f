// The block form of attention (keys at an offset, Sk != S, the lse a strided part of a longer
// one) and the log-sum-exp merge: the blocks of a sequence cut into chunks, merged as the CP ring
// merges them, equal the plain single-rank attention of the whole sequence (forward, and the
// backward as the sum of each block's share given the merged out and lse), f64 tight and f32 at
// its row; the fast path and the reference, with GQA and dropout; f64 finite differences of the
// merged blocks; the merge's CPU path against its reference; the refusals.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/attention_problem.h"
#include "common/testing.h"
#include "core/check.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "ops/attention_merge.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::random_vec;
using moecore::testing::ScopedOmpThreads;

constexpr uint64_t kDropKey = 0x5eed0f7a11ull;

// Runs f and expects a moecore::Error whose message contains `part`.
template <typename F>
void expect_error(F f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const moecore::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}
#define EXPECT_THROW_MSG(stmt, part) expect_error([&] { stmt; }, part)
const DropoutCounters kCounters{4, 3};

// The whole sequence [S, B, *, D] and its gradient seed.
template <typename T>
using Whole = testing::AttentionProblem<T>;

// How the keys of a query chunk are cut: a block per earlier chunk and the diagonal (the ring),
// or one block of the whole prefix (all-gather).
enum class Cut { Ring, Prefix };

template <typename T>
struct Outputs {
  std::vector<T> out, lse, dq, dk, dv;
};

// Forward of the whole sequence by blocks of C rows: for query chunk qi the blocks of key chunks
// ki <= qi (Cut::Ring, merged) or the prefix [0, (qi + 1) C) (Cut::Prefix); out and lse land in
// the whole [S, B, Hq, D] and [B, Hq, S] (lse_stride S). Then the backward of every block given
// the merged out and lse, dq / dk / dv summed over the blocks. fast: the CPU fast path and merge
// (else the references).
template <typename T>
Outputs<T> by_blocks(const Whole<T>& w, int64_t C, Cut cut, bool fast,
                     const AttentionDropout* drop) {
  const AttentionShape& s = w.s;
  const int64_t rq = s.B * s.Hq * s.D, rk = s.B * s.Hkv * s.D, n_chunks = s.S / C;
  Outputs<T> o{std::vector<T>(w.n_q), std::vector<T>(w.n_lse), std::vector<T>(w.n_q, T(0)),
               std::vector<T>(w.n_kv, T(0)), std::vector<T>(w.n_kv, T(0))};
  std::vector<T> out_b(w.n_q), lse_b(w.n_lse), dq_b(w.n_q), dk_b(w.n_kv), dv_b(w.n_kv);
  auto blocks_of = [&](int64_t qi) {
    std::vector<AttentionShape> bs;
    AttentionShape b = s;
    b.S = C, b.q_offset = qi * C, b.lse_stride = s.S;
    if (cut == Cut::Prefix) {
      b.Sk = (qi + 1) * C, b.k_offset = 0;
      bs.push_back(b);
    } else {
      // The diagonal first, then the earlier chunks: the merge order of a ring step.
      for (int64_t ki = qi; ki >= 0; --ki) b.Sk = C, b.k_offset = ki * C, bs.push_back(b);
    }
    return bs;
  };
  std::vector<T> ws;
  for (int64_t qi = 0; qi < n_chunks; ++qi) {
    const int64_t qo = qi * C * rq;
    bool first = true;
    for (const AttentionShape& b : blocks_of(qi)) {
      const int64_t ko = b.k_offset * rk;
      T* dst_out = first ? o.out.data() + qo : out_b.data() + qo;
      T* dst_lse = first ? o.lse.data() + qi * C : lse_b.data() + qi * C;
      if (fast) {
        ws.assign(attention_workspace_elems(b, omp_get_max_threads()), T(0));
        attention_forward<T>(cpu_exec(), dst_out, dst_lse, w.q.data() + qo, w.k.data() + ko,
                             w.v.data() + ko, b, ws.data(), drop);
        if (!first)
          attention_merge<T>(cpu_exec(), o.out.data() + qo, o.lse.data() + qi * C, dst_out, dst_lse,
                             b);
      } else {
        attention_forward_ref<T>(dst_out, dst_lse, w.q.data() + qo, w.k.data() + ko,
                                 w.v.data() + ko, b, drop);
        if (!first)
          attention_merge_ref<T>(o.out.data() + qo, o.lse.data() + qi * C, dst_out, dst_lse, b);
      }
      first = false;
    }
  }
  for (int64_t qi = 0; qi < n_chunks; ++qi) {
    const int64_t qo = qi * C * rq;
    for (const AttentionShape& b : blocks_of(qi)) {
      const int64_t ko = b.k_offset * rk;
      if (fast) {
        ws.assign(attention_workspace_elems(b, omp_get_max_threads()), T(0));
        attention_backward<T>(cpu_exec(), dq_b.data(), dk_b.data(), dv_b.data(), w.dout.data() + qo,
                              w.q.data() + qo, w.k.data() + ko, w.v.data() + ko, o.out.data() + qo,
                              o.lse.data() + qi * C, b, ws.data(), drop);
      } else {
        attention_backward_ref<T>(dq_b.data(), dk_b.data(), dv_b.data(), w.dout.data() + qo,
                                  w.q.data() + qo, w.k.data() + ko, w.v.data() + ko,
                                  o.out.data() + qo, o.lse.data() + qi * C, b, drop);
      }
      for (int64_t e = 0; e < C * rq; ++e) o.dq[qo + e] += dq_b[e];
      for (int64_t e = 0; e < b.keys() * rk; ++e) {
        o.dk[ko + e] += dk_b[e];
        o.dv[ko + e] += dv_b[e];
      }
    }
  }
  return o;
}

template <typename T>
Outputs<T> whole_ref(const Whole<T>& w, const AttentionDropout* drop) {
  Outputs<T> o{std::vector<T>(w.n_q), std::vector<T>(w.n_lse), std::vector<T>(w.n_q),
               std::vector<T>(w.n_kv), std::vector<T>(w.n_kv)};
  attention_forward_ref<T>(o.out.data(), o.lse.data(), w.q.data(), w.k.data(), w.v.data(), w.s,
                           drop);
  attention_backward_ref<T>(o.dq.data(), o.dk.data(), o.dv.data(), w.dout.data(), w.q.data(),
                            w.k.data(), w.v.data(), o.out.data(), o.lse.data(), w.s, drop);
  return o;
}

template <typename T>
void expect_outputs_close(const Outputs<T>& a, const Outputs<T>& b, double rtol, double atol) {
  EXPECT_TRUE(all_close(a.out.data(), b.out.data(), int64_t(a.out.size()), rtol, atol)) << "out";
  EXPECT_TRUE(all_close(a.lse.data(), b.lse.data(), int64_t(a.lse.size()), rtol, atol)) << "lse";
  EXPECT_TRUE(all_close(a.dq.data(), b.dq.data(), int64_t(a.dq.size()), rtol, atol)) << "dq";
  EXPECT_TRUE(all_close(a.dk.data(), b.dk.data(), int64_t(a.dk.size()), rtol, atol)) << "dk";
  EXPECT_TRUE(all_close(a.dv.data(), b.dv.data(), int64_t(a.dv.size()), rtol, atol)) << "dv";
}

struct Case {
  AttentionShape s;
  int64_t C;
};
// Chunks of 1, 3 (odd: dropout's Philox groups of 4 keys start mid-chunk), 5 and 70 (crossing
// the fast path's 64-row blocks); MHA, GQA groups of 2 and 3, MQA; D of one vector with a tail
// and of two.
const Case kCases[] = {
    {{4, 1, 2, 2, 8}, 1},   {{12, 2, 4, 2, 8}, 3},    {{15, 1, 6, 2, 16}, 5},
    {{12, 2, 3, 1, 24}, 4}, {{140, 1, 2, 1, 16}, 70},
};

std::string name(const Case& c, Cut cut) {
  return "S=" + std::to_string(c.s.S) + " C=" + std::to_string(c.C) +
         " B=" + std::to_string(c.s.B) + " Hq=" + std::to_string(c.s.Hq) +
         " Hkv=" + std::to_string(c.s.Hkv) + " D=" + std::to_string(c.s.D) +
         (cut == Cut::Ring ? " ring" : " prefix");
}

template <typename T>
void blocks_equal_whole(double rtol, double atol, const AttentionDropout* drop) {
  uint32_t seed = 300;
  for (const Case& c : kCases) {
    const Whole<T> w(c.s, seed += 10);
    const Outputs<T> ref = whole_ref(w, drop);
    for (Cut cut : {Cut::Ring, Cut::Prefix}) {
      for (bool fast : {false, true}) {
        for (int threads : {1, 3}) {
          if (!fast && threads == 3) continue;
          SCOPED_TRACE(name(c, cut) + (fast ? " fast" : " ref") +
                       " threads=" + std::to_string(threads) + (drop ? " dropout" : ""));
          ScopedOmpThreads scoped(threads);
          expect_outputs_close(by_blocks(w, c.C, cut, fast, drop), ref, rtol, atol);
        }
      }
    }
  }
}

TEST(AttentionBlock, BlocksEqualTheWholeSequenceF64) {
  blocks_equal_whole<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol, nullptr);
}
TEST(AttentionBlock, BlocksEqualTheWholeSequenceF32) {
  blocks_equal_whole<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol, nullptr);
}
TEST(AttentionBlock, BlocksEqualTheWholeSequenceWithDropoutF64) {
  const AttentionDropout drop{0.3, kDropKey, &kCounters, 2};
  blocks_equal_whole<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol, &drop);
}
TEST(AttentionBlock, BlocksEqualTheWholeSequenceWithDropoutF32) {
  const AttentionDropout drop{0.1, kDropKey, &kCounters, 0};
  blocks_equal_whole<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol, &drop);
}

// loss = sum(merged out * R), the forward by ring blocks (references and merge_ref): the sums of
// the blocks' backward shares (fast path and reference) against f64 central differences.
TEST(AttentionBlock, MergedBlocksMatchFiniteDifferences) {
  const AttentionDropout drop{0.3, kDropKey, &kCounters, 1};
  const Case cases[] = {{{9, 2, 4, 2, 8}, 3}, {{8, 1, 3, 1, 4}, 2}};
  uint32_t seed = 700;
  for (const Case& c : cases) {
    for (const AttentionDropout* d : {static_cast<const AttentionDropout*>(nullptr), &drop}) {
      SCOPED_TRACE(name(c, Cut::Ring) + (d ? " dropout" : ""));
      Whole<double> w(c.s, seed += 10);
      const std::vector<double> R = w.dout;
      auto loss = [&]() {
        const Outputs<double> o = by_blocks(w, c.C, Cut::Ring, false, d);
        double acc = 0.0;
        for (int64_t i = 0; i < w.n_q; ++i) acc += o.out[i] * R[i];
        return acc;
      };
      for (bool fast : {false, true}) {
        const Outputs<double> g = by_blocks(w, c.C, Cut::Ring, fast, d);
        const std::string which = fast ? "fast " : "ref ";
        EXPECT_TRUE(check_gradient(loss, w.q.data(), g.dq.data(), w.n_q, which + "dq"));
        EXPECT_TRUE(check_gradient(loss, w.k.data(), g.dk.data(), w.n_kv, which + "dk"));
        EXPECT_TRUE(check_gradient(loss, w.v.data(), g.dv.data(), w.n_kv, which + "dv"));
      }
    }
  }
}

// The merge's CPU path against its reference: random partials (lse of both signs and far apart,
// one side at -inf: no key seen, weight 0), lse a strided part of a longer row.
TEST(AttentionMerge, FastMatchesRef) {
  for (const AttentionShape& s0 :
       {AttentionShape{5, 2, 3, 1, 8}, AttentionShape{70, 3, 4, 1, 40}}) {
    AttentionShape s = s0;
    s.lse_stride = s.S + 3;
    const int64_t n_o = s.S * s.B * s.Hq * s.D, n_l = s.B * s.Hq * s.lse_stride;
    for (bool f64 : {true, false}) {
      SCOPED_TRACE("S=" + std::to_string(s.S) + (f64 ? " f64" : " f32"));
      auto run = [&](auto zero) {
        using T = decltype(zero);
        std::vector<T> o1 = random_vec<T>(n_o, 1), o2 = random_vec<T>(n_o, 2);
        std::vector<T> l1 = random_vec<T>(n_l, 3, -20.0, 20.0), l2 = random_vec<T>(n_l, 4, -3, 3);
        l2[1] = -std::numeric_limits<T>::infinity();
        l1[2] = -std::numeric_limits<T>::infinity();
        std::vector<T> o_ref = o1, l_ref = l1;
        attention_merge_ref<T>(o_ref.data(), l_ref.data(), o2.data(), l2.data(), s);
        for (int threads : {1, 3}) {
          ScopedOmpThreads scoped(threads);
          std::vector<T> o = o1, l = l1;
          attention_merge<T>(cpu_exec(), o.data(), l.data(), o2.data(), l2.data(), s);
          const double tol = f64 ? moecore::testing::kF64Rtol : moecore::testing::kF32Rtol;
          EXPECT_TRUE(all_close(o.data(), o_ref.data(), n_o, tol, tol)) << "out";
          EXPECT_TRUE(all_close(l.data(), l_ref.data(), n_l, tol, tol)) << "lse";
          // Outside the first S of each lse row nothing moves.
          for (int64_t row = 0; row < s.B * s.Hq; ++row) {
            for (int64_t i = s.S; i < s.lse_stride; ++i) {
              EXPECT_EQ(l[row * s.lse_stride + i], l1[row * s.lse_stride + i]);
            }
          }
        }
      };
      if (f64)
        run(double(0));
      else
        run(float(0));
    }
  }
}

// The merge weighs by the exp of the lse: merging (o, l) with (o', l) gives the mean and l + log 2.
TEST(AttentionMerge, EqualHalvesGiveTheMean) {
  const AttentionShape s{1, 1, 1, 1, 2};
  std::vector<double> o{1.0, 3.0}, o2{3.0, 5.0}, l{0.5}, l2{0.5};
  attention_merge<double>(cpu_exec(), o.data(), l.data(), o2.data(), l2.data(), s);
  EXPECT_DOUBLE_EQ(o[0], 2.0);
  EXPECT_DOUBLE_EQ(o[1], 4.0);
  EXPECT_DOUBLE_EQ(l[0], 0.5 + std::log(2.0));
}

TEST(AttentionBlock, RefusesFullyMaskedBlocksAndOverlappingLse) {
  std::vector<double> x(4096, 0.0), ws(1 << 20, 0.0);
  AttentionShape s{3, 1, 2, 1, 8};
  s.Sk = 3, s.q_offset = 3, s.k_offset = 6;  // every query precedes every key
  EXPECT_THROW_MSG(attention_forward<double>(cpu_exec(), x.data(), x.data(), x.data(), x.data(),
                                             x.data(), s, ws.data(), nullptr),
                   "fully masked");
  EXPECT_THROW_MSG(
      attention_forward_ref<double>(x.data(), x.data(), x.data(), x.data(), x.data(), s, nullptr),
      "fully masked");
  s.k_offset = 0, s.lse_stride = 2;
  EXPECT_THROW_MSG(
      attention_backward<double>(cpu_exec(), x.data(), x.data(), x.data(), x.data(), x.data(),
                                 x.data(), x.data(), x.data(), x.data(), s, ws.data(), nullptr),
      "lse_stride=2 < S=3");
  AttentionShape m{3, 1, 2, 1, 8};
  m.lse_stride = 1;
  EXPECT_THROW_MSG(attention_merge<double>(cpu_exec(), x.data(), x.data(), x.data(), x.data(), m),
                   "lse_stride=1 < S=3");
}

}  // namespace
}  // namespace moecore::ops
