// Causal GQA attention: fast path vs plain-loop reference (f32 and f64, awkward shapes, guard
// bytes around every output and the workspace), both backwards vs fp64 finite differences,
// causality of the forward and backward, determinism across thread counts, shape errors.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/attention.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::Guarded;
using moecore::testing::random_vec;

using moecore::testing::ScopedOmpThreads;

std::string name(const AttentionShape& s) {
  return "S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) + " Hq=" + std::to_string(s.Hq) +
         " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D);
}

// S = 1 (one key), odd S, S crossing the 64-row block of the fast path (70, 129), MHA, MQA
// (Hq = 4, Hkv = 1) and GQA groups of 3 (Hq = 6, Hkv = 2). D covers each register-tile width of
// the f32 kernels (16 floats per vector): 1 vector with a tail (8), 1 (16), 2 (32), 3 with a
// tail (40), 4 (64) and two chunks of 4 (128); GQA groups of 4 (Hq = 8, Hkv = 2) are packed as
// one run of heads.
const AttentionShape kShapes[] = {
    {1, 1, 1, 1, 8},    {1, 3, 4, 1, 16},  {7, 2, 2, 2, 8},    {7, 1, 4, 1, 16},  {33, 2, 6, 2, 8},
    {33, 3, 4, 1, 16},  {33, 1, 3, 3, 16}, {70, 2, 6, 2, 8},   {129, 1, 4, 1, 8}, {65, 2, 2, 2, 32},
    {100, 1, 4, 2, 40}, {70, 2, 8, 2, 64}, {50, 1, 2, 1, 128},
};

template <typename T>
struct Problem {
  AttentionShape s;
  int64_t n_q, n_kv, n_lse;
  std::vector<T> q, k, v, dout;
  Problem(const AttentionShape& shape, uint32_t seed) : s(shape) {
    n_q = s.S * s.B * s.Hq * s.D;
    n_kv = s.S * s.B * s.Hkv * s.D;
    n_lse = s.B * s.Hq * s.S;
    // q, k in [-2, 2]: scores of O(1) so the softmax is neither flat nor one-hot.
    q = random_vec<T>(n_q, seed, -2.0, 2.0);
    k = random_vec<T>(n_kv, seed + 1, -2.0, 2.0);
    v = random_vec<T>(n_kv, seed + 2);
    dout = random_vec<T>(n_q, seed + 3);
  }
};

template <typename T>
struct Results {
  Guarded<T> out, lse, dq, dk, dv;
  // NaN fill: any element an op forgets to assign fails the comparison.
  explicit Results(const Problem<T>& p)
      : out(p.n_q, kNaN), lse(p.n_lse, kNaN), dq(p.n_q, kNaN), dk(p.n_kv, kNaN), dv(p.n_kv, kNaN) {}
  bool intact() const {
    return out.intact() && lse.intact() && dq.intact() && dk.intact() && dv.intact();
  }
  static constexpr T kNaN = std::numeric_limits<T>::quiet_NaN();
};

template <typename T>
void run_fast(Results<T>& r, const Problem<T>& p) {
  Guarded<T> ws(attention_workspace_elems(p.s, omp_get_max_threads()));
  attention_forward<T>(cpu_exec(), r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(),
                       p.s, ws.data());
  attention_backward<T>(cpu_exec(), r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(),
                        p.q.data(), p.k.data(), p.v.data(), r.out.data(), r.lse.data(), p.s,
                        ws.data());
  EXPECT_TRUE(ws.intact()) << "workspace overrun";
}

template <typename T>
void run_ref(Results<T>& r, const Problem<T>& p) {
  attention_forward_ref<T>(r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(), p.s);
  attention_backward_ref<T>(r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(),
                            p.k.data(), p.v.data(), r.out.data(), r.lse.data(), p.s);
}

