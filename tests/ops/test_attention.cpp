// Causal GQA attention: fast path vs plain-loop reference (f32 and f64, awkward shapes, guard
// bytes around every output and the workspace), both backwards vs fp64 finite differences,
// causality of the forward and backward, determinism across thread counts, shape errors.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/attention_problem.h"
#include "common/testing.h"
#include "core/check.h"
#include "core/rng.h"
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
using Problem = testing::AttentionProblem<T>;

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
void run_fast(Results<T>& r, const Problem<T>& p, const AttentionDropout* drop = nullptr) {
  Guarded<T> ws(attention_workspace_elems(p.s, omp_get_max_threads()));
  attention_forward<T>(cpu_exec(), r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(),
                       p.s, ws.data(), drop);
  attention_backward<T>(cpu_exec(), r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(),
                        p.q.data(), p.k.data(), p.v.data(), r.out.data(), r.lse.data(), p.s,
                        ws.data(), drop);
  EXPECT_TRUE(ws.intact()) << "workspace overrun";
}

template <typename T>
void run_ref(Results<T>& r, const Problem<T>& p, const AttentionDropout* drop = nullptr) {
  attention_forward_ref<T>(r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(), p.s,
                           drop);
  attention_backward_ref<T>(r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(),
                            p.k.data(), p.v.data(), r.out.data(), r.lse.data(), p.s, drop);
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
void fast_matches_ref(double rtol, double atol, const AttentionDropout* drop = nullptr) {
  uint32_t seed = 100;
  for (const AttentionShape& s : kShapes) {
    Problem<T> p(s, seed += 10);
    Results<T> ref(p);
    run_ref(ref, p, drop);
    EXPECT_TRUE(ref.intact()) << name(s);
    for (int threads : {1, 3}) {
      SCOPED_TRACE(name(s) + " threads=" + std::to_string(threads) +
                   (drop ? " dropout p=" + std::to_string(drop->p) : ""));
      ScopedOmpThreads scoped(threads);
      Results<T> fast(p);
      run_fast(fast, p, drop);
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
      attention_forward_ref<double>(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s,
                                    nullptr);
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
                                            buf.data(), not_grouped, nullptr),
               moecore::Error);
  EXPECT_THROW(attention_forward<float>(cpu_exec(), buf.data(), buf.data(), buf.data(), buf.data(),
                                        buf.data(), not_grouped, buf.data(), nullptr),
               moecore::Error);
  EXPECT_THROW(attention_workspace_elems({4, 1, 2, 1, 8}, 0), moecore::Error);
  EXPECT_THROW(attention_workspace_elems({4, 1, 2, 1, 0}, 1), moecore::Error);
}

// ---- Attention dropout ----

const DropoutCounters kCounters{23, 5};
const uint64_t kDropKey = rng_key(99, "decoder.layers.0.self_attention.core_attention.dropout");

TEST(AttentionDropout, FastMatchesRefF32) {
  for (double p : {0.1, 0.3}) {
    const AttentionDropout drop{p, kDropKey, &kCounters, 0};
    fast_matches_ref<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol, &drop);
  }
}

TEST(AttentionDropout, FastMatchesRefF64) {
  for (double p : {0.1, 0.3}) {
    const AttentionDropout drop{p, kDropKey, &kCounters, 3};
    fast_matches_ref<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol, &drop);
  }
}

// The mask is fixed by the counters, so loss = sum(out * R) is smooth in q, k, v: both
// backwards against fp64 central differences of the reference forward with the same dropout.
TEST(AttentionDropout, BackwardMatchesFiniteDifferences) {
  const AttentionShape shapes[] = {{9, 2, 4, 2, 8}, {6, 1, 3, 1, 8}, {5, 2, 2, 2, 4}};
  const AttentionDropout drop{0.3, kDropKey, &kCounters, 1};
  uint32_t seed = 17;
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(name(s));
    Problem<double> p(s, seed += 10);
    const std::vector<double>& R = p.dout;
    std::vector<double> out(p.n_q), lse(p.n_lse);
    auto loss = [&]() {
      attention_forward_ref<double>(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s,
                                    &drop);
      double acc = 0.0;
      for (int64_t i = 0; i < p.n_q; ++i) acc += out[i] * R[i];
      return acc;
    };
    Results<double> ref(p), fast(p);
    run_ref(ref, p, &drop);
    run_fast(fast, p, &drop);
    for (const Results<double>* r : {&ref, &fast}) {
      const std::string which = r == &ref ? "ref " : "fast ";
      EXPECT_TRUE(check_gradient(loss, p.q.data(), r->dq.data(), p.n_q, which + "dq"));
      EXPECT_TRUE(check_gradient(loss, p.k.data(), r->dk.data(), p.n_kv, which + "dk"));
      EXPECT_TRUE(check_gradient(loss, p.v.data(), r->dv.data(), p.n_kv, which + "dv"));
    }
  }
}

