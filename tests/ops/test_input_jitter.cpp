// Input jitter: fast == reference, factors inside [1 - eps, 1 + eps], a pure function of
// (key, index, lane) (the same draws at 1 and 3 threads, different for another lane), and the
// backward as dx += dy * u.
#include <vector>

#include "common/testing.h"
#include "core/rng.h"
#include "ops/input_jitter.h"

namespace moecore::testing {
namespace {

// base 100 = step 100 x stride 1.
constexpr int64_t kStep = 100;

template <typename T>
void compare(int64_t n, double rtol) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " sizeof(T)=" << sizeof(T));
  const double eps = 0.1;
  const uint64_t key = rng_key(7, "test.jitter");
  auto x = random_vec<T>(n, 1, -2, 2);
  Guarded<T> j(n), y(n), j_r(n), y_r(n);
  ops::input_jitter_forward<T>(cpu_exec(), j.data(), y.data(), x.data(), eps, key, &kStep, 1, 2, n);
  ops::input_jitter_forward_ref(j_r.data(), y_r.data(), x.data(), eps, key, 100, 2, n);
  EXPECT_EQ(j.vec(), j_r.vec());
  EXPECT_EQ(y.vec(), y_r.vec());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_GE(j[i], static_cast<T>(1 - eps));
    EXPECT_LE(j[i], static_cast<T>(1 + eps));
  }
  {
    ScopedOmpThreads threads(3);
    Guarded<T> j3(n), y3(n);
    ops::input_jitter_forward<T>(cpu_exec(), j3.data(), y3.data(), x.data(), eps, key, &kStep, 1, 2,
                                 n);
    EXPECT_EQ(j3.vec(), j.vec());
  }
  if (n > 0) {
    Guarded<T> j4(n), y4(n);
    ops::input_jitter_forward<T>(cpu_exec(), j4.data(), y4.data(), x.data(), eps, key, &kStep, 1, 3,
                                 n);
    EXPECT_NE(j4.vec(), j.vec());  // another micro-batch: other draws
  }
  auto dy = random_vec<T>(n, 2);
  auto dx0 = random_vec<T>(n, 3);
  Guarded<T> dx(n), dx_r(n);
  for (int64_t i = 0; i < n; ++i) dx[i] = dx_r[i] = dx0[i];
  ops::input_jitter_backward<T>(cpu_exec(), dx.data(), dy.data(), j.data(), n);
  ops::input_jitter_backward_ref(dx_r.data(), dy.data(), j.data(), n);
  // A fused multiply-add may round once where the reference rounds twice.
  EXPECT_TRUE(all_close(dx.vec(), dx_r.vec(), rtol, rtol));
  for (auto* g : {&j, &y, &j_r, &y_r, &dx, &dx_r}) EXPECT_TRUE(g->intact());
}

TEST(InputJitter, FastMatchesRef) {
  for (int64_t n : {0, 1, 9, 1000, 20000}) {
    compare<float>(n, kF32Rtol);
    compare<double>(n, kF64Rtol);
  }
}

}  // namespace
}  // namespace moecore::testing
