// The log-sum-exp merge kernel (src/ops/cuda/attention_merge.cu) in the grid emulator against
// attention_merge_ref: partials with lse far apart and a side at -inf (weight 0), lse a strided
// part of a longer row (the rest untouched), bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "emu/emu_testing.h"
#include "ops/attention_merge.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::random_vec;

template <typename T>
void check_merge(ops::AttentionShape s) {
  SCOPED_TRACE("S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) +
               " H=" + std::to_string(s.Hq) + " D=" + std::to_string(s.D) +
               " lse_stride=" + std::to_string(s.lse_ld()));
  const int64_t n_o = s.S * s.B * s.Hq * s.D, n_l = s.B * s.Hq * s.lse_ld();
  const std::vector<T> o1 = random_vec<T>(n_o, 61), o2 = random_vec<T>(n_o, 62);
  std::vector<T> l1 = random_vec<T>(n_l, 63, -20.0, 20.0), l2 = random_vec<T>(n_l, 64, -3.0, 3.0);
  if (n_l > 2) {
    l1[1] = -std::numeric_limits<T>::infinity();
    l2[2] = -std::numeric_limits<T>::infinity();
  }
  std::vector<T> o_ref = o1, l_ref = l1;
  ops::attention_merge_ref<T>(o_ref.data(), l_ref.data(), o2.data(), l2.data(), s);
  std::vector<T> o, l;
  const std::string diff = order_dependence([&] {
    o = o1, l = l1;
    ops::cuda::attention_merge<T>(nullptr, o.data(), l.data(), o2.data(), l2.data(), s);
    std::vector<unsigned char> bytes = bytes_of(o.data(), o.size());
    const std::vector<unsigned char> b = bytes_of(l.data(), l.size());
    bytes.insert(bytes.end(), b.begin(), b.end());
    return bytes;
  });
  EXPECT_EQ(diff, "");
  for (int64_t e = 0; e < n_o; ++e) {
    ASSERT_NEAR(o[e], o_ref[e], kAtol<T> + kRtol<T> * std::abs(o_ref[e])) << "out " << e;
  }
  for (int64_t e = 0; e < n_l; ++e) {
    if (e % s.lse_ld() >= s.S) {
      ASSERT_EQ(l[e], l1[e]) << "lse element " << e << " past S changed";
      continue;
    }
    ASSERT_NEAR(l[e], l_ref[e], kAtol<T> + kRtol<T> * std::abs(l_ref[e])) << "lse " << e;
  }
}

TEST(EmuKernelsAttentionMerge, MatchesTheReferenceInEveryOrder) {
  ops::AttentionShape strided{33, 2, 3, 1, 13};
  strided.lse_stride = 40;
  for (const ops::AttentionShape& s :
       {ops::AttentionShape{0, 2, 2, 1, 8}, ops::AttentionShape{1, 1, 1, 1, 4},
        ops::AttentionShape{70, 1, 4, 1, 32}, strided}) {
    check_merge<float>(s);
    check_merge<double>(s);
  }
}

TEST(EmuKernelsAttentionMerge, OverlappingLseRowsAreAnError) {
  float x = 0;
  ops::AttentionShape s{4, 1, 2, 1, 8};
  s.lse_stride = 3;
  EXPECT_THROW(ops::cuda::attention_merge<float>(nullptr, &x, &x, &x, &x, s), Error);
}

}  // namespace
}  // namespace moecore
