// The dispatch kernels (src/ops/cuda/permute.cu) in the grid emulator: the permutation maps and
// counts bitwise the reference's (a stable counting sort), padding to capacity bitwise, the row
// gathers bitwise, unpermute bitwise the CPU fast path (k order) and within tolerance of the f64
// reference; every output the same bytes in every resume order, poisoned and guarded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "emu/emu_testing.h"
#include "ops/permute.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

struct Routing {
  int64_t T, K, E;
  std::vector<int32_t> idx;
};

// Ids in [-1, E) (dropped slots), skewed to the low experts so some get no rows; more than one
// block-width of slots, T*K not a multiple of 32; experts with more rows than a block (padding
// moves them in several rounds).
Routing routing(int64_t T, int64_t K, int64_t E, uint32_t seed) {
  Routing r{T, K, E, std::vector<int32_t>(size_t(T * K))};
  std::mt19937 g(seed);
  for (int32_t& id : r.idx) {
    const int64_t u = int64_t(g() % uint32_t(E + 1)) - 1;
    id = int32_t(g() % 3 == 0 ? std::min<int64_t>(u, E / 2) : u);
  }
  return r;
}

const std::vector<Routing>& routings() {
  static const std::vector<Routing> all = {
      routing(0, 2, 3, 1),   routing(1, 1, 1, 2),   routing(5, 2, 4, 3),  routing(37, 3, 7, 4),
      routing(300, 2, 5, 5), routing(20, 4, 70, 6), routing(700, 2, 3, 7)};
  return all;
}

struct Map {
  int64_t N = 0;
  std::vector<int64_t> counts;
  std::vector<int32_t> row_token, row_slot, token_rows;
};

Map ref_map(const Routing& r) {
  Map m;
  m.counts.resize(size_t(r.E));
  m.row_token.resize(size_t(r.T * r.K));
  m.row_slot.resize(size_t(r.T * r.K));
  m.token_rows.resize(size_t(r.T * r.K));
  m.N = ops::build_permutation_ref(m.counts.data(), m.row_token.data(), m.row_slot.data(),
                                   m.token_rows.data(), r.idx.data(), r.T, r.K, r.E);
  return m;
}

template <typename T>
Guarded<T> guarded(const std::vector<T>& v) {
  Guarded<T> g(int64_t(v.size()));
  std::copy(v.begin(), v.end(), g.data());
  return g;
}

template <typename T>
void expect_bitwise(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  ASSERT_EQ(size_t(got.size()), want.size()) << what;
  EXPECT_EQ(bytes_of(got.data(), want.size()), bytes_of(want.data(), want.size())) << what;
}

template <typename T>
void append(std::vector<unsigned char>& out, const Guarded<T>& g) {
  const std::vector<unsigned char> b = bytes_of(g.data(), size_t(g.size()));
  out.insert(out.end(), b.begin(), b.end());
}

std::string name(const Routing& r) {
  return "T=" + std::to_string(r.T) + " K=" + std::to_string(r.K) + " E=" + std::to_string(r.E);
}

TEST(EmuKernelsPermute, BuildPermutationIsTheStableCountingSort) {
  for (const Routing& r : routings()) {
    SCOPED_TRACE(name(r));
    const Map want = ref_map(r);
    const int64_t TK = r.T * r.K;
    Guarded<int64_t> n_kept(1), counts(r.E);
    Guarded<int32_t> row_token(TK), row_slot(TK), token_rows(TK);
    EXPECT_EQ(order_dependence([&] {
                n_kept = Guarded<int64_t>(1, -7);
                counts = Guarded<int64_t>(r.E, -7);
                row_token = Guarded<int32_t>(TK, -7);
                row_slot = Guarded<int32_t>(TK, -7);
                token_rows = Guarded<int32_t>(TK, -7);
                ops::cuda::build_permutation(nullptr, n_kept.data(), counts.data(),
                                             row_token.data(), row_slot.data(), token_rows.data(),
                                             r.idx.data(), r.T, r.K, r.E);
                std::vector<unsigned char> out;
                append(out, n_kept);
                append(out, counts);
                append(out, row_token);
                append(out, row_slot);
                append(out, token_rows);
                return out;
              }),
              "");
    expect_bitwise(n_kept, std::vector<int64_t>{want.N}, "n_kept");
    expect_bitwise(counts, want.counts, "counts_E");
    expect_bitwise(row_token, want.row_token, "row_token_N (pad rows -1 past N)");
    expect_bitwise(row_slot, want.row_slot, "row_slot_N");
    expect_bitwise(token_rows, want.token_rows, "token_rows_TK");
  }
}

