// The shared expert's sigmoid gate: fast vs reference (f32, f64) on awkward shapes with guard
// bytes, the accumulate-into-y and ds-aliases-dy contracts, the thread-count invariance of the
// backward's row sums, and fp64 finite differences of ds and dl.
#include <omp.h>

#include <cstring>
#include <vector>

#include "common/testing.h"
#include "ops/sigmoid_gate.h"

namespace moecore::testing {
namespace {

using ops::sigmoid_gate_backward;
using ops::sigmoid_gate_backward_ref;
using ops::sigmoid_gate_forward;
using ops::sigmoid_gate_forward_ref;

struct Shape {
  int64_t N, H;
};
// N = 0 (no tokens), H = 1, odd sizes, one shape above the OpenMP threshold.
const Shape kShapes[] = {{0, 5}, {1, 1}, {3, 7}, {13, 37}, {70, 300}};

template <typename T>
void compare_fast_ref(double rtol, double atol) {
  uint32_t seed = 1;
  for (auto [N, H] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H);
    const auto s = random_vec<T>(N * H, seed++);
    const auto l = random_vec<T>(N, seed++, -12, 12);  // both tails of the sigmoid
    const auto y0 = random_vec<T>(N * H, seed++);
    const auto dy = random_vec<T>(N * H, seed++);
    Guarded<T> y(N * H), ds(N * H), dl(N);
    std::copy(y0.begin(), y0.end(), y.data());
    std::vector<T> y_r = y0, ds_r(N * H), dl_r(N);
    sigmoid_gate_forward<T>(cpu_exec(), y.data(), s.data(), l.data(), N, H);
    sigmoid_gate_forward_ref(y_r.data(), s.data(), l.data(), N, H);
    sigmoid_gate_backward<T>(cpu_exec(), ds.data(), dl.data(), dy.data(), s.data(), l.data(), N, H);
    sigmoid_gate_backward_ref(ds_r.data(), dl_r.data(), dy.data(), s.data(), l.data(), N, H);
    EXPECT_TRUE(all_close(y.vec(), y_r, rtol, atol)) << "y";
    EXPECT_TRUE(all_close(ds.vec(), ds_r, rtol, atol)) << "ds";
    EXPECT_TRUE(all_close(dl.vec(), dl_r, rtol, atol)) << "dl";
    for (auto* g : {&y, &ds, &dl}) EXPECT_TRUE(g->intact());
  }
}

TEST(SigmoidGate, FastMatchesRefF32) {
  compare_fast_ref<float>(kF32Rtol, kF32Atol);
}
TEST(SigmoidGate, FastMatchesRefF64) {
  compare_fast_ref<double>(kF64Rtol, kF64Atol);
}

// The forward adds into y: with y = 0 it writes sigmoid(l) s; l = 0 halves s exactly.
TEST(SigmoidGate, ForwardAccumulatesIntoY) {
  const int64_t N = 3, H = 4;
  const auto s = random_vec<float>(N * H, 5);
  const std::vector<float> l(N, 0.f);
  std::vector<float> y(N * H, 0.f), y2(N * H, 1.f);
  sigmoid_gate_forward<float>(cpu_exec(), y.data(), s.data(), l.data(), N, H);
  sigmoid_gate_forward<float>(cpu_exec(), y2.data(), s.data(), l.data(), N, H);
  for (int64_t i = 0; i < N * H; ++i) {
    EXPECT_EQ(y[i], 0.5f * s[i]) << i;
    EXPECT_EQ(y2[i], 1.f + 0.5f * s[i]) << i;
  }
}

// ds may be dy itself (the header's contract): the same bits as separate buffers.
TEST(SigmoidGate, BackwardInPlaceEqualsOutOfPlace) {
  const int64_t N = 13, H = 37;
  const auto s = random_vec<float>(N * H, 6);
  const auto l = random_vec<float>(N, 7, -4, 4);
  const auto dy = random_vec<float>(N * H, 8);
  std::vector<float> ds(N * H), dl(N), inplace = dy, dl2(N);
  sigmoid_gate_backward<float>(cpu_exec(), ds.data(), dl.data(), dy.data(), s.data(), l.data(), N,
                               H);
  sigmoid_gate_backward<float>(cpu_exec(), inplace.data(), dl2.data(), inplace.data(), s.data(),
                               l.data(), N, H);
  EXPECT_EQ(0, std::memcmp(inplace.data(), ds.data(), N * H * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dl2.data(), dl.data(), N * sizeof(float)));
}

// Rows are independent and each row's sum runs in order: 1 and 2 threads give the same bits.
TEST(SigmoidGate, BitwiseTheSameForAnyThreadCount) {
  const int64_t N = 70, H = 300;  // above the OpenMP threshold
  const auto s = random_vec<float>(N * H, 9);
  const auto l = random_vec<float>(N, 10, -4, 4);
  const auto dy = random_vec<float>(N * H, 11);
  std::vector<float> y[2], ds[2], dl[2];
  const int saved = omp_get_max_threads();
  for (int t = 0; t < 2; ++t) {
    omp_set_num_threads(t + 1);
    y[t].assign(N * H, 0.25f);
    ds[t].resize(N * H);
    dl[t].resize(N);
    sigmoid_gate_forward<float>(cpu_exec(), y[t].data(), s.data(), l.data(), N, H);
    sigmoid_gate_backward<float>(cpu_exec(), ds[t].data(), dl[t].data(), dy.data(), s.data(),
                                 l.data(), N, H);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(y[0], y[1]);
  EXPECT_EQ(ds[0], ds[1]);
  EXPECT_EQ(dl[0], dl[1]);
}

// loss = sum(y * R) with y = y0 + sigmoid(l) s: dy = R.
template <bool kFast>
void gradcheck(int64_t N, int64_t H) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " N=" << N << " H=" << H);
  auto s = random_vec<double>(N * H, 12);
  auto l = random_vec<double>(N, 13, -3, 3);
  const auto y0 = random_vec<double>(N * H, 14);
  const auto R = random_vec<double>(N * H, 15);
  std::vector<double> y(N * H), ds(N * H), dl(N);
  auto fwd = kFast ? ops::cpu::sigmoid_gate_forward<double> : sigmoid_gate_forward_ref<double>;
  auto bwd = kFast ? ops::cpu::sigmoid_gate_backward<double> : sigmoid_gate_backward_ref<double>;
  auto loss = [&] {
    y = y0;
    fwd(y.data(), s.data(), l.data(), N, H);
    double v = 0;
    for (int64_t i = 0; i < N * H; ++i) v += y[i] * R[i];
    return v;
  };
  bwd(ds.data(), dl.data(), R.data(), s.data(), l.data(), N, H);
  EXPECT_TRUE(check_gradient(loss, s.data(), ds.data(), N * H, "ds"));
  EXPECT_TRUE(check_gradient(loss, l.data(), dl.data(), N, "dl"));
}

TEST(SigmoidGate, GradientsMatchFiniteDifferences) {
  for (auto [N, H] : {Shape{1, 1}, Shape{1, 6}, Shape{13, 9}}) {
    gradcheck<true>(N, H);
    gradcheck<false>(N, H);
  }
}

}  // namespace
}  // namespace moecore::testing