// p = 0 is no dropout: bitwise the nullptr results (fast and reference, counters not needed).
TEST(AttentionDropout, ZeroIsNoDropout) {
  const AttentionShape s{70, 2, 6, 2, 40};
  const Problem<float> p(s, 31);
  const AttentionDropout zero{0.0, kDropKey, nullptr, 0};
  Results<float> none(p), z(p), none_r(p), z_r(p);
  run_fast(none, p);
  run_fast(z, p, &zero);
  run_ref(none_r, p);
  run_ref(z_r, p, &zero);
  expect_close(z, none, p.n_q, p.n_kv, p.n_lse, 0, 0);
  expect_close(z_r, none_r, p.n_q, p.n_kv, p.n_lse, 0, 0);
}

// With V the identity (v_j = e_j, D >= S) out_i[j] = P_ij M_ij / (1 - p) with P_ij > 0: the zeros
// of out spell the mask, which must be the documented keep bit of the global head, sample,
// query and key. The saved lse is that of the undropped scores.
template <typename T>
void mask_is_the_keep_bit(bool fast) {
  SCOPED_TRACE(fast ? "fast" : "ref");
  const AttentionShape s{13, 2, 4, 2, 16};
  const double p = 0.4;
  const AttentionDropout drop{p, kDropKey, &kCounters, 6};
  Problem<T> pr(s, 41);
  std::fill(pr.v.begin(), pr.v.end(), T(0));
  for (int64_t j = 0; j < s.S; ++j) {
    for (int64_t bg = 0; bg < s.B * s.Hkv; ++bg) pr.v[(j * s.B * s.Hkv + bg) * s.D + j] = T(1);
  }
  Results<T> r(pr), none(pr);
  fast ? run_fast(r, pr, &drop) : run_ref(r, pr, &drop);
  fast ? run_fast(none, pr) : run_ref(none, pr);
  const uint32_t threshold = dropout_threshold(p);
  int64_t dropped = 0;
  for (int64_t i = 0; i < s.S; ++i) {
    for (int64_t b = 0; b < s.B; ++b) {
      for (int64_t h = 0; h < s.Hq; ++h) {
        const uint64_t key = dropout_head_key(kDropKey, 6 + h);
        for (int64_t j = 0; j <= i; ++j) {
          const bool keep = dropout_keep(key, 23, 5 + b, i, j, threshold);
          const T o = r.out[((i * s.B + b) * s.Hq + h) * s.D + j];
          ASSERT_EQ(o != T(0), keep) << "i=" << i << " b=" << b << " h=" << h << " j=" << j;
          dropped += !keep;
        }
      }
    }
  }
  EXPECT_GT(dropped, 0);
  expect_close(r, none, 0, 0, pr.n_lse, 0, 0);  // lse alone: bitwise the undropped one
}

TEST(AttentionDropout, MaskIsTheDocumentedKeepBit) {
  mask_is_the_keep_bit<float>(true);
  mask_is_the_keep_bit<double>(true);
  mask_is_the_keep_bit<double>(false);
}

