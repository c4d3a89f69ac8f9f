// Cases: the router's softmax and top-k (K = 1, K = E, exact ties, -inf entries), the shared
// expert's sigmoid gate (no tokens, H = 1, saturated logits, ds aliasing dy), and the
// dispatch maps and gathers (build_permutation, pad_permutation, gather_row_probs,
// scatter_row_probs, permute_rows, unpermute_rows) on routings with experts that get no tokens,
// K = 1, K = E, dropped slots (idx -1) and T * K not divisible by 8. Maps and gathers are exact:
// compared bitwise. Each case's map comes from the reference (build_permutation_ref), so the op
// under test is the only backend call in its case.
#include <algorithm>
#include <numeric>
#include <random>

#include "backend_case.h"
#include "core/check.h"
#include "ops/permute.h"
#include "ops/sigmoid_gate.h"
#include "ops/softmax_topk.h"

namespace moecore::backend_test {
namespace {

struct Routing {
  std::string name;
  int64_t T, K, E;
  std::vector<int32_t> idx;
};

const std::vector<Routing>& routings() {
  static const std::vector<Routing> r = {
      {"T1K1E1", 1, 1, 1, {0}},
      {"K1_all_to_one_expert", 13, 1, 8, std::vector<int32_t>(13, 5)},  // 7 experts empty
      {"K2_random", 13, 2, 8, distinct_experts(13, 2, 8, 0.0, 1)},  // T K = 26
      {"K3_drops", 13, 3, 7, distinct_experts(13, 3, 7, 0.3, 2)},   // T K = 39
      {"K_equals_E", 13, 4, 4, distinct_experts(13, 4, 4, 0.0, 3)},
      {"K_equals_E_drops", 11, 5, 5, distinct_experts(11, 5, 5, 0.2, 4)},
      {"big_drops", 203, 8, 64, distinct_experts(203, 8, 64, 0.1, 5)},
      {"all_dropped", 5, 2, 3, std::vector<int32_t>(10, -1)},
  };
  return r;
}

struct Map {
  int64_t N = 0;
  std::vector<int64_t> counts;
  std::vector<int32_t> row_token, row_slot, token_rows;  // row_* sized T * K: pad rows past N
};

Map ref_map(const Routing& r) {
  Map m;
  m.counts.resize(r.E);
  m.row_token.resize(r.T * r.K);
  m.row_slot.resize(r.T * r.K);
  m.token_rows.resize(r.T * r.K);
  m.N = ops::build_permutation_ref(m.counts.data(), m.row_token.data(), m.row_slot.data(),
                                   m.token_rows.data(), r.idx.data(), r.T, r.K, r.E);
  return m;
}

// A padded map (capacity cap): returns the number of rows E * cap.
int64_t ref_padded(const Routing& r, int64_t cap, Map& m) {
  const int64_t rows = r.E * cap;
  m.row_token.resize(std::max<int64_t>(rows, m.row_token.size()));
  m.row_slot.resize(m.row_token.size());
  ops::pad_permutation_ref(m.counts.data(), m.row_token.data(), m.row_slot.data(),
                           m.token_rows.data(), m.N, r.T, r.K, r.E, cap);
  return rows;
}

int64_t max_count(const Map& m) {
  return m.counts.empty() ? 0 : *std::max_element(m.counts.begin(), m.counts.end());
}

// Every routing's reference map, packed and padded to one row more than its largest count:
// body(routing, map, rows, padded).
void for_each_map(
    const std::function<void(const Routing&, const Map&, int64_t rows, bool padded)>& body) {
  for (const Routing& r : routings()) {
    Map m = ref_map(r);
    for (int padded = 0; padded < 2; ++padded) {
      int64_t rows = m.N;
      if (padded) rows = ref_padded(r, max_count(m) + 1, m);
      body(r, m, rows, padded != 0);
    }
  }
}

void build_permutation_case(const Exec& ex) {
  for (const Routing& r : routings()) {
    BACKEND_TRACE(r.name << " T=" << r.T << " K=" << r.K << " E=" << r.E);
    const Map want = ref_map(r);
    Guarded<int64_t> counts(r.E, -7), n_kept(1, -7);
    Guarded<int32_t> row_token(r.T * r.K, -7), row_slot(r.T * r.K, -7), token_rows(r.T * r.K, -7);
    {
      Staging st(ex);
      ops::build_permutation(ex, st.out(n_kept), st.out(counts), st.out(row_token),
                             st.out(row_slot), st.out(token_rows), st.in(r.idx), r.T, r.K, r.E);
      st.back();
    }
    expect_bitwise(n_kept, &want.N, "kept rows");
    expect_bitwise(counts, want.counts.data(), "counts_E");
    // All T * K rows: past the kept ones, the dropped slots' pad rows (-1).
    expect_bitwise(row_token, want.row_token.data(), "row_token_N");
    expect_bitwise(row_slot, want.row_slot.data(), "row_slot_N");
    for (int64_t i = want.N; i < r.T * r.K; ++i) EXPECT_EQ(row_token[i], -1) << "row " << i;
    expect_bitwise(token_rows, want.token_rows.data(), "token_rows_TK");
  }
}

// Capacity = the largest count and one more (every expert padded).
void pad_permutation_case(const Exec& ex) {
  for (const Routing& r : routings()) {
    const Map m = ref_map(r);
    for (int64_t cap : {max_count(m), max_count(m) + 1}) {
      if (cap == 0) continue;
      BACKEND_TRACE(r.name << " cap=" << cap);
      Map want = m;
      const int64_t rows = ref_padded(r, cap, want);
      const int64_t pad_want = rows - m.N;
      Guarded<int64_t> counts = guarded(m.counts);
      std::vector<int32_t> tok0 = m.row_token, slot0 = m.row_slot;
      tok0.resize(want.row_token.size(), -7);
      slot0.resize(want.row_slot.size(), -7);
      Guarded<int32_t> row_token = guarded(tok0), row_slot = guarded(slot0),
                       token_rows = guarded(m.token_rows);
      Guarded<int64_t> n_kept(1, m.N), pad(1, -7);
      {
        Staging st(ex);
        // n_kept is read only; staged as an output so a stray write shows in its guards.
        ops::pad_permutation(ex, st.out(pad), st.out(counts), st.out(row_token), st.out(row_slot),
                             st.out(token_rows), st.out(n_kept), r.T, r.K, r.E, cap);
        st.back();
      }
      expect_bitwise(pad, &pad_want, "pad rows");
      expect_intact(n_kept, "kept rows");
      expect_bitwise(counts, want.counts.data(), "counts_E");
      expect_bitwise(row_token, want.row_token.data(), "row_token", rows);
      expect_bitwise(row_slot, want.row_slot.data(), "row_slot", rows);
      expect_bitwise(token_rows, want.token_rows.data(), "token_rows_TK");
    }
  }
}

// gather_row_probs and scatter_row_probs on the packed map and on a padded one (pad rows: prob
// 0); pure copies, so bitwise.
template <typename T>
void row_probs(const Exec& ex) {
  uint32_t seed = 10;
  for_each_map([&](const Routing& r, const Map& m, int64_t rows, bool padded) {
    BACKEND_TRACE(r.name << (padded ? " padded" : " packed") << " rows=" << rows);
    const auto probs = random_vec<T>(r.T * r.K, seed++);
    std::vector<T> p_ref(rows);
    Guarded<T> p = nan_out<T>(rows);
    {
      Staging st(ex);
      ops::gather_row_probs<T>(ex, st.out(p), st.in(probs), st.in(m.row_token), st.in(m.row_slot),
                               rows, r.K);
      st.back();
    }
    ops::gather_row_probs_ref(p_ref.data(), probs.data(), m.row_token.data(), m.row_slot.data(),
                              rows, r.K);
    expect_bitwise(p, p_ref.data(), "p_N");
    const auto dp = random_vec<T>(rows, seed++);
    std::vector<T> dprobs_ref(r.T * r.K);
    Guarded<T> dprobs = nan_out<T>(r.T * r.K);
    {
      Staging st(ex);
      ops::scatter_row_probs<T>(ex, st.out(dprobs), st.in(dp), st.in(m.token_rows), r.T * r.K);
      st.back();
    }
    ops::scatter_row_probs_ref(dprobs_ref.data(), dp.data(), m.token_rows.data(), r.T * r.K);
    expect_bitwise(dprobs, dprobs_ref.data(), "dprobs_TK");
  });
}

// permute_rows on packed and padded maps (pad rows zero): a gather, bitwise.
template <typename T>
void permute_rows_case(const Exec& ex) {
  uint32_t seed = 20;
  for_each_map([&](const Routing& r, const Map& m, int64_t rows, bool padded) {
    for (int64_t H : {1, 7, 37}) {
      BACKEND_TRACE(r.name << (padded ? " padded" : " packed") << " rows=" << rows << " H=" << H);
      const auto x = random_vec<T>(r.T * H, seed++);
      std::vector<T> y_ref(rows * H);
      Guarded<T> y = nan_out<T>(rows * H);
      {
        Staging st(ex);
        ops::permute_rows<T>(ex, st.out(y), st.in(x), st.in(m.row_token), rows, H);
        st.back();
      }
      ops::permute_rows_ref(y_ref.data(), x.data(), m.row_token.data(), rows, H);
      expect_bitwise(y, y_ref.data(), "y_NH");
    }
  });
}

// permute_rows on bf16 rows (--bf16: the tokens and output gradients moved as the bf16 the
// experts' GEMMs read), H from 1 to rows of whole 16-byte vectors: a gather of the bits, bitwise
// the reference; pad rows are bf16 zeros (bits 0, the cast of 0.f).
void permute_rows_bf16_case(const Exec& ex) {
  uint32_t seed = 25;
  for_each_map([&](const Routing& r, const Map& m, int64_t rows, bool padded) {
    for (int64_t H : {1, 7, 8, 37, 64}) {
      BACKEND_TRACE(r.name << (padded ? " padded" : " packed") << " rows=" << rows << " H=" << H);
      const auto x = to_bf16(random_vec<float>(r.T * H, seed++));
      std::vector<bf16> y_ref(rows * H);
      Guarded<uint16_t> y(rows * H, 0x7fc1);  // NaN bits: an unassigned element fails
      {
        Staging st(ex);
        ops::permute_rows<bf16>(ex, as_bf16(st.out(y)), st.in(x), st.in(m.row_token), rows, H);
        st.back();
      }
      ops::permute_rows_ref(y_ref.data(), x.data(), m.row_token.data(), rows, H);
      expect_bitwise(y, reinterpret_cast<const uint16_t*>(y_ref.data()), "y_NH (bf16)");
    }
  });
}

// unpermute_rows sums a token's kept rows in k order; the reference sums in f64, so random
// values compare within the dtype's tolerance, small integers (exact sums) bitwise.
template <typename T>
void unpermute_rows_case(const Exec& ex) {
  uint32_t seed = 30;
  for_each_map([&](const Routing& r, const Map& m, int64_t rows, bool padded) {
    for (int64_t H : {1, 7, 37}) {
      BACKEND_TRACE(r.name << (padded ? " padded" : " packed") << " rows=" << rows << " H=" << H);
      const auto x = random_vec<T>(rows * H, seed++);
      std::vector<T> y_ref(r.T * H);
      Guarded<T> y = nan_out<T>(r.T * H);
      {
        Staging st(ex);
        ops::unpermute_rows<T>(ex, st.out(y), st.in(x), st.in(m.token_rows), r.T, r.K, H);
        st.back();
      }
      ops::unpermute_rows_ref(y_ref.data(), x.data(), m.token_rows.data(), r.T, r.K, H);
      expect_close(y, y_ref.data(), "y_TH");
      std::vector<T> xi(rows * H);
      for (int64_t i = 0; i < rows * H; ++i) xi[i] = T(int(i % 11) - 5);
      Guarded<T> yi = nan_out<T>(r.T * H);
      {
        Staging st(ex);
        ops::unpermute_rows<T>(ex, st.out(yi), st.in(xi), st.in(m.token_rows), r.T, r.K, H);
        st.back();
      }
      ops::unpermute_rows_ref(y_ref.data(), xi.data(), m.token_rows.data(), r.T, r.K, H);
      expect_bitwise(yi, y_ref.data(), "y_TH, small integers");
    }
  });
}

// unpermute_rows on bf16 rows into f32 tokens (--bf16: the experts' outputs and input gradients
// come back as bf16 rows): the widened rows summed in f32 in k order, bitwise the reference
// (which sums in that order too), H from 1 to rows of whole 16-byte vectors.
void unpermute_rows_bf16_case(const Exec& ex) {
  uint32_t seed = 35;
  for_each_map([&](const Routing& r, const Map& m, int64_t rows, bool padded) {
    for (int64_t H : {1, 7, 8, 37, 64}) {
      BACKEND_TRACE(r.name << (padded ? " padded" : " packed") << " rows=" << rows << " H=" << H);
      const auto x = to_bf16(random_vec<float>(rows * H, seed++));
      std::vector<float> y_ref(r.T * H);
      Guarded<float> y = nan_out<float>(r.T * H);
      {
        Staging st(ex);
        ops::unpermute_rows(ex, st.out(y), st.in(x), st.in(m.token_rows), r.T, r.K, H);
        st.back();
      }
      ops::unpermute_rows_ref(y_ref.data(), x.data(), m.token_rows.data(), r.T, r.K, H);
      expect_bitwise(y, y_ref.data(), "y_TH (bf16 rows)");
    }
  });
}

// g with its tables staged (the reference reads the host's); G tokens over all ranks.
ops::GroupRouting staged(Staging& st, const ops::GroupRouting& g, int64_t G) {
  ops::GroupRouting d = g;
  d.idx_GK = st.in(raw_ptr(g.idx_GK), G * g.K);
  d.tok_off_R = st.in(raw_ptr(g.tok_off_R), g.R + 1);
  d.cap_R = st.in(raw_ptr(g.cap_R), g.R);
  return d;
}

// build_group_permutation against its definition, bitwise: one rank and two or three, each
// rank's share of the local experts, K = 1 and 2, dropped slots, a rank with no tokens, experts
// no slot routes to, padded blocks; and the errors (over capacity, over the planned rows).
void build_group_permutation_case(const Exec& ex) {
  struct Layout {
    std::vector<int64_t> tokens;  // per rank
    int64_t E, K;
    int64_t cap;  // 0: dropless
  };
  uint32_t seed = 50;
  for (const Layout& c : {Layout{{7}, 4, 2, 0}, Layout{{5, 0, 9}, 6, 1, 0},
                          Layout{{6, 6}, 4, 2, 0}, Layout{{6, 6}, 4, 2, 5},
                          Layout{{3, 8, 1}, 3, 2, 6}}) {
    const int64_t R = static_cast<int64_t>(c.tokens.size()), L = c.E / R, K = c.K;
    std::vector<int64_t> tok_off(R + 1, 0), cap(R, c.cap);
    for (int64_t r = 0; r < R; ++r) tok_off[r + 1] = tok_off[r] + c.tokens[r];
    const int64_t G = tok_off[R];
    // Random experts, a few dropped slots, and capacity respected when padding.
    std::mt19937 gen(seed++);
    std::vector<int32_t> idx(G * K);
    for (int64_t t = 0; t < G; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        int32_t e = static_cast<int32_t>((t * 7 + k * 3 + gen() % 2) % c.E);
        if (gen() % 6 == 0) e = -1;
        idx[t * K + k] = e;
      }
    }
    if (c.cap > 0) {  // drop to capacity per (rank, expert), as the router does
      for (int64_t r = 0; r < R; ++r) {
        std::vector<int64_t> seen(c.E, 0);
        for (int64_t i = tok_off[r] * K; i < tok_off[r + 1] * K; ++i) {
          if (idx[i] >= 0 && ++seen[idx[i]] > c.cap) idx[i] = -1;
        }
      }
    }
    const int64_t max_rows = R * (c.cap > 0 ? c.cap * L : G * K);
    for (int64_t me = 0; me < R; ++me) {
      BACKEND_TRACE("R=" << R << " me=" << me << " L=" << L << " K=" << K << " cap=" << c.cap);
      ops::GroupRouting g{idx.data(), tok_off.data(), cap.data(), R, me, L, me * L, K, max_rows, G};
      std::vector<int64_t> rows_ref(L), pads_ref(1);
      std::vector<int32_t> tok_ref(max_rows), slot_ref(max_rows), grp_ref(G * K);
      const int64_t n_ref = ops::build_group_permutation_ref(rows_ref.data(), tok_ref.data(),
                                                             slot_ref.data(), grp_ref.data(),
                                                             pads_ref.data(), g);
      Guarded<int64_t> rows(L, -9), chunk(L * R, -9), pads(1, -9);
      Guarded<int32_t> tok(max_rows, -9), slot(max_rows, -9), grp(G * K, -9);
      int64_t n = -1;
      {
        Staging st(ex);
        n = ops::build_group_permutation(ex, st.out(rows), st.out(tok), st.out(slot), st.out(grp),
                                         st.out(chunk), st.out(pads), staged(st, g, G));
        st.back();
      }
      EXPECT_EQ(n, n_ref) << "rows";
      expect_bitwise(rows, rows_ref.data(), "rows_L");
      expect_bitwise(tok, tok_ref.data(), "row_token_N", n);
      expect_bitwise(slot, slot_ref.data(), "row_slot_N", n);
      expect_bitwise(grp, grp_ref.data(), "group_rows_GK");
      expect_bitwise(pads, pads_ref.data(), "pads");
      expect_intact(chunk, "chunk_LR");
      for (int64_t i = n; i < max_rows; ++i) EXPECT_EQ(tok[i], -9) << "row " << i << " >= N";
      if (c.cap > 0 && G > 0) {  // one row over capacity is refused
        std::vector<int32_t> over = idx;
        int64_t on_first = 0;
        for (int64_t i = tok_off[me] * K; i < tok_off[me + 1] * K; ++i) {
          on_first += over[i] == me * L;
        }
        for (int64_t i = tok_off[me] * K; i < tok_off[me + 1] * K && on_first <= c.cap; ++i) {
          if (over[i] != me * L) over[i] = static_cast<int32_t>(me * L), ++on_first;
        }
        if (on_first > c.cap) {
          ops::GroupRouting bad = g;
          bad.idx_GK = over.data();
          auto run_bad = [&] {
            Staging st(ex);
            ops::build_group_permutation(ex, st.out(rows), st.out(tok), st.out(slot), st.out(grp),
                                         st.out(chunk), st.out(pads), staged(st, bad, G));
          };
          EXPECT_THROW(run_bad(), moecore::Error);
        }
      }
      if (n > 0) {  // fewer planned rows than the routing needs: N, and no row written
        ops::GroupRouting small = g;
        small.max_rows = n - 1;
        Guarded<int64_t> rows2(L, -9), chunk2(L * R, -9), pads2(1, -9);
        Guarded<int32_t> tok2(max_rows, -9), slot2(max_rows, -9), grp2(G * K, -9);
        {
          Staging st(ex);
          EXPECT_EQ(ops::build_group_permutation(ex, st.out(rows2), st.out(tok2), st.out(slot2),
                                                 st.out(grp2), st.out(chunk2), st.out(pads2),
                                                 staged(st, small, G)),
                    n);
          st.back();
        }
        EXPECT_EQ(ops::build_group_permutation_ref(rows_ref.data(), tok_ref.data(), slot_ref.data(),
                                                   grp_ref.data(), pads_ref.data(), small),
                  n);
        expect_bitwise(rows2, rows_ref.data(), "rows_L (over the plan)");
        expect_intact(tok2, "row_token_N (over the plan)");
        expect_intact(slot2, "row_slot_N (over the plan)");
        expect_intact(grp2, "group_rows_GK (over the plan)");
      }
    }
  }
}

// copy_row_chunks: the all-to-all reorder [source rank][expert] -> [expert][source rank] and
// back, with empty chunks (an expert no rank sends to, a rank that sends nothing), one rank,
// and W = 1 (the probs) or H; a copy, bitwise, rows outside every chunk untouched.
template <typename T>
void copy_row_chunks_case(const Exec& ex) {
  uint32_t seed = 40;
  struct Layout {
    int64_t R, L;
    std::vector<int64_t> rows;  // [R, L]
  };
  for (const Layout& c : {Layout{1, 1, {0}}, Layout{1, 3, {2, 0, 5}}, Layout{2, 2, {3, 0, 0, 4}},
                          Layout{3, 2, {1, 2, 0, 0, 7, 1}}}) {
    std::vector<int64_t> src_off(c.R * c.L), dst_off(c.R * c.L);
    int64_t n = 0;
    for (int64_t i = 0; i < c.R * c.L; ++i) src_off[i] = n, n += c.rows[i];  // [r][l] packed
    int64_t d = 0;
    for (int64_t l = 0; l < c.L; ++l) {
      for (int64_t r = 0; r < c.R; ++r) dst_off[r * c.L + l] = d, d += c.rows[r * c.L + l];
    }
    for (int64_t W : {1, 7}) {
      BACKEND_TRACE("R=" << c.R << " L=" << c.L << " rows=" << n << " W=" << W);
      const auto src = random_vec<T>(n * W, seed++);
      Guarded<T> dst = nan_out<T>(n * W + W);  // one row past the chunks: never written
      std::vector<T> want(n * W + W, std::numeric_limits<T>::quiet_NaN());
      const int64_t chunks = c.R * c.L;
      Guarded<T> back = nan_out<T>(n * W);  // and back: the identity
      {
        Staging st(ex);
        T* const sorted = st.out(dst);
        ops::copy_row_chunks<T>(ex, sorted, st.in(src), st.in(dst_off), st.in(src_off),
                                st.in(c.rows), chunks, W);
        ops::copy_row_chunks<T>(ex, st.out(back), sorted, st.in(src_off), st.in(dst_off),
                                st.in(c.rows), chunks, W);
        st.back();
      }
      ops::copy_row_chunks_ref(want.data(), src.data(), dst_off.data(), src_off.data(),
                               c.rows.data(), chunks, W);
      expect_bitwise(dst, want.data(), "sorted");
      expect_bitwise(back, src.data(), "unsorted");
    }
  }
}

// copy_row_chunks on bf16 rows (the --bf16 dispatch's chunk sort): the layouts above, W = 1, 7
// and 16 (16-byte vectors), there and back, bitwise; a row past the chunks stays untouched.
void copy_row_chunks_bf16_case(const Exec& ex) {
  uint32_t seed = 45;
  const int64_t R = 3, L = 2;
  const std::vector<int64_t> rows = {1, 2, 0, 0, 7, 1};
  std::vector<int64_t> src_off(R * L), dst_off(R * L);
  int64_t n = 0;
  for (int64_t i = 0; i < R * L; ++i) src_off[i] = n, n += rows[i];
  int64_t d = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t r = 0; r < R; ++r) dst_off[r * L + l] = d, d += rows[r * L + l];
  }
  for (int64_t W : {1, 7, 16}) {
    BACKEND_TRACE("bf16 rows=" << n << " W=" << W);
    const auto src = to_bf16(random_vec<float>(n * W, seed++));
    Guarded<uint16_t> dst(n * W + W, 0x7fc1), back(n * W, 0x7fc1);
    std::vector<bf16> want(n * W + W, bf16{0x7fc1});
    {
      Staging st(ex);
      bf16* const sorted = as_bf16(st.out(dst));
      ops::copy_row_chunks<bf16>(ex, sorted, st.in(src), st.in(dst_off), st.in(src_off),
                                 st.in(rows), R * L, W);
      ops::copy_row_chunks<bf16>(ex, as_bf16(st.out(back)), sorted, st.in(src_off), st.in(dst_off),
                                 st.in(rows), R * L, W);
      st.back();
    }
    ops::copy_row_chunks_ref(want.data(), src.data(), dst_off.data(), src_off.data(), rows.data(),
                             R * L, W);
    expect_bitwise(dst, reinterpret_cast<const uint16_t*>(want.data()), "sorted (bf16)");
    expect_bitwise(back, reinterpret_cast<const uint16_t*>(src.data()), "unsorted (bf16)");
  }
}

