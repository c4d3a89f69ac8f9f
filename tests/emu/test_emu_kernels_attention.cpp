// The attention kernels (src/ops/cuda/attention.cu) in the grid emulator against
// attention_forward_ref / attention_backward_ref, within the dtype's tolerance (docs/numerics.md:
// the online softmax and the tiles' sums associate differently), with NaN-poisoned guarded
// outputs, bitwise the same in every resume order (no races: every output has one writer), with
// and without the fused dropout (a wrong keep bit moves an output far outside the tolerance).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "core/rng.h"
#include "emu/emu_testing.h"
#include "ops/attention.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_near_all(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[int64_t(i)], want[i], kAtol<T> + kRtol<T> * std::abs(want[i]))
        << what << " element " << i;
  }
}

template <typename T>
void append(std::vector<unsigned char>& out, const Guarded<T>& g, int64_t n) {
  const std::vector<unsigned char> b = bytes_of(g.data(), size_t(n));
  out.insert(out.end(), b.begin(), b.end());
}

template <typename T>
void check_attention(const ops::AttentionShape& s, const ops::AttentionDropout* drop) {
  SCOPED_TRACE("S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) +
               " Hq=" + std::to_string(s.Hq) + " Hkv=" + std::to_string(s.Hkv) +
               " D=" + std::to_string(s.D) + " Sk=" + std::to_string(s.keys()) +
               " q_offset=" + std::to_string(s.q_offset) + " k_offset=" +
               std::to_string(s.k_offset) + " lse_stride=" + std::to_string(s.lse_ld()) +
               " p=" + std::to_string(drop ? drop->p : 0.0));
  const int64_t n_q = s.S * s.B * s.Hq * s.D, n_kv = s.keys() * s.B * s.Hkv * s.D,
                n_lse = s.B * s.Hq * s.lse_ld();
  const std::vector<T> q = random_vec<T>(n_q, 51, -2.0, 2.0),
                       k = random_vec<T>(n_kv, 52, -2.0, 2.0);
  const std::vector<T> v = random_vec<T>(n_kv, 53), dout = random_vec<T>(n_q, 54);
  // lse past the first S of each row is never written: NaN in both, compared as equal below.
  std::vector<T> out_ref(static_cast<size_t>(n_q)), lse_ref(static_cast<size_t>(n_lse), T(NAN)),
      dq_ref(static_cast<size_t>(n_q)), dk_ref(static_cast<size_t>(n_kv)),
      dv_ref(static_cast<size_t>(n_kv));
  ops::attention_forward_ref(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), s, drop);
  ops::attention_backward_ref(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(),
                              k.data(), v.data(), out_ref.data(), lse_ref.data(), s, drop);
  Guarded<T> out(n_q), lse(n_lse), dq(n_q), dk(n_kv), dv(n_kv);
  const std::string diff = order_dependence([&] {
    Guarded<T> out1(n_q, T(NAN)), lse1(n_lse, T(NAN)), dq1(n_q, T(NAN)), dk1(n_kv, T(NAN)),
        dv1(n_kv, T(NAN));
    ops::cuda::attention_forward<T>(nullptr, out1.data(), lse1.data(), q.data(), k.data(), v.data(),
                                    s, drop);
    // The backward gets the reference forward's out and lse: it is judged on its own.
    ops::cuda::attention_backward<T>(nullptr, dq1.data(), dk1.data(), dv1.data(), dout.data(),
                                     q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(),
                                     s, drop);
    out = out1, lse = lse1, dq = dq1, dk = dk1, dv = dv1;
    std::vector<unsigned char> bytes;
    append(bytes, out1, n_q);
    append(bytes, lse1, n_lse);
    append(bytes, dq1, n_q);
    append(bytes, dk1, n_kv);
    append(bytes, dv1, n_kv);
    return bytes;
  });
  EXPECT_EQ(diff, "");
  expect_near_all(out, out_ref, "out");
  EXPECT_TRUE(lse.intact()) << "lse written outside its elements";
  for (int64_t e = 0; e < n_lse; ++e) {
    if (e % s.lse_ld() >= s.S) {
      ASSERT_TRUE(std::isnan(lse[e])) << "lse element " << e << " past S written";
      continue;
    }
    ASSERT_NEAR(lse[e], lse_ref[size_t(e)], kAtol<T> + kRtol<T> * std::abs(lse_ref[size_t(e)]))
        << "lse element " << e;
  }
  expect_near_all(dq, dq_ref, "dq");
  expect_near_all(dk, dk_ref, "dk");
  expect_near_all(dv, dv_ref, "dv");
}

