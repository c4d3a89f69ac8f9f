// The layout kernels (src/ops/cuda/qkv_layout.cu, token_layout.cu) in the grid emulator against
// their `_ref`: pure copies and an integer count, so bitwise, with NaN-poisoned (or -1-filled)
// guarded outputs, in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/qkv_layout.h"
#include "ops/token_layout.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void check_qkv(const ops::QkvShape& s) {
  SCOPED_TRACE("tokens=" + std::to_string(s.n_tok) + " Hq=" + std::to_string(s.Hq) +
               " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D));
  const int64_t n_q = s.n_tok * s.Hq * s.D, n_kv = s.n_tok * s.Hkv * s.D, n = n_q + 2 * n_kv;
  const std::vector<T> fused = random_vec<T>(n, 71), gq = random_vec<T>(n_q, 72),
                       gk = random_vec<T>(n_kv, 73), gv = random_vec<T>(n_kv, 74);
  std::vector<T> q_ref(static_cast<size_t>(n_q)), k_ref(static_cast<size_t>(n_kv)),
      v_ref(static_cast<size_t>(n_kv)), f_ref(static_cast<size_t>(n));
  ops::split_qkv_ref(q_ref.data(), k_ref.data(), v_ref.data(), fused.data(), s);
  ops::fuse_qkv_ref(f_ref.data(), gq.data(), gk.data(), gv.data(), s);
  const std::string diff = order_dependence([&] {
    Guarded<T> q(n_q, T(NAN)), k(n_kv, T(NAN)), v(n_kv, T(NAN)), f(n, T(NAN));
    ops::cuda::split_qkv<T>(nullptr, q.data(), k.data(), v.data(), fused.data(), s);
    ops::cuda::fuse_qkv<T>(nullptr, f.data(), gq.data(), gk.data(), gv.data(), s);
    EXPECT_TRUE(q.intact() && k.intact() && v.intact() && f.intact());
    EXPECT_EQ(bytes_of(q.data(), size_t(n_q)), bytes_of(q_ref.data(), size_t(n_q))) << "q";
    EXPECT_EQ(bytes_of(k.data(), size_t(n_kv)), bytes_of(k_ref.data(), size_t(n_kv))) << "k";
    EXPECT_EQ(bytes_of(v.data(), size_t(n_kv)), bytes_of(v_ref.data(), size_t(n_kv))) << "v";
    EXPECT_EQ(bytes_of(f.data(), size_t(n)), bytes_of(f_ref.data(), size_t(n))) << "fused";
    std::vector<unsigned char> out = bytes_of(q.data(), size_t(n_q));
    const std::vector<unsigned char> b = bytes_of(f.data(), size_t(n));
    out.insert(out.end(), b.begin(), b.end());
    return out;
  });
  EXPECT_EQ(diff, "");
}

// No tokens; MHA, GQA, MQA; D odd; more than one block.
TEST(EmuKernelsLayout, QkvMatchesTheReferenceInEveryOrder) {
  for (const ops::QkvShape& s :
       {ops::QkvShape{0, 4, 2, 8}, ops::QkvShape{1, 1, 1, 1}, ops::QkvShape{7, 4, 2, 5},
        ops::QkvShape{33, 6, 2, 16}, ops::QkvShape{5, 3, 1, 33}, ops::QkvShape{300, 4, 2, 20}}) {
    check_qkv<float>(s);
    check_qkv<double>(s);
  }
}

TEST(EmuKernelsLayout, TokensToSequenceMajorMatchesTheReferenceInEveryOrder) {
  for (auto [B, S] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 5}, {1, 1}, {3, 7}, {2, 33}, {5, 100}, {4, 513}}) {
    SCOPED_TRACE("B=" + std::to_string(B) + " S=" + std::to_string(S));
    const int64_t n = B * S;
    std::vector<int32_t> ids(static_cast<size_t>(n)), tg(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ids[size_t(i)] = int32_t((i * 37) % 1000);
      tg[size_t(i)] = i % 7 == 3 ? -100 : int32_t((i * 11) % 1000);  // some ignored targets
    }
    std::vector<int32_t> ids_ref(static_cast<size_t>(n)), tg_ref(static_cast<size_t>(n));
    int64_t counted_ref = -1;
    ops::tokens_to_sequence_major_ref(ids_ref.data(), tg_ref.data(), &counted_ref, ids.data(),
                                      tg.data(), B, S);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> ids_T(n, -1), tg_T(n, -1);
      Guarded<int64_t> counted(1, -1);
      ops::cuda::tokens_to_sequence_major(nullptr, ids_T.data(), tg_T.data(), counted.data(),
                                          ids.data(), tg.data(), B, S);
      EXPECT_TRUE(ids_T.intact() && tg_T.intact() && counted.intact());
      EXPECT_EQ(ids_T.vec(), ids_ref);
      EXPECT_EQ(tg_T.vec(), tg_ref);
      EXPECT_EQ(counted[0], counted_ref);
      std::vector<unsigned char> out = bytes_of(tg_T.data(), size_t(n));
      const std::vector<unsigned char> c = bytes_of(counted.data(), 1);
      out.insert(out.end(), c.begin(), c.end());
      return out;
    });
    EXPECT_EQ(diff, "");
  }
}

