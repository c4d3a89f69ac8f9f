// Cases: the router's f64 math after the gate GEMM: the score functions and the aux scores'
// backward (softmax, sigmoid, sqrt(softplus); T = 0, E = 1, E not divisible by 8, large
// |logits|, in place), the routing key, group-limited masking (tied keys), Sinkhorn, the top-K
// prefix of a top-(K+1), capacity dropping (K = 1, K = E, experts with no tokens, every pair
// over capacity, tied probs, dropless), routing replay's table copies (tokens outside the table),
// the gather and probs at the chosen experts and their backward (every ProbsFn, K = 1, K = E,
// dropped slots), and the aux / seq-aux / z losses and their gradients. Comparisons as each op's
// own test (tests/ops/test_router_*.cpp, test_routing_table.cpp): keys, masks, Sinkhorn's cost,
// selections, table copies, gathers, the elementwise score functions and kept_prob_grads
// bitwise; the softmax scores, probs, loss values and every gradient within kF64Rtol/Atol.
// A backward takes the reference forward's saved values.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "backend_case.h"
#include "ops/router_losses.h"
#include "ops/router_probs.h"
#include "ops/router_scores.h"
#include "ops/router_select.h"
#include "ops/routing_table.h"

namespace moecore::backend_test {
namespace {

using ops::ProbsFn;
using ops::ScoreFn;

const ScoreFn kScoreFns[] = {ScoreFn::Softmax, ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus};
const char* score_name(ScoreFn fn) {
  return fn == ScoreFn::Softmax ? "softmax" : fn == ScoreFn::Sigmoid ? "sigmoid" : "sqrtsoftplus";
}
const ProbsFn kProbsFns[] = {ProbsFn::SoftmaxOverK, ProbsFn::SoftmaxOverE, ProbsFn::Normalized,
                             ProbsFn::SigmoidTop1};

struct TE {
  int64_t T, E;
};
// T = 0, E = 1, E not divisible by 8, a parallel shape.
const TE kScoreShapes[] = {{1, 1}, {3, 2}, {13, 7}, {5, 64}, {70, 256}, {0, 8}};


// ---- router_scores.h ----

// Softmax within the f64 tolerance; sigmoid / sqrt(softplus) bitwise (the same scalar
// functions in the same order). Once more without aux scores, in place.
void router_scores_case(const Exec& ex) {
  uint32_t seed = 100;
  for (ScoreFn fn : kScoreFns) {
    for (auto [T, E] : kScoreShapes) {
      BACKEND_TRACE(score_name(fn) << " T=" << T << " E=" << E);
      const auto l = random_vec<double>(T * E, seed++, -30, 30);
      std::vector<double> s_ref(T * E), a_ref(T * E);
      ops::router_scores_ref(fn, s_ref.data(), a_ref.data(), l.data(), T, E);
      Guarded<double> s = nan_out<double>(T * E), a = nan_out<double>(T * E);
      Guarded<double> y = guarded(l);  // in place, no aux scores
      {
        Staging st(ex);
        ops::router_scores(ex, fn, st.out(s), st.out(a), st.in(l), T, E);
        double* const io = st.out(y);
        ops::router_scores(ex, fn, io, nullptr, io, T, E);
        st.back();
      }
      if (fn == ScoreFn::Softmax) {
        expect_close(s, s_ref.data(), "scores_TE");
        expect_close(a, a_ref.data(), "aux_scores_TE");
        expect_close(y, s_ref.data(), "scores_TE in place");
      } else {
        expect_bitwise(s, s_ref.data(), "scores_TE");
        expect_bitwise(a, a_ref.data(), "aux_scores_TE");
        expect_bitwise(y, s_ref.data(), "scores_TE in place");
      }
    }
  }
}

// dlogits accumulates onto random values; daux is scratch (guards only).
void aux_scores_backward_case(const Exec& ex) {
  uint32_t seed = 120;
  for (ScoreFn fn : kScoreFns) {
    for (auto [T, E] : kScoreShapes) {
      BACKEND_TRACE(score_name(fn) << " T=" << T << " E=" << E);
      const auto l = random_vec<double>(T * E, seed++, -4, 4);
      std::vector<double> s(T * E), a(T * E);
      ops::router_scores_ref(fn, s.data(), a.data(), l.data(), T, E);
      const auto daux0 = random_vec<double>(T * E, seed++);
      const auto dl0 = random_vec<double>(T * E, seed++);
      std::vector<double> dl_ref = dl0, daux_ref = daux0;
      ops::aux_scores_backward_ref(fn, dl_ref.data(), daux_ref.data(), a.data(), s.data(),
                                   l.data(), T, E);
      Guarded<double> dl = guarded(dl0), daux = guarded(daux0);
      {
        Staging st(ex);
        ops::aux_scores_backward(ex, fn, st.out(dl), st.out(daux), st.in(a), st.in(s), st.in(l), T,
                                 E);
        st.back();
      }
      expect_close(dl, dl_ref.data(), "dlogits_TE");
      expect_intact(daux, "daux_TE (scratch)");
    }
  }
}

// ---- router_select.h ----

void routing_key_case(const Exec& ex) {
  uint32_t seed = 140;
  for (auto [T, E] : {TE{1, 1}, TE{13, 7}, TE{70, 256}, TE{0, 4}}) {
    const auto src = random_vec<double>(T * E, seed++, -5, 5);
    const auto off = random_vec<float>(E, seed++);
    for (bool sub : {false, true}) {
      for (const float* o : {static_cast<const float*>(nullptr), off.data()}) {
        BACKEND_TRACE("T=" << T << " E=" << E << " subtract=" << sub << " offset=" << !!o);
        std::vector<double> k_ref(T * E);
        ops::routing_key_ref(k_ref.data(), src.data(), o, sub, T, E);
        Guarded<double> k = nan_out<double>(T * E);
        {
          Staging st(ex);
          ops::routing_key(ex, st.out(k), st.in(src), st.in_or_null(o, E), sub, T, E);
          st.back();
        }
        expect_bitwise(k, k_ref.data(), "key_TE");
      }
    }
  }
}

// In place on keys with exact ties (every third key rounded to an integer); scratch: guards.
void group_limited_mask_case(const Exec& ex) {
  struct Case {
    int64_t T, E, G, g, K;
  };
  uint32_t seed = 160;
  for (auto c : {Case{1, 1, 1, 1, 1}, Case{13, 8, 4, 2, 2}, Case{9, 12, 3, 3, 3},
                 Case{17, 64, 8, 4, 8}, Case{5, 30, 5, 1, 6}, Case{7, 8, 8, 8, 8},
                 Case{1, 4, 2, 1, 1}}) {
    BACKEND_TRACE("T=" << c.T << " E=" << c.E << " G=" << c.G << " g=" << c.g << " K=" << c.K);
    auto key = random_vec<double>(c.T * c.E, seed++, -2, 2);
    for (int64_t i = 0; i < c.T * c.E; i += 3) key[i] = std::round(key[i]);
    std::vector<double> k_ref = key;
    ops::group_limited_mask_ref(k_ref.data(), c.T, c.E, c.G, c.g, c.K);
    Guarded<double> k = guarded(key), scratch = nan_out<double>(c.T * c.E);
    {
      Staging st(ex);
      ops::group_limited_mask(ex, st.out(k), st.out(scratch), c.T, c.E, c.G, c.g, c.K);
      st.back();
    }
    expect_bitwise(k, k_ref.data(), "key_TE");
    expect_intact(scratch, "scratch_TE");
  }
}

// The cost bitwise; the factors d0, d1 are the iteration's state (guards only), as in
// tests/ops/test_router_select.cpp.
void sinkhorn_case(const Exec& ex) {
  uint32_t seed = 180;
  for (auto [T, E] : {TE{1, 1}, TE{16, 4}, TE{40, 7}}) {
    BACKEND_TRACE("T=" << T << " E=" << E);
    const auto l = random_vec<double>(T * E, seed++, -2, 2);
    std::vector<double> c_ref(T * E), d0_ref(T), d1_ref(2 * E);
    ops::sinkhorn_balance_ref(c_ref.data(), d0_ref.data(), d1_ref.data(), l.data(), T, E);
    Guarded<double> c = nan_out<double>(T * E), d0 = nan_out<double>(T),
                    d1 = nan_out<double>(2 * E);
    {
      Staging st(ex);
      ops::sinkhorn_balance(ex, st.out(c), st.out(d0), st.out(d1), st.in(l), T, E);
      st.back();
    }
    expect_bitwise(c, c_ref.data(), "cost_TE");
    expect_intact(d0, "d0_T");
    expect_intact(d1, "d1_2E");
  }
}

// K of K + 1 (quantile balancing) and K of K; T = 0, K = 1, K = E.
void topk_prefix_case(const Exec& ex) {
  struct Case {
    int64_t T, K, E;
  };
  uint32_t seed = 200;
  for (auto c : {Case{1, 1, 1}, Case{2, 2, 4}, Case{13, 1, 7}, Case{13, 3, 9}, Case{70, 8, 64},
                 Case{11, 5, 6}, Case{0, 2, 4}}) {
    for (int64_t K1 : {c.K, std::min(c.K + 1, c.E)}) {
      BACKEND_TRACE("T=" << c.T << " K=" << c.K << " K1=" << K1 << " E=" << c.E);
      const auto idx1 = distinct_experts(c.T, K1, c.E, 0.0, seed++);
      std::vector<int32_t> idx_ref(c.T * c.K);
      ops::topk_prefix_ref(idx_ref.data(), idx1.data(), c.T, c.K, K1);
      Guarded<int32_t> idx(c.T * c.K, -7);
      {
        Staging st(ex);
        ops::topk_prefix(ex, st.out(idx), st.in(idx1), c.T, c.K, K1);
        st.back();
      }
      expect_bitwise(idx, idx_ref.data(), "idx_TK");
    }
  }
}

// Routing replay's table copies: a run inside the table, past its last position, before its
// first, wholly outside, no rows, no samples; K = 1; one run above the CPU's OpenMP threshold.
// Store into a table of other values (the entries of other tokens must stay), load into a -7
// fill; both bitwise the references.
void routing_table_case(const Exec& ex) {
  struct Case {
    int64_t B, S, K, rows, pos0;
  };
  uint32_t seed = 240;
  for (auto c : {Case{1, 1, 1, 1, 0}, Case{2, 16, 2, 16, 0}, Case{3, 16, 3, 5, 7},
                 Case{3, 16, 3, 5, 13}, Case{2, 9, 1, 4, -2}, Case{2, 6, 2, 3, 9},
                 Case{2, 8, 4, 0, 0}, Case{0, 4, 2, 2, 0}, Case{4, 512, 8, 512, 0}}) {
    BACKEND_TRACE("B=" << c.B << " S=" << c.S << " K=" << c.K << " rows=" << c.rows
                       << " pos0=" << c.pos0);
    const int64_t n_local = c.rows * c.B * c.K, n_table = c.B * c.S * c.K;
    const auto local = random_vec<int32_t>(n_local, seed++, 0, 1 << 20);
    const auto table0 = random_vec<int32_t>(n_table, seed++, 1 << 20, 1 << 21);
    std::vector<int32_t> table_ref = table0, local_ref(n_local);
    ops::routing_table_store_ref(table_ref.data(), local.data(), c.B, c.S, c.K, c.rows, c.pos0);
    ops::routing_table_load_ref(local_ref.data(), table0.data(), c.B, c.S, c.K, c.rows, c.pos0);
    Guarded<int32_t> table = guarded(table0), loaded(n_local, -7);
    {
      Staging st(ex);
      ops::routing_table_store(ex, st.out(table), st.in(local), c.B, c.S, c.K, c.rows, c.pos0);
      ops::routing_table_load(ex, st.out(loaded), st.in(table0), c.B, c.S, c.K, c.rows, c.pos0);
      st.back();
    }
    expect_bitwise(table, table_ref.data(), "table (store)");
    expect_bitwise(loaded, local_ref.data(), "local_TK (load)");
  }
}

// Routings skewed towards the low experts (some experts get none), tied probs, by probs and by
// position; capacity 0 (dropless), 1 (most pairs dropped) and above every load.
void apply_capacity_case(const Exec& ex) {
  struct Case {
    int64_t T, K, E, cap;
  };
  std::mt19937 gen(220);
  uint32_t seed = 221;
  for (auto c : {Case{1, 1, 1, 1}, Case{13, 2, 8, 3}, Case{13, 4, 4, 10}, Case{20, 1, 7, 2},
                 Case{50, 3, 9, 1}, Case{8, 2, 3, 0}, Case{30, 2, 5, 100}, Case{4, 1, 2, 1}}) {
    std::vector<int32_t> routed(c.T * c.K), perm(c.E);
    for (int64_t t = 0; t < c.T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.begin() + std::min<int64_t>(c.E, c.K + 1), gen);
      for (int64_t k = 0; k < c.K; ++k) routed[t * c.K + k] = perm[k];
    }
    auto p0 = random_vec<double>(c.T * c.K, seed++, 0, 1);
    for (int64_t i = 0; i < c.T * c.K; i += 4) p0[i] = 0.5;  // ties
    for (bool by_probs : {true, false}) {
      BACKEND_TRACE("T=" << c.T << " K=" << c.K << " E=" << c.E << " cap=" << c.cap
                         << " by_probs=" << by_probs);
      std::vector<int32_t> idx_ref(c.T * c.K);
      std::vector<double> p_ref = p0;
      int64_t d_ref = -1;
      ops::apply_capacity_ref(idx_ref.data(), p_ref.data(), &d_ref, routed.data(), c.T, c.K, c.E,
                              c.cap, by_probs);
      Guarded<int32_t> idx(c.T * c.K, -7), cand(c.T * c.K, -7);
      Guarded<int64_t> off(2 * c.E + 1, -7), dropped(1, -7);
      Guarded<double> p = guarded(p0);
      {
        Staging st(ex);
        ops::apply_capacity(ex, st.out(idx), st.out(p), st.out(dropped), st.out(cand), st.out(off),
                            st.in(routed), c.T, c.K, c.E, c.cap, by_probs);
        st.back();
      }
      expect_bitwise(idx, idx_ref.data(), "idx_TK");
      expect_bitwise(p, p_ref.data(), "probs_TK");
      expect_bitwise(dropped, &d_ref, "dropped");
      expect_intact(cand, "cand_N");
      expect_intact(off, "cand_off_2E1");
    }
  }
}

// ---- router_probs.h ----

struct TEK {
  int64_t T, E, K;
};
// K = 1, K = E, E not divisible by 8, T = 0.
const TEK kProbsCases[] = {{1, 1, 1}, {13, 8, 2}, {9, 7, 7}, {20, 13, 1}, {6, 64, 8}, {0, 4, 2}};

const char* probs_name(ProbsFn fn) {
  switch (fn) {
    case ProbsFn::SoftmaxOverK: return "softmax_over_k";
    case ProbsFn::SoftmaxOverE: return "softmax_over_e";
    case ProbsFn::Normalized: return "normalized";
    default: return "sigmoid_top1";
  }
}

// The gather bitwise; the probs (scale 2.5) within the f64 tolerance, from the reference gather.
void gather_topk_probs_case(const Exec& ex) {
  uint32_t seed = 240;
  for (auto c : kProbsCases) {
    const auto src = random_vec<double>(c.T * c.E, seed++, 0.01, 1);
    const auto idx = distinct_experts(c.T, c.K, c.E, 0.0, seed++);
    std::vector<double> v_ref(c.T * c.K);
    ops::gather_topk_ref(v_ref.data(), src.data(), idx.data(), c.T, c.E, c.K);
    {
      BACKEND_TRACE("gather T=" << c.T << " E=" << c.E << " K=" << c.K);
      Guarded<double> v = nan_out<double>(c.T * c.K);
      {
        Staging st(ex);
        ops::gather_topk(ex, st.out(v), st.in(src), st.in(idx), c.T, c.E, c.K);
        st.back();
      }
      expect_bitwise(v, v_ref.data(), "val_TK");
    }
    for (ProbsFn fn : kProbsFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      for (double scale : {1.0, 2.5}) {
        BACKEND_TRACE(probs_name(fn) << " T=" << c.T << " E=" << c.E << " K=" << c.K
                                     << " scale=" << scale);
        std::vector<double> p_ref(c.T * c.K);
        ops::topk_probs_ref(fn, p_ref.data(), v_ref.data(), scale, c.T, c.K);
        Guarded<double> p = nan_out<double>(c.T * c.K);
        {
          Staging st(ex);
          ops::topk_probs(ex, fn, st.out(p), st.in(v_ref), scale, c.T, c.K);
          st.back();
        }
        expect_close(p, p_ref.data(), "probs_TK");
      }
    }
  }
}

// dprobs in f32 and f64, dropped slots (idx -1) get 0: bitwise.
template <typename T>
void kept_prob_grads_case(const Exec& ex) {
  uint32_t seed = 260;
  for (auto c : {TEK{0, 4, 2}, TEK{1, 1, 1}, TEK{13, 7, 3}, TEK{11, 5, 5}, TEK{203, 64, 8}}) {
    const int64_t TK = c.T * c.K;
    for (double drop : {0.0, 0.3}) {
      BACKEND_TRACE(dtype_name<T>() << " T=" << c.T << " K=" << c.K << " drop=" << drop);
      const auto idx = distinct_experts(c.T, c.K, c.E, drop, seed++);
      const auto dp = random_vec<T>(TK, seed++);
      std::vector<double> g_ref(TK);
      ops::kept_prob_grads_ref(g_ref.data(), dp.data(), idx.data(), 0.5, TK);
      Guarded<double> g = nan_out<double>(TK);
      {
        Staging st(ex);
        ops::kept_prob_grads<T>(ex, st.out(g), st.in(dp), st.in(idx), 0.5, TK);
        st.back();
      }
      expect_bitwise(g, g_ref.data(), "g_TK");
    }
  }
}

// The reference forward (scores, values, as the router computes them for fn), then the backward
// accumulating onto random dlogits; work is scratch (guards only).
void topk_probs_backward_case(const Exec& ex) {
  uint32_t seed = 280;
  for (auto c : kProbsCases) {
    for (ProbsFn fn : kProbsFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      std::vector<ScoreFn> scores = {ScoreFn::Softmax};
      if (fn == ProbsFn::Normalized) scores = {ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus};
      for (ScoreFn score : scores) {
        BACKEND_TRACE(probs_name(fn) << " " << score_name(score) << " T=" << c.T << " E=" << c.E
                                     << " K=" << c.K);
        const auto l = random_vec<double>(c.T * c.E, seed++, -3, 3);
        const auto idx = distinct_experts(c.T, c.K, c.E, 0.0, seed++);
        const auto g = random_vec<double>(c.T * c.K, seed++);
        std::vector<double> s(c.T * c.E), v(c.T * c.K);
        const ScoreFn sf = fn == ProbsFn::SoftmaxOverE ? ScoreFn::Softmax : score;
        ops::router_scores_ref(sf, s.data(), nullptr, l.data(), c.T, c.E);
        const bool on_logits = fn == ProbsFn::SoftmaxOverK || fn == ProbsFn::SigmoidTop1;
        ops::gather_topk_ref(v.data(), on_logits ? l.data() : s.data(), idx.data(), c.T, c.E,
                             c.K);
        if (fn == ProbsFn::SigmoidTop1) {
          ops::router_scores_ref(ScoreFn::Sigmoid, v.data(), nullptr, v.data(), c.T, c.K);
        }
        const auto dl0 = random_vec<double>(c.T * c.E, seed++);
        std::vector<double> dl_ref = dl0;
        ops::topk_probs_backward_ref(fn, score, dl_ref.data(), g.data(), v.data(), idx.data(),
                                     l.data(), s.data(), c.T, c.E, c.K);
        Guarded<double> dl = guarded(dl0), work = nan_out<double>(c.T * c.E);
        {
          Staging st(ex);
          ops::topk_probs_backward(ex, fn, score, st.out(dl), st.out(work), st.in(g), st.in(v),
                                   st.in(idx), st.in(l), st.in(s), c.T, c.E, c.K);
          st.back();
        }
        expect_close(dl, dl_ref.data(), "dlogits_TE");
        expect_intact(work, "work_TE");
      }
    }
  }
}

// ---- router_losses.h ----

std::vector<int64_t> random_counts(int64_t n, int64_t hi, uint32_t seed) {
  const auto u = random_vec<double>(n, seed, 0, static_cast<double>(hi));
  std::vector<int64_t> c(n);
  for (int64_t i = 0; i < n; ++i) c[i] = static_cast<int64_t>(u[i]);  // zeros: empty experts
  return c;
}

struct LossCase {
  int64_t T, E, K, B;
};
const LossCase kLossCases[] = {
    {1, 1, 1, 1}, {12, 8, 2, 3}, {14, 7, 7, 2}, {40, 13, 1, 4}, {6, 64, 8, 1}};

// Each value into its own guarded slot (NaN until written), within the f64 tolerance; z-loss's
// lse too; z-loss of no tokens is exactly 0.
void loss_values_case(const Exec& ex) {
  uint32_t seed = 300;
  for (auto c : kLossCases) {
    BACKEND_TRACE("T=" << c.T << " E=" << c.E << " K=" << c.K << " B=" << c.B);
    const auto l = random_vec<double>(c.T * c.E, seed++, -3, 3);
    std::vector<double> s(c.T * c.E), a(c.T * c.E);
    ops::router_scores_ref(ScoreFn::Softmax, s.data(), a.data(), l.data(), c.T, c.E);
    const auto counts = random_counts(c.E, c.T, seed++);
    const auto seq = random_counts(c.B * c.E, c.T / c.B + 1, seed++);
    std::vector<double> mean(c.E);
    for (int64_t e = 0; e < c.E; ++e) mean[e] = counts[e] * 0.75;
    double want[4];
    std::vector<double> lse_ref(c.T);
    ops::aux_loss_value_ref(&want[0], a.data(), counts.data(), c.T, c.E, c.K);
    ops::aux_loss_value_ref(&want[1], a.data(), mean.data(), c.T, c.E, c.K);
    ops::seq_aux_loss_value_ref(&want[2], a.data(), seq.data(), c.T, c.E, c.K, c.B);
    ops::z_loss_value_ref(&want[3], lse_ref.data(), l.data(), c.T, c.E);
    Guarded<double> v0 = nan_out<double>(1), v1 = nan_out<double>(1), v2 = nan_out<double>(1),
                    v3 = nan_out<double>(1), lse = nan_out<double>(c.T);
    {
      Staging st(ex);
      ops::aux_loss_value<long int>(ex, st.out(v0), st.in(a), st.in(counts), c.T, c.E, c.K);
      ops::aux_loss_value<double>(ex, st.out(v1), st.in(a), st.in(mean), c.T, c.E, c.K);
      ops::seq_aux_loss_value(ex, st.out(v2), st.in(a), st.in(seq), c.T, c.E, c.K, c.B);
      ops::z_loss_value(ex, st.out(v3), st.out(lse), st.in(l), c.T, c.E);
      st.back();
    }
    expect_close(v0, &want[0], "aux_loss_value, int64 counts");
    expect_close(v1, &want[1], "aux_loss_value, running-mean counts");
    expect_close(v2, &want[2], "seq_aux_loss_value");
    expect_close(v3, &want[3], "z_loss_value");
    expect_close(lse, lse_ref.data(), "lse_T");
  }
  BACKEND_TRACE("z-loss, T = 0");
  Guarded<double> z = nan_out<double>(1);
  {
    Staging st(ex);
    ops::z_loss_value(ex, st.out(z), nullptr, nullptr, 0, 4);  // no tokens: no lse, no logits
    st.back();
  }
  const double zero = 0.0;
  expect_bitwise(z, &zero, "z_loss_value of no tokens");
}

// Every gradient accumulating onto random values, each on its own buffer, within the f64
// tolerance.
void loss_grads_case(const Exec& ex) {
  uint32_t seed = 320;
  for (auto c : kLossCases) {
    BACKEND_TRACE("T=" << c.T << " E=" << c.E << " B=" << c.B);
    const int64_t n = c.T * c.E;
    const auto counts = random_counts(c.E, c.T, seed++);
    std::vector<double> mean(c.E);
    for (int64_t e = 0; e < c.E; ++e) mean[e] = counts[e] / 3.0;
    const auto seq = random_counts(c.B * c.E, c.T, seed++);
    const auto lse = random_vec<double>(c.T, seed++, 0, 3);
    const auto sm = random_vec<double>(n, seed++, 0, 1);
    const auto d0 = random_vec<double>(n, seed++);
    std::vector<double> r_aux = d0, r_mean = d0, r_seq = d0, r_z = d0;
    ops::aux_loss_grad_ref(r_aux.data(), counts.data(), 0.3, c.T, c.E);
    ops::aux_loss_grad_ref(r_mean.data(), mean.data(), 0.3, c.T, c.E);
    ops::seq_aux_loss_grad_ref(r_seq.data(), seq.data(), 0.2, c.T, c.E, c.B);
    ops::z_loss_grad_ref(r_z.data(), lse.data(), sm.data(), 0.1, c.T, c.E);
    Guarded<double> g_aux = guarded(d0), g_mean = guarded(d0), g_seq = guarded(d0),
                    g_z = guarded(d0);
    {
      Staging st(ex);
      ops::aux_loss_grad<long int>(ex, st.out(g_aux), st.in(counts), 0.3, c.T, c.E);
      ops::aux_loss_grad<double>(ex, st.out(g_mean), st.in(mean), 0.3, c.T, c.E);
      ops::seq_aux_loss_grad(ex, st.out(g_seq), st.in(seq), 0.2, c.T, c.E, c.B);
      ops::z_loss_grad(ex, st.out(g_z), st.in(lse), st.in(sm), 0.1, c.T, c.E);
      st.back();
    }
    expect_close(g_aux, r_aux.data(), "aux_loss_grad, int64 counts");
    expect_close(g_mean, r_mean.data(), "aux_loss_grad, running-mean counts");
    expect_close(g_seq, r_seq.data(), "seq_aux_loss_grad");
    expect_close(g_z, r_z.data(), "z_loss_grad");
  }
}

}  // namespace

