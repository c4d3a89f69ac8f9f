// The dispatch kernels (src/ops/cuda/permute.cu) in the grid emulator: the permutation maps and
// counts bitwise the reference's (a stable counting sort), padding to capacity bitwise, the row
// gathers bitwise, unpermute bitwise the CPU fast path (k order) and within tolerance of the f64
// reference; the all-gather dispatcher's group permutation bitwise its reference (and its N);
// every output the same bytes in every resume order, poisoned and guarded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/permute.h"

namespace moecore {
namespace {

using emu_test::append;
using emu_test::bytes_of;
using emu_test::expect_bitwise;
using emu_test::guarded;
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

// Every slot routed to `id` (E for all dropped: an id past the experts).
Routing uniform(int64_t T, int64_t K, int64_t E, int32_t id) {
  return Routing{T, K, E, std::vector<int32_t>(size_t(T * K), id)};
}

const std::vector<Routing>& routings() {
  static const std::vector<Routing> all = {
      routing(0, 2, 3, 1),   routing(1, 1, 1, 2),   routing(5, 2, 4, 3),  routing(37, 3, 7, 4),
      routing(300, 2, 5, 5), routing(20, 4, 70, 6), routing(700, 2, 3, 7)};
  return all;
}

// The tiled permutation's shapes (the maps only): many tiles over more than one block with a
// ragged last tile (T K 6001 = 11 tiles of 512 + 369); E over 256 (tiles of 608 slots, 1800
// counters: more than one round of the scan block); T K < E (a single tile's counters in
// counts_E; with E 2500 read back in three chunks); all slots dropped (ids -1; ids >= E, which
// the device drops); one expert taking every slot.
const std::vector<Routing>& tile_routings() {
  static const std::vector<Routing> all = {
      routing(2000, 3, 7, 8),   routing(1, 6001, 37, 9), routing(900, 4, 300, 10),
      routing(3, 2, 50, 11),    routing(3, 2, 2500, 12), uniform(600, 2, 5, -1),
      uniform(77, 3, 300, 300), uniform(1500, 2, 9, 4),  uniform(1, 1, 1, 0)};
  return all;
}

std::vector<Routing> all_routings() {
  std::vector<Routing> all = routings();
  for (const Routing& r : tile_routings()) all.push_back(r);
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
  // The device drops an id >= E (it cannot throw; the CPU paths do): the reference on -1 there.
  std::vector<int32_t> idx = r.idx;
  for (int32_t& id : idx) id = id >= r.E ? -1 : id;
  m.N = ops::build_permutation_ref(m.counts.data(), m.row_token.data(), m.row_slot.data(),
                                   m.token_rows.data(), idx.data(), r.T, r.K, r.E);
  return m;
}

std::string name(const Routing& r) {
  return "T=" + std::to_string(r.T) + " K=" + std::to_string(r.K) + " E=" + std::to_string(r.E);
}

TEST(EmuKernelsPermute, BuildPermutationIsTheStableCountingSort) {
  for (const Routing& r : all_routings()) {
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
  for (const Routing& r : all_routings()) {
    const Map m = ref_map(r);
    const int64_t max_count =
        m.counts.empty() ? 0 : *std::max_element(m.counts.begin(), m.counts.end());
    for (int64_t cap : {max_count, max_count + 1, max_count + 300}) {
      if (cap == 0 || r.E * cap > 30000) continue;  // the largest shapes: not 300 more (emulator time)
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

// An expert over its capacity (the CPU paths throw; the device cannot): its first cap rows are
// placed, the slots of the others dropped (token_rows -1); the other experts as padded normally.
TEST(EmuKernelsPermute, PadPermutationOverCapacityKeepsTheFirstCapRows) {
  const Routing r = routing(300, 2, 5, 21);
  const Map m = ref_map(r);
  const int64_t max_count = *std::max_element(m.counts.begin(), m.counts.end());
  const int64_t cap = max_count - 3, TK = r.T * r.K;
  ASSERT_GT(cap, 0);
  const size_t rows = size_t(std::max(r.E * cap, TK));
  std::vector<int32_t> tok_want(rows, -7), slot_want(rows, -7), trows_want = m.token_rows;
  for (size_t p = size_t(r.E * cap); p < rows; ++p) {  // past the padded rows: untouched
    tok_want[p] = m.row_token[p];
    slot_want[p] = m.row_slot[p];
  }
  int64_t start = 0;
  for (int64_t e = 0; e < r.E; ++e) {
    for (int64_t j = 0; j < cap; ++j) {
      const bool real = j < m.counts[size_t(e)];
      tok_want[size_t(e * cap + j)] = real ? m.row_token[size_t(start + j)] : -1;
      slot_want[size_t(e * cap + j)] = real ? m.row_slot[size_t(start + j)] : -1;
    }
    for (int64_t j = 0; j < m.counts[size_t(e)]; ++j) {
      const int64_t i = m.row_token[size_t(start + j)] * r.K + m.row_slot[size_t(start + j)];
      trows_want[size_t(i)] = j < cap ? int32_t(e * cap + j) : -1;
    }
    start += m.counts[size_t(e)];
  }
  std::vector<int32_t> tok0 = m.row_token, slot0 = m.row_slot;
  tok0.resize(rows, -7);
  slot0.resize(rows, -7);
  const Guarded<int64_t> n_kept = guarded(std::vector<int64_t>{m.N});
  Guarded<int64_t> pads(1), counts(0);
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
  expect_bitwise(pads, std::vector<int64_t>{r.E * cap - m.N}, "pads (E cap - N)");
  expect_bitwise(counts, std::vector<int64_t>(size_t(r.E), cap), "counts_E");
  expect_bitwise(row_token, tok_want, "row_token_N");
  expect_bitwise(row_slot, slot_want, "row_slot_N");
  expect_bitwise(token_rows, trows_want, "token_rows_TK");
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
    // 300 and 64: rows of whole 16-byte vectors (the _vec kernels); 1 and 33: the scalar ones.
    const int64_t H = std::vector<int64_t>{1, 33, 300, 64}[i % 4];
    check_rows<float>(all[i], H);
    check_rows<double>(all[i], i == 2 ? 1 : H);
  }
}

// bf16 rows (the --bf16 dispatch: the tokens and output gradients cast once, then moved): the
// gathers and the chunk copies move the bits, bitwise the reference, pad rows bf16 zeros. Held as
// uint16_t bits; H 8 and 64 (16-byte rows, the _vec kernels), 1 and 33 (the scalar ones), and a
// row start 2 bytes off 16-byte alignment (the scalar kernels on rows of whole vectors).
void check_rows_bf16(const Routing& r, int64_t H, int64_t off) {
  SCOPED_TRACE(name(r) + " bf16 H=" + std::to_string(H) + " offset=" + std::to_string(off));
  const Map m = ref_map(r);
  const int64_t TK = r.T * r.K;
  std::vector<uint16_t> x(size_t(off + r.T * H));
  std::mt19937 g(91 + uint32_t(H));
  for (uint16_t& v : x) v = uint16_t(g());
  std::vector<uint16_t> want(size_t(TK * H));
  ops::permute_rows_ref(reinterpret_cast<bf16*>(want.data()),
                        reinterpret_cast<const bf16*>(x.data() + off), m.row_token.data(), TK, H);
  Guarded<uint16_t> y(off + TK * H);
  EXPECT_EQ(order_dependence([&] {
              y = Guarded<uint16_t>(off + TK * H, 0x7fc1);
              ops::cuda::permute_rows(nullptr, reinterpret_cast<bf16*>(y.data() + off),
                                      reinterpret_cast<const bf16*>(x.data() + off),
                                      m.row_token.data(), TK, H);
              return bytes_of(y.data(), size_t(off + TK * H));
            }),
            "");
  for (int64_t i = 0; i < TK * H; ++i)
    ASSERT_EQ(y[off + i], want[size_t(i)]) << "permute_rows (bf16) element " << i;
  EXPECT_TRUE(y.intact()) << "permute_rows (bf16): written outside its rows";
}

TEST(EmuKernelsPermute, RowGathersOfBf16Rows) {
  const std::vector<Routing>& all = routings();
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t H = std::vector<int64_t>{8, 33, 64, 1}[i % 4];
    check_rows_bf16(all[i], H, 0);
    check_rows_bf16(all[i], 64, 1);
  }
}

// bf16 rows into f32 tokens (--bf16: the experts' outputs and input gradients come back as bf16
// rows): each token's rows widened and summed in f32 in k order, bitwise the reference, in every
// resume order; H 8 and 64 (rows of whole 16-byte vectors: the _vec kernel, 8 bf16 in, 8 f32
// out), 1 and 33 (the scalar one), and rows 2 bytes off 16-byte alignment (the scalar kernel on
// rows of whole vectors). Random bits of finite values (the exponent kept below all ones).
void check_unpermute_bf16(const Routing& r, int64_t H, int64_t off) {
  SCOPED_TRACE(name(r) + " unpermute bf16 H=" + std::to_string(H) + " offset=" +
               std::to_string(off));
  const Map m = ref_map(r);
  const int64_t TK = r.T * r.K;
  std::vector<uint16_t> x(size_t(off + TK * H));
  std::mt19937 g(97 + uint32_t(H));
  for (uint16_t& v : x) v = uint16_t(g() & 0xbeffu);  // exponent < 0xff: finite
  std::vector<float> want(size_t(r.T * H));
  ops::unpermute_rows_ref(want.data(), reinterpret_cast<const bf16*>(x.data() + off),
                          m.token_rows.data(), r.T, r.K, H);
  Guarded<float> y(r.T * H);
  EXPECT_EQ(order_dependence([&] {
              y = Guarded<float>(r.T * H, NAN);
              ops::cuda::unpermute_rows(nullptr, y.data(),
                                        reinterpret_cast<const bf16*>(x.data() + off),
                                        m.token_rows.data(), r.T, r.K, H);
              return bytes_of(y.data(), size_t(r.T * H));
            }),
            "");
  expect_bitwise(y, want, "unpermute_rows (bf16 rows, f32 sums in k order)");
}

TEST(EmuKernelsPermute, UnpermuteOfBf16Rows) {
  const std::vector<Routing>& all = routings();
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t H = std::vector<int64_t>{8, 33, 64, 1}[i % 4];
    check_unpermute_bf16(all[i], H, 0);
    check_unpermute_bf16(all[i], 64, 1);
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
  check_chunks<float>(3, 5, 8, 85);   // rows of 32 bytes: the 16-byte kernel
  check_chunks<double>(2, 4, 6, 86);  // rows of 48 bytes
}

// The same reorder of bf16 rows (the --bf16 dispatch's chunk sort): W 16 (32-byte rows, the
// 16-byte kernel), 7 and 1 (the scalar one); a copy of the bits, bitwise the reference.
void check_chunks_bf16(int64_t R, int64_t L, int64_t W, uint32_t seed) {
  SCOPED_TRACE("bf16 R=" + std::to_string(R) + " L=" + std::to_string(L) +
               " W=" + std::to_string(W));
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
  std::vector<uint16_t> src(size_t(N * W)), want(size_t(N * W), 0x7fc1);
  for (uint16_t& v : src) v = uint16_t(g());
  ops::copy_row_chunks_ref(reinterpret_cast<bf16*>(want.data()),
                           reinterpret_cast<const bf16*>(src.data()), dst_off.data(),
                           src_off.data(), rows.data(), R * L, W);
  Guarded<uint16_t> dst(N * W);
  EXPECT_EQ(order_dependence([&] {
              dst = Guarded<uint16_t>(N * W, 0x7fc1);
              ops::cuda::copy_row_chunks(nullptr, reinterpret_cast<bf16*>(dst.data()),
                                         reinterpret_cast<const bf16*>(src.data()), dst_off.data(),
                                         src_off.data(), rows.data(), R * L, W);
              return bytes_of(dst.data(), size_t(N * W));
            }),
            "");
  expect_bitwise(dst, want, "copy_row_chunks (bf16)");
}

TEST(EmuKernelsPermute, CopyRowChunksOfBf16Rows) {
  check_chunks_bf16(3, 5, 16, 87);
  check_chunks_bf16(2, 4, 7, 88);
  check_chunks_bf16(1, 1, 1, 89);
}

// build_group_permutation: R ranks' gathered routing (rank r has tok_R[r] tokens, some none), the
// L local experts of rank me; caps per rank (0: no padding). Maps, rows_L and pads bitwise the
// reference's and the returned N its N, in every resume order; max_rows = N - 1 writes rows_L
// alone (the other outputs keep their poison).
struct Group {
  std::vector<int64_t> tok_R;
  int64_t L, me, K;
  std::vector<int64_t> extra_cap_R;  // cap_R[r] = the largest chunk of rank r + extra; < 0: none
  uint32_t seed;
  int64_t host_G = -1;  // GroupRouting::G (sizes the launches only); < 0: the true G
};

std::string name(const Group& s) {
  std::ostringstream n;
  n << "R=" << s.tok_R.size() << " L=" << s.L << " me=" << s.me << " K=" << s.K << " tokens";
  for (int64_t t : s.tok_R) n << ' ' << t;
  n << " caps";
  for (int64_t c : s.extra_cap_R) n << ' ' << c;
  return n.str();
}

void check_group(const Group& s, bool over_plan) {
  const int64_t R = int64_t(s.tok_R.size()), E = std::max<int64_t>(R * s.L, 1), K = s.K;
  std::vector<int64_t> tok_off(size_t(R + 1), 0), cap(size_t(R), 0);
  for (int64_t r = 0; r < R; ++r) tok_off[size_t(r + 1)] = tok_off[size_t(r)] + s.tok_R[size_t(r)];
  const int64_t G = tok_off[size_t(R)];
  std::vector<int32_t> idx = routing(G, K, E, s.seed).idx;
  ops::GroupRouting g;
  g.idx_GK = idx.data();
  g.tok_off_R = tok_off.data();
  g.R = R, g.me = s.me, g.L = s.L, g.first = s.me * s.L, g.K = K;
  g.G = s.host_G < 0 ? tok_off[size_t(R)] : s.host_G;
  for (int64_t r = 0; r < R; ++r) {  // the capacities: the largest chunk of rank r + extra
    if (s.extra_cap_R[size_t(r)] < 0) continue;
    int64_t most = 0;
    for (int64_t l = 0; l < s.L; ++l) {
      int64_t c = 0;
      for (int64_t i = tok_off[size_t(r)] * K; i < tok_off[size_t(r + 1)] * K; ++i)
        c += idx[size_t(i)] == g.first + l;
      most = std::max(most, c);
    }
    cap[size_t(r)] = std::max<int64_t>(most + s.extra_cap_R[size_t(r)], 1);
  }
  g.cap_R = cap.data();
  // The reference at a generous plan, for N; then the plan under test.
  const int64_t big = G * K + R * s.L * (G + 8);
  std::vector<int64_t> rows_want(size_t(s.L)), pads_want{-7};
  std::vector<int32_t> tok_want(size_t(big), -7), slot_want(size_t(big), -7),
      grows_want(size_t(G * K), -7);
  g.max_rows = big;
  const int64_t N = ops::build_group_permutation_ref(
      rows_want.data(), tok_want.data(), slot_want.data(), grows_want.data(), pads_want.data(), g);
  g.max_rows = over_plan ? N - 1 : N;
  SCOPED_TRACE(name(s) + " N=" + std::to_string(N) + " max_rows=" + std::to_string(g.max_rows));
  if (g.max_rows < 0) return;
  tok_want.resize(size_t(g.max_rows));
  slot_want.resize(size_t(g.max_rows));
  if (over_plan) {  // only rows_L
    std::fill(tok_want.begin(), tok_want.end(), -7);
    std::fill(slot_want.begin(), slot_want.end(), -7);
    std::fill(grows_want.begin(), grows_want.end(), -7);
    pads_want = {-7};
  }
  Guarded<int64_t> rows(s.L), chunk(s.L * R), pads(1);
  Guarded<int32_t> tok(g.max_rows), slot(g.max_rows), grows(G * K);
  int64_t got = -1;
  EXPECT_EQ(order_dependence([&] {
              rows = Guarded<int64_t>(s.L, -7);
              chunk = Guarded<int64_t>(s.L * R, -7);
              pads = Guarded<int64_t>(1, -7);
              tok = Guarded<int32_t>(g.max_rows, -7);
              slot = Guarded<int32_t>(g.max_rows, -7);
              grows = Guarded<int32_t>(G * K, -7);
              got =
                  ops::cuda::build_group_permutation(nullptr, rows.data(), tok.data(), slot.data(),
                                                     grows.data(), chunk.data(), pads.data(), g);
              std::vector<unsigned char> out = bytes_of(&got, 1);
              append(out, rows);
              append(out, pads);
              append(out, tok);
              append(out, slot);
              append(out, grows);
              return out;
            }),
            "");
  EXPECT_EQ(got, N);
  EXPECT_TRUE(chunk.intact()) << "chunk_LR (workspace) written outside its elements";
  expect_bitwise(rows, rows_want, "rows_L");
  expect_bitwise(pads, pads_want, "pads");
  expect_bitwise(tok, tok_want, "row_token_N");
  expect_bitwise(slot, slot_want, "row_slot_N");
  expect_bitwise(grows, grows_want, "group_rows_GK");
}

// One rank; ranks without tokens; more slots than a block; no local experts; mixed caps; more
// slots than a tile (several tiles: their counters in group_rows' memory), tiles wider than 512
// for many local experts; grids smaller than the slots (a host G below the true one).
TEST(EmuKernelsPermute, BuildGroupPermutationMatchesTheReference) {
  const std::vector<Group> all = {
      {{0}, 2, 0, 2, {-1}, 11},
      {{1}, 1, 0, 1, {-1}, 12},
      {{5, 0, 7}, 2, 1, 2, {-1, -1, -1}, 13},
      {{37, 300, 0, 9}, 3, 2, 3, {-1, -1, -1, -1}, 14},
      {{37, 300, 0, 9}, 3, 3, 2, {0, 0, 0, 0}, 15},
      {{200, 61}, 5, 0, 4, {3, 300}, 16},
      {{13, 4, 21}, 2, 1, 2, {-1, 2, 0}, 17},
      {{6, 6}, 0, 1, 2, {-1, -1}, 18},
      {{700, 500}, 40, 1, 2, {-1, 5}, 19},         // 5 tiles of 512 slots, a padded rank
      {{600, 400}, 300, 0, 2, {-1, -1}, 20},       // tiles of 2 L = 608 slots
      {{37, 300, 0, 9}, 3, 2, 3, {-1, 1, -1, 0}, 21, 1},  // G given as 1: one block a launch
  };
  for (const Group& s : all) {
    check_group(s, /*over_plan=*/false);
    check_group(s, /*over_plan=*/true);
  }
}

// A rank's chunk over its capacity: the CPU path's error, after the read-back.
TEST(EmuKernelsPermute, BuildGroupPermutationOverCapacityIsAnError) {
  const std::vector<int32_t> idx = {0, 1, 1, 1, 0, 1};  // rank 0: 1 token, rank 1: 2 (K = 2)
  const std::vector<int64_t> tok_off = {0, 1, 3}, cap = {0, 2};
  ops::GroupRouting g;
  g.idx_GK = idx.data();
  g.tok_off_R = tok_off.data();
  g.cap_R = cap.data();
  g.R = 2, g.me = 0, g.L = 2, g.first = 0, g.K = 2, g.max_rows = 100;
  std::vector<int64_t> rows(2), chunk(4), pads(1);
  std::vector<int32_t> tok(100), slot(100), grows(6);
  try {
    ops::cuda::build_group_permutation(nullptr, rows.data(), tok.data(), slot.data(), grows.data(),
                                       chunk.data(), pads.data(), g);
    FAIL() << "3 rows of expert 1 from rank 1 over its capacity 2 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 1 has 3 rows from EP rank 1 > capacity 2"),
              std::string::npos)
        << e.what();
  }
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
  ops::GroupRouting g;
  g.R = 0;
  try {
    ops::cuda::build_group_permutation(nullptr, &n, &i, &i, &i, &c, &n, g);
    FAIL() << "R=0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("R=0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore
