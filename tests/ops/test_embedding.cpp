// Token embedding: fast vs reference (bitwise, repeated ids included), guard bytes, fp64 finite
// differences for dw, determinism across thread counts, and the out-of-range id error.
#include <omp.h>

#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/embedding.h"

namespace moecore::testing {
namespace {

using ops::embedding_backward;
using ops::embedding_backward_ref;
using ops::embedding_forward;
using ops::embedding_forward_ref;

struct Shape {
  int64_t T, H, V;
};
// T = 1, odd T, H not a multiple of 8, V = 1 (every token the same id), a parallel shape.
const Shape kShapes[] = {{1, 1, 1}, {1, 7, 5}, {13, 37, 1}, {13, 37, 4}, {300, 130, 50}};

std::vector<int32_t> random_ids(int64_t T, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids(T);
  for (auto& id : ids) id = int32_t(gen() % uint32_t(V));
  return ids;
}

template <typename T>
void compare_fast_ref() {
  for (auto [T_, H, V] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H << " V=" << V);
    auto ids = random_ids(T_, V, 1);  // V < T: many repeated ids
    auto w = random_vec<T>(V * H, 2);
    auto dy = random_vec<T>(T_ * H, 3);
    auto dw0 = random_vec<T>(V * H, 4);  // dw accumulates: start from non-zero
    Guarded<T> y(T_ * H), y_r(T_ * H), dw(V * H), dw_r(V * H);
    for (int64_t i = 0; i < V * H; ++i) dw[i] = dw_r[i] = dw0[i];
    embedding_forward<T>(cpu_exec(), y.data(), ids.data(), w.data(), T_, H, V);
    embedding_forward_ref(y_r.data(), ids.data(), w.data(), T_, H, V);
    embedding_backward<T>(cpu_exec(), dw.data(), dy.data(), ids.data(), T_, H, V);
    embedding_backward_ref(dw_r.data(), dy.data(), ids.data(), T_, H, V);
    // Same additions in the same order: bitwise equal.
    EXPECT_EQ(y.vec(), y_r.vec());
    EXPECT_EQ(dw.vec(), dw_r.vec());
    for (int64_t t = 0; t < T_; ++t) {
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(y[t * H + h], w[ids[t] * H + h]);
    }
    for (auto* g : {&y, &y_r, &dw, &dw_r}) EXPECT_TRUE(g->intact());
  }
}

// --bf16: the rows of the table's bf16 values, widened exactly (ids repeated, guards intact).
TEST(Embedding, Bf16TableFastMatchesRef) {
  for (auto [T_, H, V] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H << " V=" << V);
    const auto ids = random_ids(T_, V, 5);
    const auto w32 = random_vec<float>(V * H, 6);
    std::vector<bf16> w(static_cast<size_t>(V * H));
    for (int64_t i = 0; i < V * H; ++i) w[i] = float_to_bf16(w32[i]);
    Guarded<float> y(T_ * H), y_r(T_ * H);
    ops::embedding_forward_bf16(cpu_exec(), y.data(), ids.data(), w.data(), T_, H, V);
    ops::embedding_forward_bf16_ref(y_r.data(), ids.data(), w.data(), T_, H, V);
    EXPECT_EQ(y.vec(), y_r.vec());
    for (int64_t t = 0; t < T_; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(y_r[t * H + h], bf16_to_float(w[ids[t] * H + h]));
        ASSERT_NE(y_r[t * H + h], w32[ids[t] * H + h]) << "not rounded: the test's inputs";
      }
    }
    EXPECT_TRUE(y.intact() && y_r.intact());
  }
  std::vector<bf16> w(4);
  std::vector<float> y(2);
  const std::vector<int32_t> bad = {0, 2};
  EXPECT_THROW(ops::embedding_forward_bf16(cpu_exec(), y.data(), bad.data(), w.data(), 2, 1, 2),
               Error);
}

TEST(Embedding, FastMatchesRefF32) {
  compare_fast_ref<float>();
}
TEST(Embedding, FastMatchesRefF64) {
  compare_fast_ref<double>();
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  const int64_t T = 13, H = 5, V = 4;
  auto ids = random_ids(T, V, 5);
  auto w = random_vec<double>(V * H, 6);
  auto R = random_vec<double>(T * H, 7);
  std::vector<double> y(T * H);
  for (bool fast : {true, false}) {
    auto fwd = fast ? ops::cpu::embedding_forward<double> : embedding_forward_ref<double>;
    auto bwd = fast ? ops::cpu::embedding_backward<double> : embedding_backward_ref<double>;
    std::vector<double> dw(V * H, 0.0);
    auto loss = [&] {
      fwd(y.data(), ids.data(), w.data(), T, H, V);
      double l = 0;
      for (int64_t i = 0; i < T * H; ++i) l += y[i] * R[i];
      return l;
    };
    bwd(dw.data(), R.data(), ids.data(), T, H, V);
    EXPECT_TRUE(check_gradient(loss, w.data(), dw.data(), {V, H}, fast ? "dw fast" : "dw ref", 64));
  }
}

TEST(Embedding, BackwardBitwiseDeterministicAcrossThreadCounts) {
  const int64_t T = 300, H = 200, V = 7;
  auto ids = random_ids(T, V, 8);
  auto dy = random_vec<float>(T * H, 9);
  std::vector<float> dw[2];
  for (int i = 0; i < 2; ++i) {
    moecore::testing::ScopedOmpThreads threads(i == 0 ? 1 : 3);
    dw[i].assign(V * H, 0.f);
    embedding_backward<float>(cpu_exec(), dw[i].data(), dy.data(), ids.data(), T, H, V);
  }
  EXPECT_EQ(dw[0], dw[1]);
}

TEST(Embedding, BadIdThrowsNamingIdPositionAndV) {
  const int64_t H = 3, V = 10;
  std::vector<float> w(V * H), y(4 * H), dw(V * H);
  for (int32_t bad : {10, 12345, -2}) {
    std::vector<int32_t> ids = {1, 2, bad, 3};
    const std::string want = "token id " + std::to_string(bad) + " at position 2";
    for (int which = 0; which < 4; ++which) {
      try {
        if (which == 0)
          embedding_forward<float>(cpu_exec(), y.data(), ids.data(), w.data(), 4, H, V);
        if (which == 1) embedding_forward_ref(y.data(), ids.data(), w.data(), 4, H, V);
        if (which == 2)
          embedding_backward<float>(cpu_exec(), dw.data(), y.data(), ids.data(), 4, H, V);
        if (which == 3) embedding_backward_ref(dw.data(), y.data(), ids.data(), 4, H, V);
        ADD_FAILURE() << "id " << bad << " accepted by variant " << which;
      } catch (const moecore::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(want), std::string::npos) << msg;
        EXPECT_NE(msg.find("V=10"), std::string::npos) << msg;
      }
    }
  }
}

}  // namespace
}  // namespace moecore::testing