// Heads h0.. of a tensor-parallel split, computed alone with head0 = h0, are bitwise those heads
// of the whole problem (the mask follows the global head); and a micro-batch's sample b at
// sample0 is the same sample as column 0 of a micro-batch that starts at sample0 + b.
template <typename T>
void follows_global_head_and_sample(bool fast) {
  SCOPED_TRACE(fast ? "fast" : "ref");
  const AttentionShape full{70, 2, 6, 3, 16};  // GQA groups of 2
  const AttentionDropout drop{0.3, kDropKey, &kCounters, 0};
  const Problem<T> p(full, 51);
  Results<T> whole(p);
  fast ? run_fast(whole, p, &drop) : run_ref(whole, p, &drop);

  // Heads 2..5 (kv groups 1..2): a rank of a TP 3 split holding two groups would start at 2.
  const int64_t h0 = 2, nh = 4, g0 = 1, ng = 2;
  Problem<T> part(AttentionShape{full.S, full.B, nh, ng, full.D}, 52);
  for (int64_t sb = 0; sb < full.S * full.B; ++sb) {
    for (int64_t x = 0; x < nh * full.D; ++x) {
      part.q[sb * nh * full.D + x] = p.q[(sb * full.Hq + h0) * full.D + x];
      part.dout[sb * nh * full.D + x] = p.dout[(sb * full.Hq + h0) * full.D + x];
    }
    for (int64_t x = 0; x < ng * full.D; ++x) {
      part.k[sb * ng * full.D + x] = p.k[(sb * full.Hkv + g0) * full.D + x];
      part.v[sb * ng * full.D + x] = p.v[(sb * full.Hkv + g0) * full.D + x];
    }
  }
  for (int64_t head0 : {h0, int64_t{0}}) {
    const AttentionDropout part_drop{0.3, kDropKey, &kCounters, head0};
    Results<T> r(part);
    fast ? run_fast(r, part, &part_drop) : run_ref(r, part, &part_drop);
    bool same = true;
    for (int64_t sb = 0; sb < full.S * full.B; ++sb) {
      same &= std::memcmp(&r.out[sb * nh * full.D], &whole.out[(sb * full.Hq + h0) * full.D],
                          nh * full.D * sizeof(T)) == 0;
      same &= std::memcmp(&r.dq[sb * nh * full.D], &whole.dq[(sb * full.Hq + h0) * full.D],
                          nh * full.D * sizeof(T)) == 0;
      same &= std::memcmp(&r.dk[sb * ng * full.D], &whole.dk[(sb * full.Hkv + g0) * full.D],
                          ng * full.D * sizeof(T)) == 0;
      same &= std::memcmp(&r.dv[sb * ng * full.D], &whole.dv[(sb * full.Hkv + g0) * full.D],
                          ng * full.D * sizeof(T)) == 0;
    }
    EXPECT_EQ(same, head0 == h0) << "head0=" << head0;
  }

  // Sample 1 of the micro-batch at sample0 = 5 is sample 0 of one starting at 6.
  Problem<T> one(AttentionShape{full.S, 1, full.Hq, full.Hkv, full.D}, 53);
  const int64_t row_q = full.Hq * full.D, row_kv = full.Hkv * full.D;
  for (int64_t s = 0; s < full.S; ++s) {
    std::copy_n(&p.q[(s * 2 + 1) * row_q], row_q, &one.q[s * row_q]);
    std::copy_n(&p.dout[(s * 2 + 1) * row_q], row_q, &one.dout[s * row_q]);
    std::copy_n(&p.k[(s * 2 + 1) * row_kv], row_kv, &one.k[s * row_kv]);
    std::copy_n(&p.v[(s * 2 + 1) * row_kv], row_kv, &one.v[s * row_kv]);
  }
  const DropoutCounters next{kCounters.iteration, kCounters.sample0 + 1};
  const AttentionDropout one_drop{0.3, kDropKey, &next, 0};
  Results<T> r(one);
  fast ? run_fast(r, one, &one_drop) : run_ref(r, one, &one_drop);
  for (int64_t s = 0; s < full.S; ++s) {
    ASSERT_EQ(0, std::memcmp(&r.out[s * row_q], &whole.out[(s * 2 + 1) * row_q], row_q * sizeof(T)))
        << "out s=" << s;
    ASSERT_EQ(0, std::memcmp(&r.dq[s * row_q], &whole.dq[(s * 2 + 1) * row_q], row_q * sizeof(T)))
        << "dq s=" << s;
    ASSERT_EQ(0,
              std::memcmp(&r.dk[s * row_kv], &whole.dk[(s * 2 + 1) * row_kv], row_kv * sizeof(T)))
        << "dk s=" << s;
  }
}

TEST(AttentionDropout, FollowsTheGlobalHeadAndSample) {
  follows_global_head_and_sample<float>(true);
  follows_global_head_and_sample<double>(true);
  follows_global_head_and_sample<double>(false);
}

TEST(AttentionDropout, DeterministicAcrossThreadCounts) {
  const AttentionShape shapes[] = {{70, 3, 6, 2, 16}, {130, 2, 8, 2, 40}};
  const AttentionDropout drop{0.2, kDropKey, &kCounters, 0};
  for (const AttentionShape& s : shapes) {
    Problem<float> p(s, 3);
    Results<float> base(p);
    {
      ScopedOmpThreads scoped(1);
      run_fast(base, p, &drop);
    }
    for (int threads : {2, 4}) {
      SCOPED_TRACE(name(s) + " threads=" + std::to_string(threads));
      ScopedOmpThreads scoped(threads);
      Results<float> r(p);
      run_fast(r, p, &drop);
      expect_close(r, base, p.n_q, p.n_kv, p.n_lse, 0, 0);
    }
  }
}

TEST(AttentionDropout, RejectsBadArguments) {
  const AttentionShape s{4, 1, 2, 1, 8};
  std::vector<float> buf(4 * 2 * 8, 0.0f);
  const AttentionDropout no_counters{0.1, kDropKey, nullptr, 0},
      too_big{1.0, kDropKey, &kCounters, 0};
  for (const AttentionDropout* d : {&no_counters, &too_big}) {
    EXPECT_THROW(attention_forward_ref<float>(buf.data(), buf.data(), buf.data(), buf.data(),
                                              buf.data(), s, d),
                 moecore::Error);
    Guarded<float> ws(attention_workspace_elems(s, omp_get_max_threads()));
    EXPECT_THROW(attention_forward<float>(cpu_exec(), buf.data(), buf.data(), buf.data(),
                                          buf.data(), buf.data(), s, ws.data(), d),
                 moecore::Error);
  }
}

}  // namespace
}  // namespace moecore::ops