TEST(EmuKernelsLayout, RollTokensMatchesTheReferenceInEveryOrder) {
  for (auto [n, shift] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 2}, {1, 1}, {7, 0}, {33, 3}, {100, 100}, {513, 4}, {1000, 1003}}) {
    SCOPED_TRACE("tokens=" + std::to_string(n) + " shift=" + std::to_string(shift));
    std::vector<int32_t> in(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) in[size_t(i)] = i % 7 == 3 ? -1 : int32_t((i * 11) % 1000);
    for (int32_t fill : {0, -1}) {
      std::vector<int32_t> want(static_cast<size_t>(n));
      int64_t counted_ref = -1;
      ops::roll_tokens_ref(want.data(), &counted_ref, in.data(), n, shift, fill);
      const std::string diff = order_dependence([&] {
        Guarded<int32_t> out(n, -9);
        Guarded<int64_t> counted(1, -1);
        ops::cuda::roll_tokens(nullptr, out.data(), counted.data(), in.data(), n, shift, fill);
        EXPECT_TRUE(out.intact() && counted.intact());
        EXPECT_EQ(out.vec(), want);
        EXPECT_EQ(counted[0], counted_ref);
        std::vector<unsigned char> bytes = bytes_of(out.data(), size_t(n));
        const std::vector<unsigned char> c = bytes_of(counted.data(), 1);
        bytes.insert(bytes.end(), c.begin(), c.end());
        return bytes;
      });
      EXPECT_EQ(diff, "");
      Guarded<int32_t> out(n, -9);  // without the count
      ops::cuda::roll_tokens(nullptr, out.data(), nullptr, in.data(), n, shift, fill);
      EXPECT_EQ(out.vec(), want);
    }
  }
}

TEST(EmuKernelsLayout, SequencePositionsMatchTheReferenceInEveryOrder) {
  for (auto [n, B] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {1, 1}, {7, 3}, {33, 2}, {1000, 4}, {1001, 7}}) {
    SCOPED_TRACE("tokens=" + std::to_string(n) + " B=" + std::to_string(B));
    std::vector<int32_t> want(static_cast<size_t>(n));
    ops::sequence_positions_ref(want.data(), n, B);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> pos(n, -1);
      ops::cuda::sequence_positions(nullptr, pos.data(), n, B);
      EXPECT_TRUE(pos.intact());
      EXPECT_EQ(pos.vec(), want);
      return bytes_of(pos.data(), size_t(n));
    });
    EXPECT_EQ(diff, "");
  }
}

TEST(EmuKernelsLayout, BadArgumentsAreErrors) {
  float v = 0;
  int32_t i = 0;
  int64_t c = 0;
  EXPECT_THROW(ops::cuda::split_qkv<float>(nullptr, &v, &v, &v, &v, ops::QkvShape{1, 3, 2, 4}),
               Error);
  EXPECT_THROW(ops::cuda::fuse_qkv<float>(nullptr, &v, &v, &v, &v, ops::QkvShape{1, 2, 2, 0}),
               Error);
  EXPECT_THROW(ops::cuda::tokens_to_sequence_major(nullptr, &i, &i, &c, &i, &i, -1, 2), Error);
  EXPECT_THROW(ops::cuda::sequence_positions(nullptr, &i, 4, 0), Error);
  EXPECT_THROW(ops::cuda::roll_tokens(nullptr, &i, &c, &i, 4, -1, 0), Error);
}

}  // namespace
}  // namespace moecore
