// The MLA layout kernels (src/ops/cuda/mla_layout.cu) in the grid emulator: bitwise the CPU path
// and mla_split_ref / mla_merge_ref (copies, one product, the same sum over the heads), guarded
// outputs, bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/mla_layout.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void check_mla_layout(const ops::MlaLayoutShape& s) {
  SCOPED_TRACE("n=" + std::to_string(s.n_tok) + " heads=" + std::to_string(s.heads) +
               " qk=" + std::to_string(s.qk) + " pe=" + std::to_string(s.pe) +
               " dv=" + std::to_string(s.dv));
  const int64_t r = s.n_tok * s.heads, nD = r * s.Dp();
  const auto q_up = random_vec<T>(r * s.dq(), 1), q_pe = random_vec<T>(r * s.pe, 2),
             kv_up = random_vec<T>(r * s.dkv(), 3), k_pe = random_vec<T>(s.n_tok * s.pe, 4),
             dq = random_vec<T>(nD, 5), dk = random_vec<T>(nD, 6), dv = random_vec<T>(nD, 7);
  const double c = 1.25;
  std::vector<T> q_r(nD), k_r(nD), v_r(nD), dq_up_r(r * s.dq(), T(3)), dq_pe_r(r * s.pe),
      dkv_up_r(r * s.dkv()), dk_pe_r(s.n_tok * s.pe);
  ops::mla_split_ref(q_r.data(), k_r.data(), v_r.data(), q_up.data(), q_pe.data(), kv_up.data(),
                     k_pe.data(), s, c);
  ops::mla_merge_ref(dq_up_r.data(), dq_pe_r.data(), dkv_up_r.data(), dk_pe_r.data(), dq.data(),
                     dk.data(), dv.data(), s, c);
  std::vector<T> all_ref = q_r;
  for (const auto* part : {&k_r, &v_r, &dq_up_r, &dq_pe_r, &dkv_up_r, &dk_pe_r})
    all_ref.insert(all_ref.end(), part->begin(), part->end());
  std::vector<T> all;
  bool intact = true;
  const std::string diff = order_dependence([&] {
    Guarded<T> q(nD, T(NAN)), k(nD, T(NAN)), v(nD, T(NAN)), dq_up(r * s.dq(), T(3)),
        dq_pe(r * s.pe, T(NAN)), dkv_up(r * s.dkv(), T(NAN)), dk_pe(s.n_tok * s.pe, T(NAN));
    ops::cuda::mla_split<T>(nullptr, q.data(), k.data(), v.data(), q_up.data(), q_pe.data(),
                            kv_up.data(), k_pe.data(), s, c);
    ops::cuda::mla_merge<T>(nullptr, dq_up.data(), dq_pe.data(), dkv_up.data(), dk_pe.data(),
                            dq.data(), dk.data(), dv.data(), s, c);
    all.clear();
    for (const Guarded<T>* g : {&q, &k, &v, &dq_up, &dq_pe, &dkv_up, &dk_pe}) {
      all.insert(all.end(), g->data(), g->data() + g->size());
      intact = intact && g->intact();
    }
    return bytes_of(all.data(), all.size());
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(intact) << "written outside the elements";
  EXPECT_EQ(bytes_of(all.data(), all.size()), bytes_of(all_ref.data(), all_ref.size()))
      << "vs the reference";
}

// No tokens; one head; dv below, equal to and above qk + pe; more than one block.
TEST(EmuKernelsMlaLayout, MatchesTheReferenceInEveryOrder) {
  for (const ops::MlaLayoutShape& s :
       {ops::MlaLayoutShape{0, 2, 4, 2, 4}, ops::MlaLayoutShape{1, 1, 3, 2, 4},
        ops::MlaLayoutShape{5, 3, 4, 2, 6}, ops::MlaLayoutShape{7, 2, 6, 4, 3},
        ops::MlaLayoutShape{200, 4, 16, 8, 16}}) {
    check_mla_layout<float>(s);
    check_mla_layout<double>(s);
  }
}

TEST(EmuKernelsMlaLayout, BadShapesAreErrors) {
  float x = 0;
  EXPECT_THROW(ops::cuda::mla_split<float>(nullptr, &x, &x, &x, &x, &x, &x, &x,
                                           ops::MlaLayoutShape{1, 1, 1, 0, 1}, 1.0),
               Error);
  EXPECT_THROW(ops::cuda::mla_merge<float>(nullptr, &x, &x, &x, &x, &x, &x, &x,
                                           ops::MlaLayoutShape{-1, 1, 1, 1, 1}, 1.0),
               Error);
}

}  // namespace
}  // namespace moecore