// Softmax rows with a masked (-inf) expert; the backward takes the reference's y.
struct SoftmaxShape {
  int64_t T, E;
};
const SoftmaxShape kSoftmaxShapes[] = {{1, 1}, {1, 2}, {13, 7}, {5, 256}, {70, 256}, {33, 60}};

template <typename T>
void softmax_case(const Exec& ex) {
  uint32_t seed = 40;
  for (auto [T_, E] : kSoftmaxShapes) {
    BACKEND_TRACE("T=" << T_ << " E=" << E);
    auto x = random_vec<T>(T_ * E, seed++, -8, 8);
    if (E > 1) x[0] = -std::numeric_limits<T>::infinity();  // probability exactly 0
    const auto dy = random_vec<T>(T_ * E, seed++);
    std::vector<T> y_ref(T_ * E), dx_ref(T_ * E);
    ops::softmax_forward_ref(y_ref.data(), x.data(), T_, E);
    ops::softmax_backward_ref(dx_ref.data(), dy.data(), y_ref.data(), T_, E);
    Guarded<T> y = nan_out<T>(T_ * E), dx = nan_out<T>(T_ * E);
    {
      Staging st(ex);
      ops::softmax_forward<T>(ex, st.out(y), st.in(x), T_, E);
      ops::softmax_backward<T>(ex, st.out(dx), st.in(dy), st.in(y_ref), T_, E);
      st.back();
    }
    expect_close(y, y_ref.data(), "y");
    expect_close(dx, dx_ref.data(), "dx");
    if (E > 1) {
      EXPECT_EQ(y[0], T(0)) << "a -inf logit has probability 0";
    }
  }
}

