// The fused head loss on CUDA (src/ops/cuda/head_loss.cu: its row kernels in the grid emulator,
// its GEMMs through the emulated library calls) against head_loss_forward_ref /
// head_loss_backward_ref within the dtype's tolerance: no tokens, one token, V = 1, V past the
// row block (256), chunks of 1, not dividing n_tok and larger than it, ignored targets, dw
// accumulated onto nonzero values, NaN-filled guarded outputs, bitwise the same in every resume
// order; the loss sum does not depend on the chunk size (bitwise).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/cross_entropy.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

const Exec kCuda{Device::CUDA, nullptr};

// head_loss_workspace_elems (defined with the CPU fast path, which this binary may lack).
int64_t workspace_elems(const ops::HeadLossShape& s) {
  return std::max<int64_t>(0, std::min(s.chunk, s.n_tok)) * s.V;
}

template <typename T>
Guarded<T> nan_filled(int64_t n) {
  return Guarded<T>(n, std::numeric_limits<T>::quiet_NaN());
}

template <typename T>
void expect_near_all(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_TRUE(got.intact()) << what << " written outside its elements";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[int64_t(i)], want[i], kAtol<T> + kRtol<T> * std::abs(want[i]))
        << what << " element " << i;
  }
}

struct Outputs {
  double sum = 0;
  std::vector<unsigned char> bytes;
};

template <typename T>
void check_head_loss(const ops::HeadLossShape& s, uint32_t seed) {
  SCOPED_TRACE("n_tok=" + std::to_string(s.n_tok) + " H=" + std::to_string(s.H) +
               " V=" + std::to_string(s.V) + " chunk=" + std::to_string(s.chunk));
  const std::vector<T> h = random_vec<T>(s.n_tok * s.H, seed),
                       w = random_vec<T>(s.V * s.H, seed + 1),
                       dw0 = random_vec<T>(s.V * s.H, seed + 2);
  std::vector<int32_t> tg(size_t(s.n_tok));
  for (int64_t t = 0; t < s.n_tok; ++t)
    tg[size_t(t)] = t % 4 == 2 ? -1 : int32_t((t * 7 + seed) % uint32_t(s.V));
  const T dloss = T(0.375);
  std::vector<T> loss_ref(size_t(s.n_tok)), lse_ref(size_t(s.n_tok)), dh_ref(size_t(s.n_tok * s.H)),
      dw_ref = dw0;
  const double sum_ref =
      ops::head_loss_forward_ref(loss_ref.data(), lse_ref.data(), h.data(), w.data(), tg.data(), s);
  ops::head_loss_backward_ref(dh_ref.data(), dw_ref.data(), h.data(), w.data(), tg.data(),
                              lse_ref.data(), dloss, s);

  Guarded<T> loss(s.n_tok), lse(s.n_tok), dh(s.n_tok * s.H), dw(s.V * s.H);
  double sum = 0;
  const auto run = [&] {
    Guarded<T> loss1 = nan_filled<T>(s.n_tok), lse1 = nan_filled<T>(s.n_tok),
               dh1 = nan_filled<T>(s.n_tok * s.H), dw1(s.V * s.H),
               ws = nan_filled<T>(workspace_elems(s));
    std::copy(dw0.begin(), dw0.end(), dw1.data());
    Guarded<double> sum1(1, std::nan(""));
    ops::cuda::head_loss_forward<T>(kCuda, sum1.data(), loss1.data(), lse1.data(), h.data(),
                                    w.data(), tg.data(), s, ws.data(), nullptr);
    ops::cuda::head_loss_backward<T>(kCuda, dh1.data(), dw1.data(), h.data(), w.data(), tg.data(),
                                     lse1.data(), &dloss, s, ws.data(), nullptr);
    EXPECT_TRUE(sum1.intact() && ws.intact()) << "sum or workspace written out of bounds";
    loss = loss1;
    lse = lse1;
    dh = dh1;
    dw = dw1;
    sum = sum1[0];
    std::vector<unsigned char> out = bytes_of(sum1.data(), 1);
    for (const auto& part :
         {bytes_of(loss1.data(), size_t(s.n_tok)), bytes_of(lse1.data(), size_t(s.n_tok)),
          bytes_of(dh1.data(), size_t(s.n_tok * s.H)), bytes_of(dw1.data(), size_t(s.V * s.H))})
      out.insert(out.end(), part.begin(), part.end());
    return out;
  };
  EXPECT_EQ(order_dependence(run), "");
  EXPECT_NEAR(sum, sum_ref, (kAtol<T> + kRtol<T> * std::abs(sum_ref)) * double(s.n_tok + 1))
      << "loss sum";
  expect_near_all(loss, loss_ref, "loss_T");
  expect_near_all(lse, lse_ref, "lse_T");
  expect_near_all(dh, dh_ref, "dh");
  expect_near_all(dw, dw_ref, "dw (accumulated)");
  for (int64_t t = 0; t < s.n_tok; ++t) {
    if (tg[size_t(t)] < 0) {
      EXPECT_EQ(loss[t], T(0)) << "ignored token " << t;
    }
  }

  // Another chunk size: the same loss sum, bitwise.
  ops::HeadLossShape s2 = s;
  s2.chunk = s.chunk == 1 ? 2 : 1;
  Guarded<T> loss2(s.n_tok), lse2(s.n_tok), ws2(workspace_elems(s2));
  double sum2 = std::nan("");
  ops::cuda::head_loss_forward<T>(kCuda, &sum2, loss2.data(), lse2.data(), h.data(), w.data(),
                                  tg.data(), s2, ws2.data(), nullptr);
  EXPECT_EQ(std::memcmp(&sum, &sum2, sizeof(double)), 0)
      << "the loss sum depends on the chunk: " << sum << " vs " << sum2;
}

TEST(EmuKernelsHeadLoss, MatchTheReferenceInEveryOrder) {
  const std::vector<ops::HeadLossShape> shapes = {
      {0, 3, 5, 2}, {1, 1, 1, 1},   {1, 5, 7, 256},  {7, 5, 33, 3},
      {5, 3, 1, 2}, {6, 4, 300, 4}, {9, 2, 257, 16},
  };
  uint32_t seed = 70;
  for (const ops::HeadLossShape& s : shapes) {
    check_head_loss<float>(s, seed);
    check_head_loss<double>(s, seed + 10);
    seed += 20;
  }
}

TEST(EmuKernelsHeadLoss, BadArgumentsAreErrors) {
  float v = 0;
  double sum = 0;
  const int32_t tg = 0;
  EXPECT_THROW(ops::cuda::head_loss_forward<float>(kCuda, &sum, &v, &v, &v, &v, &tg,
                                                   ops::HeadLossShape{1, 0, 3, 1}, &v, nullptr),
               Error);
  EXPECT_THROW(
      ops::cuda::head_loss_forward<float>(kCuda, &sum, &v, &v, &v, &v, &tg,
                                          ops::HeadLossShape{1, 2, 3, 1}, nullptr, nullptr),
      Error);
  const ops::HeadLossBf16 no_h32{.w_VH_wide = &v};
  EXPECT_THROW(ops::cuda::head_loss_backward<float>(kCuda, &v, &v, &v, &v, &tg, &v, &v,
                                                    ops::HeadLossShape{1, 1, 1, 1}, &v, &no_h32),
               Error);
}

}  // namespace
}  // namespace moecore
