// The sigmoid gate kernels (src/ops/cuda/sigmoid_gate.cu) in the grid emulator against their
// references within the dtype's tolerance (docs/numerics.md: the device's exp, the backward's dot
// in a block tree): the forward accumulating onto random values, the backward's ds and dl
// NaN-poisoned and guarded, and in place (ds aliasing dy); bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/sigmoid_gate.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_close(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (int64_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[size_t(i)], kAtol<T> + kRtol<T> * std::abs(want[size_t(i)]))
        << what << " element " << i;
  }
}

template <typename T>
void check_sigmoid_gate(int64_t N, int64_t H) {
  SCOPED_TRACE("rows=" + std::to_string(N) + " hidden=" + std::to_string(H));
  const auto s = random_vec<T>(N * H, 81, -2, 2);
  const auto l = random_vec<T>(N, 82, -4, 4);
  const auto y0 = random_vec<T>(N * H, 83);
  const auto dy = random_vec<T>(N * H, 84);
  std::vector<T> y_ref = y0, ds_ref(static_cast<size_t>(N * H)), dl_ref(static_cast<size_t>(N));
  ops::sigmoid_gate_forward_ref(y_ref.data(), s.data(), l.data(), N, H);
  ops::sigmoid_gate_backward_ref(ds_ref.data(), dl_ref.data(), dy.data(), s.data(), l.data(), N, H);

  Guarded<T> y(N * H);
  EXPECT_EQ(order_dependence([&] {
              Guarded<T> y1(N * H);
              for (int64_t i = 0; i < N * H; ++i) y1[i] = y0[size_t(i)];
              ops::cuda::sigmoid_gate_forward(nullptr, y1.data(), s.data(), l.data(), N, H);
              y = y1;
              return bytes_of(y1.data(), size_t(N * H));
            }),
            "")
      << "forward";
  expect_close(y, y_ref, "y");

  Guarded<T> ds(N * H, T(NAN)), dl(N, T(NAN));
  EXPECT_EQ(order_dependence([&] {
              Guarded<T> ds1(N * H, T(NAN)), dl1(N, T(NAN));
              ops::cuda::sigmoid_gate_backward(nullptr, ds1.data(), dl1.data(), dy.data(), s.data(),
                                               l.data(), N, H);
              ds = ds1;
              dl = dl1;
              std::vector<unsigned char> out = bytes_of(ds1.data(), size_t(N * H));
              const auto d = bytes_of(dl1.data(), size_t(N));
              out.insert(out.end(), d.begin(), d.end());
              return out;
            }),
            "")
      << "backward";
  expect_close(ds, ds_ref, "ds");
  expect_close(dl, dl_ref, "dl");

  // In place: ds written over dy gives the same bits as into its own buffer.
  Guarded<T> inplace(N * H), dl2(N, T(NAN));
  for (int64_t i = 0; i < N * H; ++i) inplace[i] = dy[size_t(i)];
  ops::cuda::sigmoid_gate_backward(nullptr, inplace.data(), dl2.data(),
                                   static_cast<const T*>(inplace.data()), s.data(), l.data(), N, H);
  EXPECT_EQ(bytes_of(inplace.data(), size_t(N * H)), bytes_of(ds.data(), size_t(N * H)));
  EXPECT_EQ(bytes_of(dl2.data(), size_t(N)), bytes_of(dl.data(), size_t(N)));
}

// One row and element; rows shorter than a warp; hidden not a multiple of the warp or the block;
// many elements per thread; many rows; no hidden (dl is an empty dot: 0); no rows.
TEST(EmuKernelsSigmoidGate, MatchesTheReferenceInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {3, 31}, {7, 33}, {5, 100}, {4, 257}, {2, 1000}, {40, 5}, {3, 0}, {0, 4}};
  for (auto [N, H] : shapes) {
    check_sigmoid_gate<float>(N, H);
    check_sigmoid_gate<double>(N, H);
  }
}

TEST(EmuKernelsSigmoidGate, BadArgumentsAreErrors) {
  float v = 0;
  EXPECT_THROW(ops::cuda::sigmoid_gate_forward<float>(nullptr, &v, &v, &v, -1, 4), Error);
  EXPECT_THROW(ops::cuda::sigmoid_gate_forward<float>(nullptr, &v, &v, &v, 1, -4), Error);
  EXPECT_THROW(ops::cuda::sigmoid_gate_backward<float>(nullptr, &v, &v, &v, &v, &v, -1, 4), Error);
}

}  // namespace
}  // namespace moecore
