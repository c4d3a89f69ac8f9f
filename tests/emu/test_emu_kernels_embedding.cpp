// The embedding kernels (src/ops/cuda/embedding.cu) in the grid emulator against their `_ref`
// oracles, bitwise (the lookups are exact; the backward adds each row's tokens in token order, as
// the reference does): repeated ids, vocabularies smaller and larger than the backward's row
// ranges, NaN-poisoned guarded outputs, dw accumulated onto nonzero values, in every resume
// order. An id outside [0, V) gives a NaN row forward and is skipped backward (embedding.h).
// The vocab-parallel slices (the _shard ops) the same way, with ids on every row range of the
// slice, repeated, and ids of other slices (zeros forward, no gradient).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "core/dtype.h"
#include "emu/emu_testing.h"
#include "ops/embedding.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

// n ids in [0, V), with repeats (a few hot ids, as real text has).
std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> any(0, V - 1), hot(0, std::min<int64_t>(V, 3) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = int32_t(gen() % 2 ? hot(gen) : any(gen));
  return ids;
}

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(T) * size_t(n)) == 0;
}

// (tokens, hidden, vocabulary): no tokens; one of each; odd hidden sizes below and above a warp
// and the backward's 128-column blocks; a vocabulary of one row (every token the same id); more
// tokens than rows; a vocabulary larger than the backward's row ranges.
const std::vector<std::tuple<int64_t, int64_t, int64_t>> kShapes = {
    {0, 5, 3},   {1, 1, 1},    {7, 33, 5},     {40, 100, 13},
    {300, 7, 1}, {64, 129, 3}, {9, 260, 2000}, {33, 3, 5000}};

template <typename T>
void check_forward(int64_t n_tok, int64_t H, int64_t V) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) +
               " vocabulary=" + std::to_string(V));
  const std::vector<T> w = random_vec<T>(V * H, 51);
  const std::vector<int32_t> ids = random_ids(n_tok, V, 52);
  std::vector<T> want(static_cast<size_t>(n_tok * H));
  ops::embedding_forward_ref(want.data(), ids.data(), w.data(), n_tok, H, V);
  Guarded<T> y(n_tok * H, T(NAN));
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n_tok * H, T(NAN));
    ops::cuda::embedding_forward(nullptr, y1.data(), ids.data(), w.data(), n_tok, H, V);
    y = y1;
    return bytes_of(y1.data(), size_t(n_tok * H));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(same_bits(y.data(), want.data(), n_tok * H)) << "y differs from the reference";
}

void check_forward_bf16(int64_t n_tok, int64_t H, int64_t V) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) +
               " vocabulary=" + std::to_string(V));
  std::vector<bf16> w(static_cast<size_t>(V * H));
  const std::vector<float> wf = random_vec<float>(V * H, 53, -4.0, 4.0);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(wf[i]);
  const std::vector<int32_t> ids = random_ids(n_tok, V, 54);
  std::vector<float> want(static_cast<size_t>(n_tok * H));
  ops::embedding_forward_bf16_ref(want.data(), ids.data(), w.data(), n_tok, H, V);
  Guarded<float> y(n_tok * H, NAN);
  const std::string diff = order_dependence([&] {
    Guarded<float> y1(n_tok * H, NAN);
    ops::cuda::embedding_forward_bf16(nullptr, y1.data(), ids.data(), w.data(), n_tok, H, V);
    y = y1;
    return bytes_of(y1.data(), size_t(n_tok * H));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(same_bits(y.data(), want.data(), n_tok * H)) << "y differs from the reference";
}

template <typename T>
void check_backward(int64_t n_tok, int64_t H, int64_t V) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) +
               " vocabulary=" + std::to_string(V));
  const std::vector<T> dy = random_vec<T>(n_tok * H, 55);
  const std::vector<T> dw0 = random_vec<T>(V * H, 56);  // dw accumulates onto these
  const std::vector<int32_t> ids = random_ids(n_tok, V, 57);
  std::vector<T> want = dw0;
  ops::embedding_backward_ref(want.data(), dy.data(), ids.data(), n_tok, H, V);
  Guarded<T> dw(V * H);
  const std::string diff = order_dependence([&] {
    Guarded<T> dw1(V * H);
    for (int64_t i = 0; i < V * H; ++i) dw1[i] = dw0[size_t(i)];
    ops::cuda::embedding_backward(nullptr, dw1.data(), dy.data(), ids.data(), n_tok, H, V);
    dw = dw1;
    return bytes_of(dw1.data(), size_t(V * H));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(dw.intact()) << "dw written outside its elements";
  EXPECT_TRUE(same_bits(dw.data(), want.data(), V * H)) << "dw differs from the reference";
}

// A TP rank's slice, rows [v0, v0 + rows) of V.
struct Slice {
  int64_t H, v0, rows, V, step;
};

// Ids for a slice: every step-th row of the slice (so every row range of the backward when its
// ranges hold >= step rows), a few of them again (hot ids), the rows just outside the slice and
// others of the vocabulary, shuffled.
std::vector<int32_t> slice_ids(const Slice& s, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < s.rows; r += s.step) ids.push_back(int32_t(s.v0 + r));
  if (s.rows > 0) {
    ids.push_back(int32_t(s.v0 + s.rows - 1));
    const int64_t hot = std::min<int64_t>(s.rows, 3);
    for (int64_t k = 0; k < 8; ++k) ids.push_back(int32_t(s.v0 + int64_t(gen() % uint64_t(hot))));
  }
  if (s.v0 > 0 && s.v0 - 1 < s.V) ids.push_back(int32_t(s.v0 - 1));
  if (s.v0 + s.rows < s.V) ids.push_back(int32_t(s.v0 + s.rows));
  for (int64_t k = 0; k < 8; ++k) ids.push_back(int32_t(gen() % uint64_t(s.V)));
  std::shuffle(ids.begin(), ids.end(), gen);
  return ids;
}