template <typename T>
void expect_close(const Results<T>& a, const Results<T>& b, int64_t n_q, int64_t n_kv,
                  int64_t n_lse, double rtol, double atol) {
  EXPECT_TRUE(all_close(a.out.data(), b.out.data(), n_q, rtol, atol)) << "out";
  EXPECT_TRUE(all_close(a.lse.data(), b.lse.data(), n_lse, rtol, atol)) << "lse";
  EXPECT_TRUE(all_close(a.dq.data(), b.dq.data(), n_q, rtol, atol)) << "dq";
  EXPECT_TRUE(all_close(a.dk.data(), b.dk.data(), n_kv, rtol, atol)) << "dk";
  EXPECT_TRUE(all_close(a.dv.data(), b.dv.data(), n_kv, rtol, atol)) << "dv";
}

template <typename T>
void fast_matches_ref(double rtol, double atol) {
  uint32_t seed = 100;
  for (const AttentionShape& s : kShapes) {
    Problem<T> p(s, seed += 10);
    Results<T> ref(p);
    run_ref(ref, p);
    EXPECT_TRUE(ref.intact()) << name(s);
    for (int threads : {1, 3}) {
      SCOPED_TRACE(name(s) + " threads=" + std::to_string(threads));
      ScopedOmpThreads scoped(threads);
      Results<T> fast(p);
      run_fast(fast, p);
      EXPECT_TRUE(fast.intact());
      expect_close(fast, ref, p.n_q, p.n_kv, p.n_lse, rtol, atol);
    }
  }
}

TEST(Attention, FastMatchesRefF32) {
  fast_matches_ref<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol);
}

TEST(Attention, FastMatchesRefF64) {
  fast_matches_ref<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol);
}

// loss = sum(out * R) for fixed random R, so dL/dout = R; both backwards against fp64 central
// differences of the reference forward.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  const AttentionShape shapes[] = {{9, 2, 4, 2, 8}, {6, 1, 3, 1, 8}, {5, 2, 2, 2, 4}};
  uint32_t seed = 7;
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(name(s));
    Problem<double> p(s, seed += 10);
    const std::vector<double>& R = p.dout;
    std::vector<double> out(p.n_q), lse(p.n_lse);
    auto loss = [&]() {
      attention_forward_ref<double>(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s);
      double acc = 0.0;
      for (int64_t i = 0; i < p.n_q; ++i) acc += out[i] * R[i];
      return acc;
    };
    Results<double> ref(p), fast(p);
    run_ref(ref, p);
    run_fast(fast, p);
    for (const Results<double>* r : {&ref, &fast}) {
      const std::string which = r == &ref ? "ref " : "fast ";
      EXPECT_TRUE(check_gradient(loss, p.q.data(), r->dq.data(), p.n_q, which + "dq"));
      EXPECT_TRUE(check_gradient(loss, p.k.data(), r->dk.data(), p.n_kv, which + "dk"));
      EXPECT_TRUE(check_gradient(loss, p.v.data(), r->dv.data(), p.n_kv, which + "dv"));
    }
  }
}

// Changing k, v at position s0 leaves out, lse and dq at positions < s0 bitwise unchanged;
// changing q, dout at position s0 leaves dk, dv at positions > s0 bitwise unchanged.
template <typename T>
void causal(bool fast) {
  const AttentionShape s{70, 2, 4, 2, 8};
  const int64_t s0 = 40;  // inside the second row block of the fast path
  const int64_t row_q = s.B * s.Hq * s.D, row_kv = s.B * s.Hkv * s.D;
  auto run = [&](Results<T>& r, const Problem<T>& p) { fast ? run_fast(r, p) : run_ref(r, p); };
  const Problem<T> p(s, 55);
  Results<T> base(p);
  run(base, p);

  Problem<T> p_kv = p;
  for (int64_t i = s0 * row_kv; i < (s0 + 1) * row_kv; ++i) {
    p_kv.k[i] += T(0.75);
    p_kv.v[i] -= T(1.5);
  }
  Results<T> r_kv(p);
  run(r_kv, p_kv);
  EXPECT_TRUE(all_close(r_kv.out.data(), base.out.data(), s0 * row_q, 0, 0)) << "out before s0";
  EXPECT_TRUE(all_close(r_kv.dq.data(), base.dq.data(), s0 * row_q, 0, 0)) << "dq before s0";
  for (int64_t bh = 0; bh < s.B * s.Hq; ++bh) {
    EXPECT_TRUE(all_close(r_kv.lse.data() + bh * s.S, base.lse.data() + bh * s.S, s0, 0, 0))
        << "lse before s0";
  }
  // The perturbation does reach row s0 (the test is not vacuous).
  EXPECT_FALSE(all_close(r_kv.out.data() + s0 * row_q, base.out.data() + s0 * row_q, row_q, 0, 0));

  Problem<T> p_q = p;
  for (int64_t i = s0 * row_q; i < (s0 + 1) * row_q; ++i) {
    p_q.q[i] *= T(-1.25);
    p_q.dout[i] += T(0.5);
  }
  Results<T> r_q(p);
  run(r_q, p_q);
  const int64_t after = (s0 + 1) * row_kv, n_after = (s.S - s0 - 1) * row_kv;
  EXPECT_TRUE(all_close(r_q.dk.data() + after, base.dk.data() + after, n_after, 0, 0))
      << "dk after s0";
  EXPECT_TRUE(all_close(r_q.dv.data() + after, base.dv.data() + after, n_after, 0, 0))
      << "dv after s0";
  EXPECT_FALSE(all_close(r_q.dk.data() + s0 * row_kv, base.dk.data() + s0 * row_kv, row_kv, 0, 0));
}

TEST(Attention, CausalFastF32) {
  causal<float>(true);
}
TEST(Attention, CausalFastF64) {
  causal<double>(true);
}
TEST(Attention, CausalRefF64) {
  causal<double>(false);
}

// One task owns each (b, kv head), so results do not depend on the thread count or the
// schedule (nor on how many heads the forward packs per task, which follows the thread count).
TEST(Attention, DeterministicAcrossThreadCounts) {
  const AttentionShape shapes[] = {{70, 3, 6, 2, 16}, {130, 2, 8, 2, 40}, {96, 1, 4, 4, 64}};
  for (const AttentionShape& s : shapes) {
    Problem<float> p(s, 3);
    Results<float> base(p);
    {
      ScopedOmpThreads scoped(1);
      run_fast(base, p);
    }
    for (int threads : {2, 3, 3, 8}) {
      SCOPED_TRACE(name(s) + " threads=" + std::to_string(threads));
      ScopedOmpThreads scoped(threads);
      Results<float> r(p);
      run_fast(r, p);
      expect_close(r, base, p.n_q, p.n_kv, p.n_lse, 0, 0);
    }
  }
}

TEST(Attention, RejectsBadShapes) {
  const AttentionShape not_grouped{4, 1, 6, 4, 8};
  std::vector<float> buf(4 * 6 * 8, 0.0f);
  EXPECT_THROW(attention_workspace_elems(not_grouped, 1), moecore::Error);
  EXPECT_THROW(attention_forward_ref<float>(buf.data(), buf.data(), buf.data(), buf.data(),
                                            buf.data(), not_grouped),
               moecore::Error);
  EXPECT_THROW(attention_forward<float>(cpu_exec(), buf.data(), buf.data(), buf.data(), buf.data(),
                                        buf.data(), not_grouped, buf.data()),
               moecore::Error);
  EXPECT_THROW(attention_workspace_elems({4, 1, 2, 1, 8}, 0), moecore::Error);
  EXPECT_THROW(attention_workspace_elems({4, 1, 2, 1, 0}, 1), moecore::Error);
}

}  // namespace
}  // namespace moecore::ops
