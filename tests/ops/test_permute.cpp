// Dispatch permutation: the map on a hand example (expert-major, token-ascending), fast map ==
// reference map on awkward routings (drops, empty experts, all to one expert, K = E), gathers vs
// reference with guard bytes, unpermute(permute(x)) == K * x, and the adjoint gradients.
#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/permute.h"

namespace moecore::testing {
namespace {

using ops::build_permutation;
using ops::build_permutation_ref;
using ops::permute_rows;
using ops::permute_rows_ref;
using ops::unpermute_rows;
using ops::unpermute_rows_ref;

struct Map {
  int64_t N = 0;
  std::vector<int64_t> counts;
  std::vector<int32_t> row_token, row_slot, token_rows;
};

template <bool kFast>
Map build(const std::vector<int32_t>& idx, int64_t T, int64_t K, int64_t E) {
  Guarded<int64_t> counts(E);
  Guarded<int32_t> row_token(T * K), row_slot(T * K), token_rows(T * K);
  auto f = kFast ? ops::cpu::build_permutation : build_permutation_ref;
  Map m;
  m.N = f(counts.data(), row_token.data(), row_slot.data(), token_rows.data(), idx.data(), T, K, E);
  EXPECT_TRUE(counts.intact() && row_token.intact() && row_slot.intact() && token_rows.intact());
  m.counts = counts.vec();
  m.row_token = row_token.vec();
  m.row_slot = row_slot.vec();
  for (int64_t r = m.N; r < T * K; ++r) {  // the dropped slots' rows: pad rows
    EXPECT_EQ(m.row_token[r], -1) << "row " << r;
    EXPECT_EQ(m.row_slot[r], -1) << "row " << r;
  }
  m.row_token.resize(m.N);
  m.row_slot.resize(m.N);
  m.token_rows = token_rows.vec();
  return m;
}

TEST(Permute, HandExampleIsExpertMajorTokenAscending) {
  // T = 4, K = 2, E = 4 (expert 3 gets no tokens); -1 = dropped slot.
  const std::vector<int32_t> idx = {2, 0, 0, 1, 2, -1, 0, 2};
  for (const Map& m : {build<true>(idx, 4, 2, 4), build<false>(idx, 4, 2, 4)}) {
    EXPECT_EQ(m.N, 7);
    EXPECT_EQ(m.counts, (std::vector<int64_t>{3, 1, 3, 0}));
    EXPECT_EQ(m.row_token, (std::vector<int32_t>{0, 1, 3, 1, 0, 2, 3}));
    EXPECT_EQ(m.row_slot, (std::vector<int32_t>{1, 0, 0, 1, 0, 0, 1}));
    EXPECT_EQ(m.token_rows, (std::vector<int32_t>{4, 0, 1, 3, 5, -1, 2, 6}));
  }
}

TEST(Permute, RepeatedExpertInOneTokenKeepsSlotOrder) {
  const std::vector<int32_t> idx = {1, 1, 0, 1};  // T = 2, K = 2, E = 2
  for (const Map& m : {build<true>(idx, 2, 2, 2), build<false>(idx, 2, 2, 2)}) {
    EXPECT_EQ(m.row_token, (std::vector<int32_t>{1, 0, 0, 1}));
    EXPECT_EQ(m.row_slot, (std::vector<int32_t>{0, 0, 1, 1}));
    EXPECT_EQ(m.token_rows, (std::vector<int32_t>{1, 2, 0, 3}));
  }
}

struct Routing {
  std::string name;
  int64_t T, K, E;
  std::vector<int32_t> idx;
};

std::vector<Routing> routings() {
  std::vector<Routing> out;
  std::mt19937 gen(42);
  auto distinct = [&](int64_t T, int64_t K, int64_t E, double drop) {
    std::vector<int32_t> idx(T * K);
    std::vector<int32_t> perm(E);
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t t = 0; t < T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), gen);
      for (int64_t k = 0; k < K; ++k) idx[t * K + k] = u(gen) < drop ? -1 : perm[k];
    }
    return idx;
  };
  out.push_back({"T1K1E1", 1, 1, 1, {0}});
  out.push_back({"random", 13, 2, 8, distinct(13, 2, 8, 0.0)});
  out.push_back({"random_drops", 13, 3, 7, distinct(13, 3, 7, 0.3)});
  out.push_back({"K_equals_E", 13, 4, 4, distinct(13, 4, 4, 0.0)});
  out.push_back({"big", 200, 8, 64, distinct(200, 8, 64, 0.1)});
  std::vector<int32_t> one(13, 5);  // all tokens to expert 5, K = 1: the others get 0 rows
  out.push_back({"all_to_one", 13, 1, 8, one});
  out.push_back({"all_dropped", 5, 2, 3, std::vector<int32_t>(10, -1)});
  return out;
}