// No tokens, one token, sequences shorter than a tile, not a multiple of it and of 32, several
// query and key tiles (70); MHA, GQA 4/2 and MQA; D of 8 to 32, odd D; D = 128, whose shared
// memory needs the smaller tiles (8 and, for the f64 backward, 4).
const ops::AttentionShape kShapes[] = {
    {0, 2, 4, 2, 8},  {1, 1, 4, 2, 8},   {7, 2, 4, 2, 8},   {17, 1, 2, 2, 16},
    {33, 2, 4, 2, 8}, {70, 1, 4, 2, 32}, {41, 1, 3, 1, 13}, {19, 1, 2, 1, 128},
};

TEST(EmuKernelsAttention, MatchesTheReferenceInEveryOrder) {
  for (const ops::AttentionShape& s : kShapes) {
    check_attention<float>(s, nullptr);
    check_attention<double>(s, nullptr);
  }
}

// The keep bits drawn from the counters in (emulated) device memory, heads offset as on a
// tensor-parallel rank: the reference's exact mask.
TEST(EmuKernelsAttention, DropoutMatchesTheReferenceInEveryOrder) {
  const ops::DropoutCounters counters{41, 12};
  const ops::AttentionDropout drop{0.3, rng_key(7, "attention_dropout"), &counters, 2};
  for (const ops::AttentionShape& s :
       {ops::AttentionShape{1, 1, 4, 2, 8}, ops::AttentionShape{33, 2, 4, 2, 8},
        ops::AttentionShape{70, 1, 4, 2, 16}}) {
    check_attention<float>(s, &drop);
    check_attention<double>(s, &drop);
  }
}

// The block form (ops/attention.h): keys at an offset (a full block: every key precedes every
// query; a diagonal one at a non-zero offset; a prefix longer than the queries; fewer keys than
// some rows would see), lse a strided part of a longer row, dropout at the global positions.
// The reference's backward of a block given the block's own out and lse is the block's own
// gradient, which the kernels must give from that out and lse.
ops::AttentionShape block(ops::AttentionShape s, int64_t Sk, int64_t q_offset, int64_t k_offset,
                          int64_t lse_stride) {
  s.Sk = Sk, s.q_offset = q_offset, s.k_offset = k_offset, s.lse_stride = lse_stride;
  return s;
}
const ops::AttentionShape kBlocks[] = {
    block({5, 2, 4, 2, 8}, 5, 10, 5, 10),      // full: keys 5..9 before queries 10..14
    block({17, 1, 2, 1, 16}, 17, 17, 17, 34),  // diagonal at 17, lse rows of 34
    block({9, 1, 4, 2, 8}, 27, 18, 0, 18),     // a prefix of 27 keys, queries 18..26
    block({20, 2, 3, 1, 13}, 7, 3, 0, 0),      // rows 4.. see all 7 keys, rows 0..3 fewer
};

TEST(EmuKernelsAttention, BlocksMatchTheReferenceInEveryOrder) {
  const ops::DropoutCounters counters{41, 12};
  const ops::AttentionDropout drop{0.3, rng_key(7, "attention_dropout"), &counters, 2};
  for (const ops::AttentionShape& s : kBlocks) {
    for (const ops::AttentionDropout* d : {static_cast<const ops::AttentionDropout*>(nullptr),
                                           &drop}) {
      check_attention<float>(s, d);
      check_attention<double>(s, d);
    }
  }
}

TEST(EmuKernelsAttention, BadArgumentsAreErrors) {
  float x = 0;
  const ops::AttentionShape not_grouped{4, 1, 3, 2, 8}, too_wide{4, 1, 2, 2, 4096};
  EXPECT_THROW(
      ops::cuda::attention_forward<float>(nullptr, &x, &x, &x, &x, &x, not_grouped, nullptr),
      Error);
  EXPECT_THROW(ops::cuda::attention_forward<float>(nullptr, &x, &x, &x, &x, &x, too_wide, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::attention_backward<float>(nullptr, &x, &x, &x, &x, &x, &x, &x, &x, &x,
                                                    too_wide, nullptr),
               Error);
  const ops::AttentionDropout no_counters{0.1, 1, nullptr, 0};
  EXPECT_THROW(ops::cuda::attention_forward<float>(
                   nullptr, &x, &x, &x, &x, &x, ops::AttentionShape{4, 1, 2, 2, 8}, &no_counters),
               Error);
  // A block whose queries all precede its keys: refused, not computed as empty rows.
  EXPECT_THROW(ops::cuda::attention_forward<float>(nullptr, &x, &x, &x, &x, &x,
                                                   block({4, 1, 2, 2, 8}, 4, 0, 4, 0), nullptr),
               Error);
}

}  // namespace
}  // namespace moecore
