// What the grid emulator's tests share: running a launch in every resume order and comparing the
// outputs bitwise (a kernel whose output depends on the interleaving of its threads races).
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "common/testing.h"
#include "common/tolerances.h"
#include "emu/cuda_emu.h"

namespace moecore::emu_test {

// The dtype's rows of docs/numerics.md (f32 fast vs f32 reference, f64 vs f64) for a kernel
// compared with its op's `_ref`.
template <typename T>
constexpr double kRtol = std::is_same_v<T, float> ? testing::kF32Rtol : testing::kF64Rtol;
template <typename T>
constexpr double kAtol = std::is_same_v<T, float> ? testing::kF32Atol : testing::kF64Atol;

struct Order {
  emu::ResumeOrder order;
  uint64_t seed;
  std::string name() const {
    std::string s = emu::resume_order_name(order);
    if (order == emu::ResumeOrder::Shuffled) s.append("(").append(std::to_string(seed)).append(")");
    return s;
  }
};
inline const std::vector<Order>& orders() {
  static const std::vector<Order> all = {{emu::ResumeOrder::Forward, 0},
                                         {emu::ResumeOrder::Reversed, 0},
                                         {emu::ResumeOrder::Shuffled, 1},
                                         {emu::ResumeOrder::Shuffled, 2}};
  return all;
}

// run() once per resume order, returning its output's bytes each time; "" when every order gave
// the same bytes, else which orders differ from the first.
inline std::string order_dependence(const std::function<std::vector<unsigned char>()>& run) {
  std::vector<unsigned char> first;
  std::string diff;
  for (const Order& o : orders()) {
    emu::ScopedResumeOrder scope(o.order, o.seed);
    std::vector<unsigned char> out = run();
    if (&o == &orders().front())
      first = std::move(out);
    else if (out != first)
      diff += (diff.empty() ? "" : ", ") + o.name();
  }
  return diff.empty() ? "" : "output differs from " + orders().front().name() + " in: " + diff;
}

template <typename T>
std::vector<unsigned char> bytes_of(const T* p, size_t n) {
  std::vector<unsigned char> b(n * sizeof(T));
  if (n > 0) std::memcpy(b.data(), p, b.size());
  return b;
}

// A guarded buffer holding v.
template <typename T>
testing::Guarded<T> guarded(const std::vector<T>& v) {
  testing::Guarded<T> g(int64_t(v.size()));
  std::copy(v.begin(), v.end(), g.data());
  return g;
}

// got equals want bit for bit (the first differing element named) and its guards are intact.
template <typename T>
void expect_bitwise(const testing::Guarded<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  ASSERT_EQ(size_t(got.size()), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(bytes_of(got.data() + i, 1), bytes_of(want.data() + i, 1))
        << what << " element " << i << ": " << +got[int64_t(i)] << " vs " << +want[i];
  }
}

// Appends g's bytes to out (a run's outputs, for order_dependence).
template <typename T>
void append(std::vector<unsigned char>& out, const testing::Guarded<T>& g) {
  const std::vector<unsigned char> b = bytes_of(g.data(), size_t(g.size()));
  out.insert(out.end(), b.begin(), b.end());
}

}  // namespace moecore::emu_test