void add_router_cases(std::vector<OpCase>& out) {
  out.push_back({"router_scores", {"router_scores"}, router_scores_case});
  out.push_back({"aux_scores_backward", {"aux_scores_backward"}, aux_scores_backward_case});
  out.push_back({"routing_key", {"routing_key"}, routing_key_case});
  out.push_back({"group_limited_mask_ties", {"group_limited_mask"}, group_limited_mask_case});
  out.push_back({"sinkhorn_balance", {"sinkhorn_balance"}, sinkhorn_case});
  out.push_back({"topk_prefix", {"topk_prefix"}, topk_prefix_case});
  out.push_back({"apply_capacity", {"apply_capacity"}, apply_capacity_case});
  out.push_back(
      {"routing_table", {"routing_table_store", "routing_table_load"}, routing_table_case});
  out.push_back({"gather_topk_probs", {"gather_topk", "topk_probs"}, gather_topk_probs_case});
  out.push_back({"kept_prob_grads_f32", {"kept_prob_grads"}, kept_prob_grads_case<float>});
  out.push_back({"kept_prob_grads_f64", {"kept_prob_grads"}, kept_prob_grads_case<double>});
  out.push_back({"topk_probs_backward", {"topk_probs_backward"}, topk_probs_backward_case});
  out.push_back({"router_loss_values",
                 {"aux_loss_value", "seq_aux_loss_value", "z_loss_value"},
                 loss_values_case});
  out.push_back({"router_loss_grads",
                 {"aux_loss_grad", "seq_aux_loss_grad", "z_loss_grad"},
                 loss_grads_case});
}

}  // namespace moecore::backend_test