// The whole vocabulary; slices at the start, middle and end; one row; hidden sizes below a warp
// and past the backward's 128-column blocks; a slice of many rows per backward range (600 columns:
// 5 column blocks, 204 ranges of 3 rows); empty slices (a TP rank of padding only: its share starts
// at or past the vocabulary's end), which give zeros and no gradient.
const std::vector<Slice> kSlices = {{1, 0, 1, 1, 1},        {5, 0, 3, 8, 1},   {33, 4, 4, 12, 1},
                                    {129, 10, 7, 17, 1},    {3, 6, 1, 13, 1},  {40, 0, 50, 50, 1},
                                    {600, 77, 450, 600, 2}, {5, 12, 0, 12, 1}, {130, 16, 0, 13, 1}};

template <typename T>
void check_shard(const Slice& s, uint32_t seed) {
  const std::vector<int32_t> ids = slice_ids(s, seed);
  const int64_t n_tok = int64_t(ids.size()), H = s.H;
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) + " rows [" +
               std::to_string(s.v0) + ", " + std::to_string(s.v0 + s.rows) + ") of " +
               std::to_string(s.V));
  const std::vector<T> w = random_vec<T>(s.rows * H, seed + 1);
  const std::vector<T> dy = random_vec<T>(n_tok * H, seed + 2);
  const std::vector<T> dw0 = random_vec<T>(s.rows * H, seed + 3);  // dw accumulates onto these
  std::vector<T> y_want(size_t(n_tok * H)), dw_want = dw0;
  ops::embedding_forward_shard_ref(y_want.data(), ids.data(), w.data(), n_tok, H, s.v0, s.rows,
                                   s.V);
  ops::embedding_backward_shard_ref(dw_want.data(), dy.data(), ids.data(), n_tok, H, s.v0, s.rows,
                                    s.V);
  Guarded<T> y(n_tok * H), dw(s.rows * H);
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n_tok * H, T(NAN)), dw1 = emu_test::guarded(dw0);
    ops::cuda::embedding_forward_shard(nullptr, y1.data(), ids.data(), w.data(), n_tok, H, s.v0,
                                       s.rows, s.V);
    ops::cuda::embedding_backward_shard(nullptr, dw1.data(), dy.data(), ids.data(), n_tok, H, s.v0,
                                        s.rows, s.V);
    y = y1;
    dw = dw1;
    std::vector<unsigned char> out;
    emu_test::append(out, y1);
    emu_test::append(out, dw1);
    return out;
  });
  EXPECT_EQ(diff, "");
  emu_test::expect_bitwise(y, y_want, "y");
  emu_test::expect_bitwise(dw, dw_want, "dw (accumulated)");
}

TEST(EmuKernelsEmbedding, ShardMatchesTheReferenceBitwiseInEveryOrder) {
  uint32_t seed = 60;
  for (const Slice& s : kSlices) {
    check_shard<float>(s, seed);
    check_shard<double>(s, seed + 10);
    seed += 20;
  }
}

// No tokens: nothing written, no launch.
TEST(EmuKernelsEmbedding, ShardWithNoTokensWritesNothing) {
  Guarded<float> y(0), dw(6, 2.0f);
  const std::vector<float> w(6, 1.0f);
  ops::cuda::embedding_forward_shard<float>(nullptr, y.data(), nullptr, w.data(), 0, 3, 1, 2, 4);
  ops::cuda::embedding_backward_shard<float>(nullptr, dw.data(), nullptr, nullptr, 0, 3, 1, 2, 4);
  EXPECT_TRUE(y.intact() && dw.intact());
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(dw[i], 2.0f);
}

TEST(EmuKernelsEmbedding, ForwardMatchesTheReferenceBitwiseInEveryOrder) {
  for (auto [n_tok, H, V] : kShapes) {
    check_forward<float>(n_tok, H, V);
    check_forward<double>(n_tok, H, V);
  }
}

TEST(EmuKernelsEmbedding, ForwardBf16MatchesTheReferenceBitwiseInEveryOrder) {
  for (auto [n_tok, H, V] : kShapes) check_forward_bf16(n_tok, H, V);
}

TEST(EmuKernelsEmbedding, BackwardMatchesTheReferenceBitwiseInEveryOrder) {
  for (auto [n_tok, H, V] : kShapes) {
    check_backward<float>(n_tok, H, V);
    check_backward<double>(n_tok, H, V);
  }
}

// An id outside [0, V) (the CPU throws; a kernel cannot): the forward's row of that token is NaN
// and the others exact, the backward leaves the table untouched for it; nothing outside the
// buffers is read or written.
TEST(EmuKernelsEmbedding, OutOfRangeIdsGiveNanRowsAndNoGradient) {
  const int64_t H = 5, V = 4, n_tok = 4;
  const std::vector<float> w = random_vec<float>(V * H, 58);
  const std::vector<int32_t> ids = {2, -1, 4, 0};
  Guarded<float> y(n_tok * H, 7.0f);
  ops::cuda::embedding_forward(nullptr, y.data(), ids.data(), w.data(), n_tok, H, V);
  EXPECT_TRUE(y.intact());
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(y[0 * H + h], w[size_t(2 * H + h)]);
    EXPECT_TRUE(std::isnan(y[1 * H + h])) << "id -1, column " << h;
    EXPECT_TRUE(std::isnan(y[2 * H + h])) << "id V, column " << h;
    EXPECT_EQ(y[3 * H + h], w[size_t(h)]);
  }
  const std::vector<float> dy = random_vec<float>(n_tok * H, 59);
  Guarded<float> dw(V * H);
  ops::cuda::embedding_backward(nullptr, dw.data(), dy.data(), ids.data(), n_tok, H, V);
  EXPECT_TRUE(dw.intact());
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(dw[0 * H + h], dy[size_t(3 * H + h)]);
    EXPECT_EQ(dw[2 * H + h], dy[size_t(0 * H + h)]);
    EXPECT_EQ(dw[1 * H + h], 0.0f);
    EXPECT_EQ(dw[3 * H + h], 0.0f);
  }
}

// The backward's last row range may reach past the table (1501 rows in ranges of 2): an id of
// V or past it falling in that range is still skipped, for the whole table and for a slice.
TEST(EmuKernelsEmbedding, IdsPastTheTableInTheLastRangeAreSkipped) {
  const int64_t H = 1, V = 1501;
  const std::vector<int32_t> ids = {int32_t(V), 7, int32_t(V + 1)};
  const std::vector<float> dy = {1.0f, 2.0f, 3.0f};
  Guarded<float> dw(V * H);
  ops::cuda::embedding_backward(nullptr, dw.data(), dy.data(), ids.data(), 3, H, V);
  EXPECT_TRUE(dw.intact()) << "dw written outside the table";
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dw[v], v == 7 ? 2.0f : 0.0f) << "row " << v;
  // The slice [2, 1503) of 1600 rows: ids 1503 and 1504 lie past it, in the vocabulary.
  const std::vector<int32_t> shard_ids = {1503, 9, 1504};
  Guarded<float> dws(V * H);
  ops::cuda::embedding_backward_shard(nullptr, dws.data(), dy.data(), shard_ids.data(), 3, H, 2, V,
                                      1600);
  EXPECT_TRUE(dws.intact()) << "dw written outside the slice";
  for (int64_t r = 0; r < V; ++r) EXPECT_EQ(dws[r], r == 7 ? 2.0f : 0.0f) << "row " << r;
  // Forward: ids of other slices give zeros, ids outside [0, V) NaN.
  const std::vector<int32_t> fw_ids = {0, 3, 1599, 1600, -1};
  const std::vector<float> w = random_vec<float>(V * H, 61);
  Guarded<float> y(5);
  ops::cuda::embedding_forward_shard(nullptr, y.data(), fw_ids.data(), w.data(), 5, H, 2, V, 1600);
  EXPECT_TRUE(y.intact());
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], w[1]);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_TRUE(std::isnan(y[3]) && std::isnan(y[4]));
}

TEST(EmuKernelsEmbedding, BadArgumentsAreErrors) {
  float v = 0;
  const int32_t id = 0;
  EXPECT_THROW(ops::cuda::embedding_forward<float>(nullptr, &v, &id, &v, 1, 0, 1), Error);
  EXPECT_THROW(ops::cuda::embedding_forward<float>(nullptr, &v, &id, &v, -1, 1, 1), Error);
  EXPECT_THROW(ops::cuda::embedding_backward<float>(nullptr, &v, &v, &id, 1, 1, 0), Error);
  // Slices: v0 < 0, rows < 0, past V (an empty slice, rows = 0, is a TP rank of padding only).
  EXPECT_THROW(ops::cuda::embedding_forward_shard<float>(nullptr, &v, &id, &v, 1, 1, -1, 1, 2),
               Error);
  EXPECT_THROW(ops::cuda::embedding_forward_shard<float>(nullptr, &v, &id, &v, 1, 1, 0, -1, 2),
               Error);
  EXPECT_THROW(ops::cuda::embedding_backward_shard<float>(nullptr, &v, &v, &id, 1, 1, 1, 2, 2),
               Error);
  EXPECT_THROW(ops::cuda::embedding_backward_shard<float>(nullptr, &v, &v, &id, 1, 0, 0, 1, 2),
               Error);
}

}  // namespace
}  // namespace moecore