TEST(Permute, FastMapEqualsRefMap) {
  for (const auto& r : routings()) {
    SCOPED_TRACE(r.name);
    Map a = build<true>(r.idx, r.T, r.K, r.E), b = build<false>(r.idx, r.T, r.K, r.E);
    EXPECT_EQ(a.N, b.N);
    EXPECT_EQ(a.counts, b.counts);
    EXPECT_EQ(a.row_token, b.row_token);
    EXPECT_EQ(a.row_slot, b.row_slot);
    EXPECT_EQ(a.token_rows, b.token_rows);
    int64_t kept = std::count_if(r.idx.begin(), r.idx.end(), [](int32_t e) { return e >= 0; });
    EXPECT_EQ(a.N, kept);
    EXPECT_EQ(std::accumulate(a.counts.begin(), a.counts.end(), int64_t(0)), kept);
    // Each row maps back to its (t, k), and rows are sorted by (expert, token).
    for (int64_t row = 0; row < a.N; ++row) {
      EXPECT_EQ(a.token_rows[a.row_token[row] * r.K + a.row_slot[row]], row);
      if (row > 0) {
        int32_t e0 = r.idx[a.row_token[row - 1] * r.K + a.row_slot[row - 1]];
        int32_t e1 = r.idx[a.row_token[row] * r.K + a.row_slot[row]];
        EXPECT_TRUE(e0 < e1 || (e0 == e1 && a.row_token[row - 1] <= a.row_token[row]));
      }
    }
  }
}

TEST(Permute, RejectsOutOfRangeExpert) {
  const std::vector<int32_t> idx = {0, 1, 9, 2};
  std::vector<int64_t> counts(4);
  std::vector<int32_t> rt(4), rs(4), tr(4);
  for (auto f : {ops::cpu::build_permutation, build_permutation_ref}) {
    try {
      f(counts.data(), rt.data(), rs.data(), tr.data(), idx.data(), 2, 2, 4);
      ADD_FAILURE() << "expert id 9 >= E = 4 accepted";
    } catch (const moecore::Error& e) {
      EXPECT_NE(std::string(e.what()).find("expert id 9"), std::string::npos) << e.what();
    }
  }
}

template <typename T>
void compare_gathers(double rtol, double atol) {
  for (const auto& r : routings()) {
    for (int64_t H : {1, 7, 37}) {
      SCOPED_TRACE(::testing::Message() << r.name << " H=" << H);
      Map m = build<true>(r.idx, r.T, r.K, r.E);
      auto x = random_vec<T>(r.T * H, 1);
      auto xn = random_vec<T>(m.N * H, 2);
      Guarded<T> y(m.N * H), y_r(m.N * H), z(r.T * H), z_r(r.T * H);
      permute_rows<T>(cpu_exec(), y.data(), x.data(), m.row_token.data(), m.N, H);
      permute_rows_ref(y_r.data(), x.data(), m.row_token.data(), m.N, H);
      unpermute_rows<T>(cpu_exec(), z.data(), xn.data(), m.token_rows.data(), r.T, r.K, H);
      unpermute_rows_ref(z_r.data(), xn.data(), m.token_rows.data(), r.T, r.K, H);
      EXPECT_EQ(y.vec(), y_r.vec());  // a pure gather: exact
      EXPECT_TRUE(all_close(z.vec(), z_r.vec(), rtol, atol));
      for (auto* g : {&y, &y_r, &z, &z_r}) EXPECT_TRUE(g->intact());
    }
  }
}

// Padding to capacity, the probs gather and its scatter backward: fast == reference bitwise on
// every routing (cap = the largest count, and one more), pad rows zero in the row gather.
TEST(Permute, PaddingAndProbGathersEqualRef) {
  for (const auto& r : routings()) {
    Map m = build<true>(r.idx, r.T, r.K, r.E);
    const int64_t max_count = *std::max_element(m.counts.begin(), m.counts.end());
    for (int64_t cap : {max_count, max_count + 1}) {
      SCOPED_TRACE(::testing::Message() << r.name << " cap=" << cap);
      if (cap == 0) continue;
      const int64_t rows = r.E * cap;
      std::vector<int64_t> cnt_f = m.counts, cnt_r = m.counts;
      std::vector<int32_t> tok_f(std::max(rows, m.N)), slot_f(tok_f.size()), tr_f = m.token_rows;
      std::copy(m.row_token.begin(), m.row_token.end(), tok_f.begin());
      std::copy(m.row_slot.begin(), m.row_slot.end(), slot_f.begin());
      std::vector<int32_t> tok_r = tok_f, slot_r = slot_f, tr_r = m.token_rows;
      int64_t pad_f = -1;
      ops::pad_permutation(cpu_exec(), &pad_f, cnt_f.data(), tok_f.data(), slot_f.data(),
                           tr_f.data(), &m.N, r.T, r.K, r.E, cap);
      const int64_t pad_r = ops::pad_permutation_ref(cnt_r.data(), tok_r.data(), slot_r.data(),
                                                     tr_r.data(), m.N, r.T, r.K, r.E, cap);
      EXPECT_EQ(pad_f, pad_r);
      EXPECT_EQ(pad_f, rows - m.N);
      EXPECT_EQ(cnt_f, cnt_r);
      tok_f.resize(rows);
      tok_r.resize(rows);
      slot_f.resize(rows);
      slot_r.resize(rows);
      EXPECT_EQ(tok_f, tok_r);
      EXPECT_EQ(slot_f, slot_r);
      EXPECT_EQ(tr_f, tr_r);
      auto probs = random_vec<float>(r.T * r.K, 3);
      auto x = random_vec<float>(r.T * 5, 4);
      Guarded<float> p(rows), p_r(rows), y(rows * 5), y_r(rows * 5);
      ops::gather_row_probs<float>(cpu_exec(), p.data(), probs.data(), tok_f.data(), slot_f.data(),
                                   rows, r.K);
      ops::gather_row_probs_ref(p_r.data(), probs.data(), tok_f.data(), slot_f.data(), rows, r.K);
      permute_rows<float>(cpu_exec(), y.data(), x.data(), tok_f.data(), rows, 5);
      permute_rows_ref(y_r.data(), x.data(), tok_f.data(), rows, 5);
      EXPECT_EQ(p.vec(), p_r.vec());
      EXPECT_EQ(y.vec(), y_r.vec());
      for (int64_t row = 0; row < rows; ++row) {
        if (tok_f[row] >= 0) continue;
        EXPECT_EQ(p[row], 0.f) << "pad row " << row;
        for (int h = 0; h < 5; ++h) EXPECT_EQ(y[row * 5 + h], 0.f) << "pad row " << row;
      }
      auto dp = random_vec<float>(rows, 5);
      Guarded<float> dprobs(r.T * r.K), dprobs_r(r.T * r.K);
      ops::scatter_row_probs<float>(cpu_exec(), dprobs.data(), dp.data(), tr_f.data(), r.T * r.K);
      ops::scatter_row_probs_ref(dprobs_r.data(), dp.data(), tr_f.data(), r.T * r.K);
      EXPECT_EQ(dprobs.vec(), dprobs_r.vec());
      // The scatter is the gather's adjoint: <gather(probs), dp> = <probs, scatter(dp)>.
      double lhs = 0, rhs = 0;
      for (int64_t row = 0; row < rows; ++row) lhs += double(p[row]) * dp[row];
      for (int64_t i = 0; i < r.T * r.K; ++i) rhs += double(probs[i]) * dprobs[i];
      EXPECT_NEAR(lhs, rhs, 1e-12 * (std::abs(lhs) + 1));
      for (auto* g : {&p, &p_r, &y, &y_r, &dprobs, &dprobs_r}) EXPECT_TRUE(g->intact());
    }
  }
  std::vector<int64_t> counts = {3};
  std::vector<int32_t> tok = {0, 1, 2}, slot = {0, 0, 0}, tr = {0, 1, 2};
  const int64_t kept = 3;
  int64_t pads = -1;
  EXPECT_THROW(ops::pad_permutation(cpu_exec(), &pads, counts.data(), tok.data(), slot.data(),
                                    tr.data(), &kept, 3, 1, 1, 2),
               moecore::Error);  // 3 rows > capacity 2
}

TEST(Permute, FastGathersMatchRefF32) {
  compare_gathers<float>(kF32Rtol, kF32Atol);
}
TEST(Permute, FastGathersMatchRefF64) {
  compare_gathers<double>(kF64Rtol, kF64Atol);
}

TEST(Permute, UnpermuteOfPermuteIsKeptCountTimesX) {
  for (const auto& r : routings()) {
    SCOPED_TRACE(r.name);
    const int64_t H = 9;
    Map m = build<true>(r.idx, r.T, r.K, r.E);
    // Small integers: every sum is exact in f32, so equality is exact.
    std::vector<float> x(r.T * H);
    for (int64_t i = 0; i < r.T * H; ++i) x[i] = float(int(i % 11) - 5);
    std::vector<float> y(m.N * H), z(r.T * H);
    permute_rows<float>(cpu_exec(), y.data(), x.data(), m.row_token.data(), m.N, H);
    unpermute_rows<float>(cpu_exec(), z.data(), y.data(), m.token_rows.data(), r.T, r.K, H);
    for (int64_t t = 0; t < r.T; ++t) {
      int kept = 0;
      for (int64_t k = 0; k < r.K; ++k) kept += r.idx[t * r.K + k] >= 0;
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(z[t * H + h], float(kept) * x[t * H + h]);
    }
  }
}

TEST(Permute, UnpermuteOfPermuteIsKTimesXWhenNothingDropped) {
  const auto rs = routings();
  const Routing& r = rs[3];  // K_equals_E, dropless
  ASSERT_EQ(r.name, "K_equals_E");
  const int64_t H = 5;
  Map m = build<true>(r.idx, r.T, r.K, r.E);
  ASSERT_EQ(m.N, r.T * r.K);
  std::vector<float> x(r.T * H), y(m.N * H), z(r.T * H);
  for (int64_t i = 0; i < r.T * H; ++i) x[i] = float(i % 7) - 3.f;
  permute_rows<float>(cpu_exec(), y.data(), x.data(), m.row_token.data(), m.N, H);
  unpermute_rows<float>(cpu_exec(), z.data(), y.data(), m.token_rows.data(), r.T, r.K, H);
  for (int64_t i = 0; i < r.T * H; ++i) ASSERT_EQ(z[i], float(r.K) * x[i]);
}

// bf16 rows into f32 tokens (--bf16: the experts' outputs and input gradients come back as bf16
// rows): the fast path bitwise the reference (both sum the widened rows in f32, from 0, in k
// order) and bitwise the f32 form on the widened rows; random bits of finite values, guarded
// output, a size over the parallel threshold. Its adjoint is the permutation of the f32
// gradient, which the finite differences above check for the f32 form: the bf16 rows only change
// what the rows hold, not the map.
TEST(Permute, UnpermuteOfBf16RowsIsTheF32FormOnWidenedRows) {
  for (const auto& r : routings()) {
    for (int64_t H : {int64_t(1), int64_t(9), int64_t(640)}) {
      SCOPED_TRACE(r.name + " H=" + std::to_string(H));
      Map m = build<true>(r.idx, r.T, r.K, r.E);
      const auto xf = random_vec<float>(m.N * H, 7 + uint32_t(H));
      std::vector<bf16> x(xf.size());
      std::vector<float> widened(xf.size());
      for (size_t i = 0; i < xf.size(); ++i) {
        x[i] = float_to_bf16(xf[i]);
        widened[i] = bf16_to_float(x[i]);
      }
      Guarded<float> y(r.T * H, NAN);
      std::vector<float> y_ref(r.T * H), y_f32(r.T * H);
      unpermute_rows(cpu_exec(), y.data(), x.data(), m.token_rows.data(), r.T, r.K, H);
      unpermute_rows_ref(y_ref.data(), x.data(), m.token_rows.data(), r.T, r.K, H);
      unpermute_rows<float>(cpu_exec(), y_f32.data(), widened.data(), m.token_rows.data(), r.T,
                            r.K, H);
      EXPECT_TRUE(y.intact());
      for (int64_t i = 0; i < r.T * H; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(y_ref[i])) << i;
        ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(y_f32[i])) << i;
      }
    }
  }
}

// permute and unpermute are each other's adjoints; check both against finite differences.
TEST(Permute, GradientsMatchFiniteDifferences) {
  for (const auto& r : routings()) {
    if (r.T * r.K > 64) continue;
    SCOPED_TRACE(r.name);
    const int64_t H = 3;
    Map m = build<true>(r.idx, r.T, r.K, r.E);
    auto x = random_vec<double>(r.T * H, 3);
    auto xn = random_vec<double>(m.N * H, 4);
    auto Rn = random_vec<double>(m.N * H, 5);
    auto Rt = random_vec<double>(r.T * H, 6);
    std::vector<double> y(m.N * H), z(r.T * H), dx(r.T * H), dxn(m.N * H);
    auto loss_p = [&] {
      permute_rows<double>(cpu_exec(), y.data(), x.data(), m.row_token.data(), m.N, H);
      double l = 0;
      for (int64_t i = 0; i < m.N * H; ++i) l += y[i] * Rn[i];
      return l;
    };
    auto loss_u = [&] {
      unpermute_rows<double>(cpu_exec(), z.data(), xn.data(), m.token_rows.data(), r.T, r.K, H);
      double l = 0;
      for (int64_t i = 0; i < r.T * H; ++i) l += z[i] * Rt[i];
      return l;
    };
    unpermute_rows<double>(cpu_exec(), dx.data(), Rn.data(), m.token_rows.data(), r.T, r.K, H);
    permute_rows<double>(cpu_exec(), dxn.data(), Rt.data(), m.row_token.data(), m.N, H);
    EXPECT_TRUE(check_gradient(loss_p, x.data(), dx.data(), r.T * H, "permute dx"));
    EXPECT_TRUE(check_gradient(loss_u, xn.data(), dxn.data(), m.N * H, "unpermute dx"));
  }
}

// A chunk with a negative row count or offset (a corrupted plan) stops naming the chunk.
TEST(Permute, CopyRowChunksRefusesNegativeChunks) {
  std::vector<float> src(8, 1.f), dst(8, 0.f);
  const std::vector<int64_t> dst_off = {0, 2}, src_off = {0, 4}, rows = {2, -1};
  try {
    ops::copy_row_chunks<float>(cpu_exec(), dst.data(), src.data(), dst_off.data(), src_off.data(),
                                rows.data(), 2, 2);
    ADD_FAILURE() << "a chunk of -1 rows accepted";
  } catch (const moecore::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[copy_row_chunks] chunk 1: -1 rows"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moecore::testing