// Capacity the largest count (no pad for that expert), one more, and far more (blocks move past
// the packed map's end, over several block-widths of rows).
TEST(EmuKernelsPermute, PadPermutationMatchesTheReference) {
  for (const Routing& r : routings()) {
    const Map m = ref_map(r);
    const int64_t max_count =
        m.counts.empty() ? 0 : *std::max_element(m.counts.begin(), m.counts.end());
    for (int64_t cap : {max_count, max_count + 1, max_count + 300}) {
      if (cap == 0) continue;
      SCOPED_TRACE(name(r) + " cap=" + std::to_string(cap));
      const size_t rows = size_t(std::max(r.E * cap, r.T * r.K));
      Map want = m;
      want.row_token.resize(rows, -7);
      want.row_slot.resize(rows, -7);
      const int64_t pad_want =
          ops::pad_permutation_ref(want.counts.data(), want.row_token.data(), want.row_slot.data(),
                                   want.token_rows.data(), m.N, r.T, r.K, r.E, cap);
      std::vector<int32_t> tok0 = m.row_token, slot0 = m.row_slot;
      tok0.resize(rows, -7);
      slot0.resize(rows, -7);
      Guarded<int64_t> pads(1), counts(0), n_kept = guarded(std::vector<int64_t>{m.N});
      Guarded<int32_t> row_token(0), row_slot(0), token_rows(0);
      EXPECT_EQ(order_dependence([&] {
                  pads = Guarded<int64_t>(1, -7);
                  counts = guarded(m.counts);
                  row_token = guarded(tok0);
                  row_slot = guarded(slot0);
                  token_rows = guarded(m.token_rows);
                  ops::cuda::pad_permutation(nullptr, pads.data(), counts.data(), row_token.data(),
                                             row_slot.data(), token_rows.data(), n_kept.data(), r.T,
                                             r.K, r.E, cap);
                  std::vector<unsigned char> out;
                  append(out, pads);
                  append(out, counts);
                  append(out, row_token);
                  append(out, row_slot);
                  append(out, token_rows);
                  return out;
                }),
                "");
      expect_bitwise(pads, std::vector<int64_t>{pad_want}, "pads");
      expect_bitwise(n_kept, std::vector<int64_t>{m.N}, "n_kept (read only)");
      expect_bitwise(counts, want.counts, "counts_E");
      expect_bitwise(row_token, want.row_token, "row_token_N");
      expect_bitwise(row_slot, want.row_slot, "row_slot_N");
      expect_bitwise(token_rows, want.token_rows, "token_rows_TK");
    }
  }
}