// Top-k: continuous values, small integers with many exact ties and -inf entries (ties go to
// the lower index), K = 1, 2, 8 and E. Indices and values bitwise.
template <typename T>
// K = 1, 2, 8 and E (the whole order) on every shape but the largest, (70, 256), which takes K = 1,
// 2 and 8 only: its rows run the same per-row code as (5, 256)'s, where K = E = 256 is checked,
// and its grid (18 blocks of 4 rows, the last partial) is checked at the smaller K. K = E there
// was 80% of the case's time on the grid emulator (256 rounds of a 5-step warp butterfly on 70
// rows: 24,000 block-wide collectives, each switching 128 fibers) and checked nothing new.
void topk_values(const Exec& ex, int64_t T_, int64_t E, const std::vector<T>& x, const char* what) {
  const bool whole_order = T_ * E < 70 * 256;
  for (int64_t K : {int64_t(1), std::min<int64_t>(2, E), std::min<int64_t>(8, E), E}) {
    if (K == E && !whole_order && E > 8) continue;
    BACKEND_TRACE(what << " " << dtype_name<T>() << " T=" << T_ << " E=" << E << " K=" << K);
    Guarded<int32_t> idx(T_ * K, -7);
    Guarded<T> val = nan_out<T>(T_ * K);
    std::vector<int32_t> idx_ref(T_ * K);
    std::vector<T> val_ref(T_ * K);
    {
      Staging st(ex);
      ops::topk<T>(ex, st.out(idx), st.out(val), st.in(x), T_, E, K);
      st.back();
    }
    ops::topk_ref(idx_ref.data(), val_ref.data(), x.data(), T_, E, K);
    expect_bitwise(idx, idx_ref.data(), "idx_TK");
    expect_bitwise(val, val_ref.data(), "val_TK");
  }
}

void topk_case(const Exec& ex) {
  uint32_t seed = 50;
  for (auto [T_, E] : kSoftmaxShapes) {
    topk_values<float>(ex, T_, E, random_vec<float>(T_ * E, seed++), "random");
    topk_values<double>(ex, T_, E, random_vec<double>(T_ * E, seed++), "random");
    std::mt19937 gen(seed++);
    std::vector<float> ties(T_ * E);
    for (auto& v : ties) {
      const int r = static_cast<int>(gen() % 4);
      v = r == 3 ? -std::numeric_limits<float>::infinity() : static_cast<float>(r);
    }
    topk_values<float>(ex, T_, E, ties, "ties and -inf");
  }
}

// The shared expert's gate: y += sigmoid(l) s into a y that holds values, and its backward,
// out of place and with ds = dy (in place); logits out to +-30, where the sigmoid saturates.
template <typename T>
void sigmoid_gate_case(const Exec& ex) {
  uint32_t seed = 60;
  struct NH {
    int64_t N, H;
  };
  for (auto [N, H] : {NH{0, 4}, NH{1, 1}, NH{5, 3}, NH{13, 37}, NH{70, 300}}) {
    BACKEND_TRACE(dtype_name<T>() << " N=" << N << " H=" << H);
    const auto s = random_vec<T>(N * H, seed++);
    const auto l = random_vec<T>(N, seed++, -30, 30);
    const auto y0 = random_vec<T>(N * H, seed++);
    const auto dy = random_vec<T>(N * H, seed++);
    std::vector<T> y_ref = y0, ds_ref(N * H), dl_ref(N);
    ops::sigmoid_gate_forward_ref(y_ref.data(), s.data(), l.data(), N, H);
    ops::sigmoid_gate_backward_ref(ds_ref.data(), dl_ref.data(), dy.data(), s.data(), l.data(), N,
                                   H);
    Guarded<T> y = guarded(y0), ds = nan_out<T>(N * H), dl = nan_out<T>(N);
    {
      Staging st(ex);
      ops::sigmoid_gate_forward<T>(ex, st.out(y), st.in(s), st.in(l), N, H);
      ops::sigmoid_gate_backward<T>(ex, st.out(ds), st.out(dl), st.in(dy), st.in(s), st.in(l), N,
                                    H);
      st.back();
    }
    expect_close(y, y_ref.data(), "y");
    expect_close(ds, ds_ref.data(), "ds");
    expect_close(dl, dl_ref.data(), "dl");
    Guarded<T> inplace = guarded(dy), dl2 = nan_out<T>(N);
    {
      Staging st(ex);
      T* const io = st.out(inplace);  // staged once: ds and dy the same backend buffer
      ops::sigmoid_gate_backward<T>(ex, io, st.out(dl2), io, st.in(s), st.in(l), N, H);
      st.back();
    }
    expect_bitwise(inplace, ds, "ds in place");
    expect_bitwise(dl2, dl, "dl (ds in place)");
  }
}

}  // namespace

void add_moe_cases(std::vector<OpCase>& out) {
  out.push_back({"softmax_f32", {"softmax_forward", "softmax_backward"}, softmax_case<float>});
  out.push_back({"softmax_f64", {"softmax_forward", "softmax_backward"}, softmax_case<double>});
  out.push_back({"topk_k1_ke_ties", {"topk"}, topk_case});
  out.push_back({"sigmoid_gate_f32",
                 {"sigmoid_gate_forward", "sigmoid_gate_backward"},
                 sigmoid_gate_case<float>});
  out.push_back({"sigmoid_gate_f64",
                 {"sigmoid_gate_forward", "sigmoid_gate_backward"},
                 sigmoid_gate_case<double>});
  out.push_back({"build_permutation", {"build_permutation"}, build_permutation_case});
  out.push_back({"pad_permutation", {"pad_permutation"}, pad_permutation_case});
  out.push_back({"row_probs_f32", {"gather_row_probs", "scatter_row_probs"}, row_probs<float>});
  out.push_back({"row_probs_f64", {"gather_row_probs", "scatter_row_probs"}, row_probs<double>});
  out.push_back({"permute_rows", {"permute_rows"}, [](const Exec& ex) {
                   permute_rows_case<float>(ex);
                   permute_rows_case<double>(ex);
                 }});
  out.push_back({"permute_rows_bf16", {"permute_rows"}, permute_rows_bf16_case});
  out.push_back({"unpermute_rows_f32", {"unpermute_rows"}, unpermute_rows_case<float>});
  out.push_back({"unpermute_rows_f64", {"unpermute_rows"}, unpermute_rows_case<double>});
  out.push_back({"unpermute_rows_bf16", {"unpermute_rows"}, unpermute_rows_bf16_case});
  out.push_back({"build_group_permutation", {"build_group_permutation"},
                 build_group_permutation_case});
  out.push_back({"copy_row_chunks", {"copy_row_chunks"}, [](const Exec& ex) {
                   copy_row_chunks_case<float>(ex);
                   copy_row_chunks_case<double>(ex);
                 }});
  out.push_back({"copy_row_chunks_bf16", {"copy_row_chunks"}, copy_row_chunks_bf16_case});
}

}  // namespace moecore::backend_test
