// Cases: the router's load-balancing state and the step-level ops beside it: tokens per expert
// (dropped slots, empty experts, per sequence, T = 0), the count accumulators and running mean,
// the quantile-beta estimate / mean / update, the expert-bias update (balanced and tied loads),
// the f64 conversions (widen, narrow, narrow-and-add with and without the factor; n = 0, 1,
// around the vector width and above the OpenMP threshold), the input jitter and the gradient
// clip coefficient (no parts, zero norm, huge parts, NaN / inf: skip). Comparisons as each op's
// own test (test_router_balance.cpp, test_convert_f64.cpp, test_input_jitter.cpp,
// test_grad_clip.cpp): all bitwise except the jitter's backward (a fused multiply-add may round
// once where the reference rounds twice), within the dtype's tolerance.
#include <cmath>
#include <limits>
#include <random>
#include <tuple>

#include "backend_case.h"
#include "core/rng.h"
#include "ops/adamw.h"
#include "ops/convert_f64.h"
#include "ops/grad_clip.h"
#include "ops/input_jitter.h"
#include "ops/router_balance.h"

namespace moecore::backend_test {
namespace {

// ---- router_balance.h ----

void count_tokens_case(const Exec& ex) {
  struct Case {
    int64_t T, K, E, B;
  };
  std::mt19937 gen(400);
  for (auto c : {Case{1, 1, 1, 1}, Case{12, 2, 8, 3}, Case{9, 7, 7, 1}, Case{40, 1, 13, 4},
                 Case{0, 2, 4, 1}, Case{203, 8, 64, 7}}) {
    BACKEND_TRACE("T=" << c.T << " K=" << c.K << " E=" << c.E << " B=" << c.B);
    std::vector<int32_t> idx(c.T * c.K);
    std::uniform_int_distribution<int> d(-1, static_cast<int>(c.E / 2));  // drops, empty experts
    for (auto& e : idx) e = d(gen);
    std::vector<int64_t> n_ref(c.E), s_ref(c.B * c.E);
    ops::count_tokens_per_expert_ref(n_ref.data(), s_ref.data(), idx.data(), c.T, c.K, c.E, c.B);
    Guarded<int64_t> n(c.E, -7), s(c.B * c.E, -7), n2(c.E, -7);
    Staging st(ex);
    ops::count_tokens_per_expert(ex, st.out(n), st.out(s), st.in(idx), c.T, c.K, c.E, c.B);
    ops::count_tokens_per_expert(ex, st.out(n2), nullptr, st.in(idx), c.T, c.K, c.E, 1);
    st.back();
    expect_bitwise(n, n_ref.data(), "counts_E");
    expect_bitwise(s, s_ref.data(), "seq_counts_BE");
    expect_bitwise(n2, n_ref.data(), "counts_E, no seq counts");
  }
}

// accumulate_counts, running_mean_counts (with counts, and with them already in the sum),
// divide_in_place: exact integer sums and one rounding each, bitwise.
void counts_accumulators_case(const Exec& ex) {
  uint32_t seed = 420;
  for (int64_t E : {1, 5, 13, 64}) {
    std::mt19937 gen(seed++);
    std::uniform_int_distribution<int64_t> d(0, 40);
    std::vector<int64_t> c(E);
    std::vector<double> sum0(E);
    for (int64_t e = 0; e < E; ++e) {
      c[e] = e % 3 == 1 ? 0 : d(gen);  // empty experts
      sum0[e] = static_cast<double>(d(gen) * 3);
    }
    for (double n_micro : {1.0, 3.0, 7.0}) {
      BACKEND_TRACE("E=" << E << " n_micro=" << n_micro);
      std::vector<double> m_ref(E), m2_ref(E);
      ops::running_mean_counts_ref(m_ref.data(), sum0.data(), c.data(), n_micro, E);
      ops::running_mean_counts_ref(m2_ref.data(), sum0.data(), nullptr, n_micro, E);
      Guarded<double> m = nan_out<double>(E), m2 = nan_out<double>(E);
      std::vector<double> x_ref = sum0;
      ops::divide_in_place_ref(x_ref.data(), n_micro, E);
      Guarded<double> x = guarded(sum0);
      Staging st(ex);
      ops::running_mean_counts(ex, st.out(m), st.in(sum0), st.in(c), n_micro, E);
      ops::running_mean_counts(ex, st.out(m2), st.in(sum0), nullptr, n_micro, E);
      ops::divide_in_place(ex, st.out(x), n_micro, E);
      st.back();
      expect_bitwise(m, m_ref.data(), "mean_E");
      expect_bitwise(m2, m2_ref.data(), "mean_E, counts in the sum");
      expect_bitwise(x, x_ref.data(), "x / d");
    }
    BACKEND_TRACE("E=" << E << " accumulate");
    std::vector<double> sum_ref = sum0;
    ops::accumulate_counts_ref(sum_ref.data(), c.data(), E);
    Guarded<double> sum = guarded(sum0);
    Staging st(ex);
    ops::accumulate_counts(ex, st.out(sum), st.in(c), E);
    st.back();
    expect_bitwise(sum, sum_ref.data(), "sum_E");
  }
  BACKEND_TRACE("divide_in_place, random values");
  const auto x0 = random_vec<double>(1000, seed++, -5, 5);
  std::vector<double> x_ref = x0;
  ops::divide_in_place_ref(x_ref.data(), 0.3, 1000);
  Guarded<double> x = guarded(x0);
  Staging st(ex);
  ops::divide_in_place(ex, st.out(x), 0.3, 1000);
  st.back();
  expect_bitwise(x, x_ref.data(), "x / 0.3");
}

// T K divisible by E and K < E (keyv is a top-(K+1) of the E experts; K = E would ask for the
// (T + 1)-th of T entries); K = 1, K = E - 1 (the smallest entry), E not divisible by 8; += onto
// zeros and onto a running sum. col is scratch (guards only).
void quantile_beta_estimate_case(const Exec& ex) {
  struct Case {
    int64_t T, E, K;
  };
  uint32_t seed = 440;
  for (auto c : {Case{4, 4, 1}, Case{16, 8, 2}, Case{21, 7, 3}, Case{6, 3, 2}, Case{7, 7, 1}, Case{3, 3, 2}}) {
    const auto l = random_vec<double>(c.T * c.E, seed++, -2, 2);
    const auto keyv = random_vec<double>(c.T * (c.K + 1), seed++, -1, 1);
    for (bool zeros : {true, false}) {
      BACKEND_TRACE("T=" << c.T << " E=" << c.E << " K=" << c.K << (zeros ? " onto 0" : ""));
      const auto b0 = zeros ? std::vector<double>(c.E, 0.0) : random_vec<double>(c.E, seed++);
      std::vector<double> b_ref = b0;
      ops::quantile_beta_estimate_ref(b_ref.data(), l.data(), keyv.data(), c.T, c.E, c.K);
      Guarded<double> b = guarded(b0), col = nan_out<double>(c.T);
      Staging st(ex);
      ops::quantile_beta_estimate(ex, st.out(b), st.out(col), st.in(l), st.in(keyv), c.T, c.E,
                                  c.K);
      st.back();
      expect_bitwise(b, b_ref.data(), "beta_sum_E");
      expect_intact(col, "col_T");
    }
  }
}

void quantile_beta_update_case(const Exec& ex) {
  uint32_t seed = 460;
  for (int64_t E : {1, 5, 13, 64}) {
    const auto avg = random_vec<double>(E, seed++, -1, 1);
    const auto b0 = random_vec<float>(E, seed++);
    for (double ema : {0.0, 0.9}) {
      BACKEND_TRACE("E=" << E << " ema=" << ema);
      std::vector<float> b_ref = b0;
      ops::quantile_beta_update_ref(b_ref.data(), avg.data(), ema, E);
      Guarded<float> b = guarded(b0);
      Guarded<double> work = nan_out<double>(E);
      Staging st(ex);
      ops::quantile_beta_update(ex, st.out(b), st.out(work), st.in(avg), ema, E);
      st.back();
      expect_bitwise(b, b_ref.data(), "beta_E");
      expect_intact(work, "work_E");
    }
  }
}

// Loads above, below and exactly at the mean (sign 0), and a balanced step (unchanged).
void expert_bias_update_case(const Exec& ex) {
  std::mt19937 gen(480);
  std::vector<std::vector<double>> loads = {{10, 2, 6, 6, 1}, {4, 4, 4, 4, 4}, {7}, {}};
  for (int64_t E : {13, 64}) {
    std::uniform_int_distribution<int> d(0, 6);
    std::vector<double> c(E);
    for (auto& v : c) v = d(gen);
    loads.push_back(c);
  }
  uint32_t seed = 481;
  for (const auto& c : loads) {
    const int64_t E = static_cast<int64_t>(c.size());
    if (E == 0) continue;
    for (float rate : {1e-3f, 0.25f}) {
      BACKEND_TRACE("E=" << E << " rate=" << rate << " c[0]=" << c[0]);
      const auto b0 = random_vec<float>(E, seed++, -0.1, 0.1);
      std::vector<float> b_ref = b0;
      ops::expert_bias_update_ref(b_ref.data(), c.data(), rate, E);
      Guarded<float> b = guarded(b0);
      Staging st(ex);
      ops::expert_bias_update(ex, st.out(b), st.in(c), rate, E);
      st.back();
      expect_bitwise(b, b_ref.data(), "bias_E");
    }
  }
}

// ---- convert_f64.h ----

template <typename T>
void convert_f64_case(const Exec& ex) {
  uint32_t seed = 500;
  for (int64_t n : {0, 1, 7, 8, 9, 33, 1000, 70000}) {
    BACKEND_TRACE(dtype_name<T>() << " n=" << n);
    const auto x = random_vec<T>(n, seed++, -3, 3);
    const auto x64 = random_vec<double>(n, seed++, -3, 3);
    const auto f = random_vec<T>(n, seed++, 0.9, 1.1);
    const auto y0 = random_vec<T>(n, seed++);
    std::vector<double> w_ref(n);
    ops::widen_to_f64_ref(w_ref.data(), x.data(), n);
    Guarded<double> w = nan_out<double>(n);
    Staging st(ex);
    ops::widen_to_f64<T>(ex, st.out(w), st.in(x), n);
    st.back();
    expect_bitwise(w, w_ref.data(), "widen_to_f64");
    std::vector<T> y_ref(n);
    ops::narrow_from_f64_ref(y_ref.data(), x64.data(), n);
    Guarded<T> y = nan_out<T>(n);
    ops::narrow_from_f64<T>(ex, st.out(y), st.in(x64), n);
    st.back();
    expect_bitwise(y, y_ref.data(), "narrow_from_f64");
    for (const T* fac : {static_cast<const T*>(nullptr), f.data()}) {
      std::vector<T> a_ref = y0;
      ops::add_from_f64_ref(a_ref.data(), x64.data(), fac, n);
      Guarded<T> a = guarded(y0);
      Staging sa(ex);  // a's host buffer is the loop's
      ops::add_from_f64<T>(ex, sa.out(a), sa.in(x64), sa.in_or_null(fac, n), n);
      sa.back();
      expect_bitwise(a, a_ref.data(), fac ? "add_from_f64, factor" : "add_from_f64");
    }
  }
}

// ---- input_jitter.h ----

template <typename T>
void input_jitter_case(const Exec& ex) {
  uint32_t seed = 520;
  const uint64_t key = rng_key(7, "backend.jitter");
  for (int64_t n : {0, 1, 9, 1000, 20000}) {
    // base = step x stride: the step read from memory.
    for (auto [step, stride, lane] : {std::tuple<int64_t, int64_t, uint32_t>{0, 77, 0},
                                      {3, 37, 2}, {1 << 20, 1 << 22, 1}}) {
      const uint64_t base = static_cast<uint64_t>(step) * static_cast<uint64_t>(stride);
      BACKEND_TRACE(dtype_name<T>() << " n=" << n << " step=" << step << " stride=" << stride
                                    << " lane=" << lane);
      const double eps = 0.1;
      const auto x = random_vec<T>(n, seed++, -2, 2);
      std::vector<T> j_ref(n), y_ref(n);
      ops::input_jitter_forward_ref(j_ref.data(), y_ref.data(), x.data(), eps, key, base, lane, n);
      Guarded<T> j = nan_out<T>(n), y = nan_out<T>(n);
      Guarded<int64_t> step_mem(1, step);
      Staging st(ex);
      int64_t* step_d = st.out(step_mem);  // read by the forward, written by the advance
      ops::input_jitter_forward<T>(ex, st.out(j), st.out(y), st.in(x), eps, key, step_d, stride,
                                   lane, n);
      st.back();
      expect_bitwise(j, j_ref.data(), "jitter");
      expect_intact(step_mem, "step");
      ops::input_jitter_advance(ex, step_d);
      st.back();
      EXPECT_EQ(step_mem[0], step + 1) << "advanced step";
      expect_intact(step_mem, "step");
      expect_bitwise(y, y_ref.data(), "y");
      const auto dy = random_vec<T>(n, seed++);
      const auto dx0 = random_vec<T>(n, seed++);
      std::vector<T> dx_ref = dx0;
      ops::input_jitter_backward_ref(dx_ref.data(), dy.data(), j_ref.data(), n);
      Guarded<T> dx = guarded(dx0);
      ops::input_jitter_backward<T>(ex, st.out(dx), st.in(dy), st.in(j_ref), n);
      st.back();
      expect_close(dx, dx_ref.data(), "dx += dy * jitter");
    }
  }
}

// ---- grad_clip.h ----

// norm, grad_scale and skip bitwise; lr and step untouched.
void grad_clip_case(const Exec& ex) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::vector<double> parts;
    double max_norm;
  };
  std::vector<Case> cases = {{{9.0, 16.0}, 1.0},  {{9.0, 16.0}, 0.0},  {{9.0, 16.0}, 10.0},
                             {{0.0, 0.0}, 1.0},   {{}, 1.0},           {{1e-30, 2.5}, 1.5},
                             {{0.25, 0.0}, 0.5},  {{1.0, 1e300, 1e300}, 1.0},
                             {{1.0, nan}, 1.0},   {{1.0, inf}, 1.0},   {{inf, 2.0}, 0.0}};
  cases.push_back({random_vec<double>(37, 540, 0, 3), 2.0});  // n not a multiple of 8
  for (const Case& c : cases) {
    const int64_t n = static_cast<int64_t>(c.parts.size());
    BACKEND_TRACE("parts=" << n << (n ? " first=" : "") << (n ? c.parts[0] : 0.0)
                           << " max_norm=" << c.max_norm);
    ops::AdamWStep st, st_ref;  // staged, as the AdamW cases
    st.lr = st_ref.lr = 3e-3;
    st.step = st_ref.step = 5;
    st.grad_scale = st_ref.grad_scale = nan;
    st.skip = st_ref.skip = 7;
    double norm_ref = -2;
    ops::grad_clip_ref(&norm_ref, &st_ref, c.parts.data(), n, c.max_norm);
    Guarded<double> norm = nan_out<double>(1);
    Staging stg(ex);
    ops::grad_clip(ex, stg.out(norm), stg.out(&st, 1), stg.in(c.parts), n, c.max_norm);
    stg.back();
    expect_bitwise(norm, &norm_ref, "norm");
    EXPECT_TRUE(same_bits(&st.grad_scale, &st_ref.grad_scale, 1)) << "grad_scale";
    EXPECT_EQ(st.skip, st_ref.skip);
    EXPECT_EQ(st.lr, 3e-3);
    EXPECT_EQ(st.step, 5);
  }
}

}  // namespace

void add_router_balance_cases(std::vector<OpCase>& out) {
  out.push_back({"count_tokens_per_expert", {"count_tokens_per_expert"}, count_tokens_case});
  out.push_back({"counts_accumulators",
                 {"accumulate_counts", "running_mean_counts", "divide_in_place"},
                 counts_accumulators_case});
  out.push_back(
      {"quantile_beta_estimate", {"quantile_beta_estimate"}, quantile_beta_estimate_case});
  out.push_back({"quantile_beta_update", {"quantile_beta_update"}, quantile_beta_update_case});
  out.push_back({"expert_bias_update", {"expert_bias_update"}, expert_bias_update_case});
  out.push_back({"convert_f64_f32",
                 {"widen_to_f64", "narrow_from_f64", "add_from_f64"},
                 convert_f64_case<float>});
  out.push_back({"convert_f64_f64",
                 {"widen_to_f64", "narrow_from_f64", "add_from_f64"},
                 convert_f64_case<double>});
  out.push_back({"input_jitter_f32",
                 {"input_jitter_forward", "input_jitter_backward", "input_jitter_advance"},
                 input_jitter_case<float>});
  out.push_back({"input_jitter_f64",
                 {"input_jitter_forward", "input_jitter_backward", "input_jitter_advance"},
                 input_jitter_case<double>});
  out.push_back({"grad_clip", {"grad_clip"}, grad_clip_case});
}

}  // namespace moecore::backend_test