// The gathers on the packed map (rows [N, T K) are pad rows) for H around a warp and over the
// block; unpermute against the CPU fast path bitwise and the f64 reference within tolerance.
template <typename T>
void check_rows(const Routing& r, int64_t H) {
  SCOPED_TRACE(name(r) + " H=" + std::to_string(H));
  const Map m = ref_map(r);
  const int64_t TK = r.T * r.K;
  const std::vector<T> probs = random_vec<T>(TK, 71), dp = random_vec<T>(TK, 72);
  const std::vector<T> x = random_vec<T>(r.T * H, 73), xn = random_vec<T>(TK * H, 74);
  std::vector<T> p_ref(static_cast<size_t>(TK)), dprobs_ref(static_cast<size_t>(TK)),
      y_ref(static_cast<size_t>(TK * H)), u_ref(static_cast<size_t>(r.T * H)),
      u_cpu(static_cast<size_t>(r.T * H));
  ops::gather_row_probs_ref(p_ref.data(), probs.data(), m.row_token.data(), m.row_slot.data(), TK,
                            r.K);
  ops::scatter_row_probs_ref(dprobs_ref.data(), dp.data(), m.token_rows.data(), TK);
  ops::permute_rows_ref(y_ref.data(), x.data(), m.row_token.data(), TK, H);
  ops::unpermute_rows_ref(u_ref.data(), xn.data(), m.token_rows.data(), r.T, r.K, H);
  // The CPU fast path's sum: in T, from 0, the kept slots in k order.
  for (int64_t t = 0; t < r.T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      T acc = T(0);
      for (int64_t k = 0; k < r.K; ++k) {
        const int32_t row = m.token_rows[size_t(t * r.K + k)];
        if (row >= 0) acc += xn[size_t(row * H + h)];
      }
      u_cpu[size_t(t * H + h)] = acc;
    }
  }

  Guarded<T> p(TK), dprobs(TK), y(TK * H), u(r.T * H);
  EXPECT_EQ(
      order_dependence([&] {
        p = Guarded<T>(TK, T(NAN));
        dprobs = Guarded<T>(TK, T(NAN));
        y = Guarded<T>(TK * H, T(NAN));
        u = Guarded<T>(r.T * H, T(NAN));
        ops::cuda::gather_row_probs(nullptr, p.data(), probs.data(), m.row_token.data(),
                                    m.row_slot.data(), TK, r.K);
        ops::cuda::scatter_row_probs(nullptr, dprobs.data(), dp.data(), m.token_rows.data(), TK);
        ops::cuda::permute_rows(nullptr, y.data(), x.data(), m.row_token.data(), TK, H);
        ops::cuda::unpermute_rows(nullptr, u.data(), xn.data(), m.token_rows.data(), r.T, r.K, H);
        std::vector<unsigned char> out;
        append(out, p);
        append(out, dprobs);
        append(out, y);
        append(out, u);
        return out;
      }),
      "");
  expect_bitwise(p, p_ref, "gather_row_probs");
  expect_bitwise(dprobs, dprobs_ref, "scatter_row_probs");
  expect_bitwise(y, y_ref, "permute_rows");
  expect_bitwise(u, u_cpu, "unpermute_rows (the sum in k order)");
  for (int64_t i = 0; i < r.T * H; ++i) {
    ASSERT_NEAR(u[i], u_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(u_ref[size_t(i)]))
        << "unpermute_rows element " << i;
  }
}

TEST(EmuKernelsPermute, RowGathersAndUnpermute) {
  const std::vector<Routing>& all = routings();
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t H = std::vector<int64_t>{1, 33, 300}[i % 3];
    check_rows<float>(all[i], H);
    check_rows<double>(all[i], i == 2 ? 1 : H);
  }
}

// The all-to-all reorder [source rank][expert] -> [expert][source rank] with empty chunks and
// chunks longer than a block.
template <typename T>
void check_chunks(int64_t R, int64_t L, int64_t W, uint32_t seed) {
  SCOPED_TRACE("R=" + std::to_string(R) + " L=" + std::to_string(L) + " W=" + std::to_string(W));
  std::mt19937 g(seed);
  std::vector<int64_t> rows(size_t(R * L));
  for (int64_t& n : rows) n = g() % 4 == 0 ? 0 : int64_t(g() % 40);
  std::vector<int64_t> src_off(rows.size()), dst_off(rows.size());
  int64_t at = 0;
  for (int64_t c = 0; c < R * L; ++c) src_off[size_t(c)] = at, at += rows[size_t(c)];
  const int64_t N = at;
  at = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t r = 0; r < R; ++r) dst_off[size_t(r * L + l)] = at, at += rows[size_t(r * L + l)];
  }
  const std::vector<T> src = random_vec<T>(N * W, seed + 1);
  std::vector<T> want(size_t(N * W), T(NAN));
  ops::copy_row_chunks_ref(want.data(), src.data(), dst_off.data(), src_off.data(), rows.data(),
                           R * L, W);
  Guarded<T> dst(N * W);
  EXPECT_EQ(order_dependence([&] {
              dst = Guarded<T>(N * W, T(NAN));
              ops::cuda::copy_row_chunks(nullptr, dst.data(), src.data(), dst_off.data(),
                                         src_off.data(), rows.data(), R * L, W);
              return bytes_of(dst.data(), size_t(N * W));
            }),
            "");
  expect_bitwise(dst, want, "copy_row_chunks");
}

TEST(EmuKernelsPermute, CopyRowChunks) {
  check_chunks<float>(1, 1, 1, 81);
  check_chunks<float>(3, 5, 7, 82);
  check_chunks<double>(2, 4, 33, 83);
  check_chunks<double>(2, 0, 9, 84);
}

TEST(EmuKernelsPermute, BadShapesAreRefusedWithTheValues) {
  int64_t n = 0, c = 0;
  int32_t i = 0;
  try {
    ops::cuda::build_permutation(nullptr, &n, &c, &i, &i, &i, &i, 1, 1, 0);
    FAIL() << "E=0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("E=0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore
