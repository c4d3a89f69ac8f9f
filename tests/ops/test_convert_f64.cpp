// f64 conversions: fast == reference bitwise (each element is one rounding), round to nearest,
// the factor taken in f64, with guard bytes and sizes around the vector width.
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "ops/convert_f64.h"

namespace moecore::testing {
namespace {

template <typename T>
void compare(int64_t n) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " sizeof(T)=" << sizeof(T));
  auto x = random_vec<T>(n, 1, -3, 3);
  auto x64 = random_vec<double>(n, 2, -3, 3);
  auto f = random_vec<T>(n, 3, 0.9, 1.1);
  auto y0 = random_vec<T>(n, 4);
  Guarded<double> w(n), w_r(n);
  ops::widen_to_f64<T>(cpu_exec(), w.data(), x.data(), n);
  ops::widen_to_f64_ref(w_r.data(), x.data(), n);
  EXPECT_EQ(w.vec(), w_r.vec());
  Guarded<T> y(n), y_r(n);
  ops::narrow_from_f64<T>(cpu_exec(), y.data(), x64.data(), n);
  ops::narrow_from_f64_ref(y_r.data(), x64.data(), n);
  EXPECT_EQ(y.vec(), y_r.vec());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], static_cast<T>(x64[i]));
  for (const T* fac : {static_cast<const T*>(nullptr), static_cast<const T*>(f.data())}) {
    Guarded<T> a(n), a_r(n);
    for (int64_t i = 0; i < n; ++i) a[i] = a_r[i] = y0[i];
    ops::add_from_f64<T>(cpu_exec(), a.data(), x64.data(), fac, n);
    ops::add_from_f64_ref(a_r.data(), x64.data(), fac, n);
    EXPECT_EQ(a.vec(), a_r.vec());
    EXPECT_TRUE(a.intact() && a_r.intact());
  }
  for (auto* g : {&w, &w_r}) EXPECT_TRUE(g->intact());
  EXPECT_TRUE(y.intact() && y_r.intact());
}

TEST(ConvertF64, FastMatchesRefBitwise) {
  for (int64_t n : {0, 1, 7, 8, 9, 33, 1000, 70000}) {
    compare<float>(n);
    compare<double>(n);
  }
}

}  // namespace
}  // namespace moecore::testing
