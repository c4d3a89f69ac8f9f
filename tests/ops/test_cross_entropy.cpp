// Fused output head + cross entropy: fast (chunked, GEMM) vs reference on awkward shapes with
// guard bytes on every output and on the workspace, equality with a naive -log softmax, chunk
// size invariance, ignored targets, fp64 finite differences for dh and dW, and the bf16 head
// against the f32 one on inputs whose logits are exact in both.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/bf16_gemm_paths.h"
#include "common/testing.h"
#include "core/check.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/gemm_bf16.h"

namespace moecore::testing {
namespace {

using ops::head_loss_backward;
using ops::head_loss_backward_ref;
using ops::head_loss_forward;
using ops::head_loss_forward_ref;
using ops::head_loss_workspace_elems;
using ops::HeadLossShape;

// Targets in [0, V) with every `ignore_every`-th one set to -1 (ignored).
std::vector<int32_t> make_targets(int64_t T, int64_t V, int ignore_every, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> tg(T);
  for (int64_t t = 0; t < T; ++t) {
    tg[t] = (ignore_every > 0 && t % ignore_every == 1) ? -1 : int32_t(gen() % uint32_t(V));
  }
  return tg;
}

template <typename T>
struct Result {
  double total = 0;
  std::vector<T> loss, lse, dh, dw;
};

template <typename T>
Result<T> run_fast(const HeadLossShape& s, const std::vector<T>& h, const std::vector<T>& w,
                   const std::vector<int32_t>& tg, const std::vector<T>& dw0, T dloss) {
  Guarded<T> loss(s.n_tok), lse(s.n_tok), dh(s.n_tok * s.H), dw(s.V * s.H),
      ws(head_loss_workspace_elems(s));
  for (int64_t i = 0; i < s.V * s.H; ++i) dw[i] = dw0[i];
  Result<T> r;
  head_loss_forward<T>(cpu_exec(), &r.total, loss.data(), lse.data(), h.data(), w.data(), tg.data(),
                       s, ws.data());
  head_loss_backward<T>(cpu_exec(), dh.data(), dw.data(), h.data(), w.data(), tg.data(), lse.data(),
                        &dloss, s, ws.data());
  for (auto* g : {&loss, &lse, &dh, &dw, &ws}) EXPECT_TRUE(g->intact());
  r.loss = loss.vec(), r.lse = lse.vec(), r.dh = dh.vec(), r.dw = dw.vec();
  return r;
}

template <typename T>
Result<T> run_ref(const HeadLossShape& s, const std::vector<T>& h, const std::vector<T>& w,
                  const std::vector<int32_t>& tg, const std::vector<T>& dw0, T dloss) {
  Guarded<T> loss(s.n_tok), lse(s.n_tok), dh(s.n_tok * s.H), dw(s.V * s.H);
  for (int64_t i = 0; i < s.V * s.H; ++i) dw[i] = dw0[i];
  Result<T> r;
  r.total = head_loss_forward_ref(loss.data(), lse.data(), h.data(), w.data(), tg.data(), s);
  head_loss_backward_ref(dh.data(), dw.data(), h.data(), w.data(), tg.data(), lse.data(), dloss, s);
  for (auto* g : {&loss, &lse, &dh, &dw}) EXPECT_TRUE(g->intact());
  r.loss = loss.vec(), r.lse = lse.vec(), r.dh = dh.vec(), r.dw = dw.vec();
  return r;
}

// T = 1, V = 1, odd T and H, chunk 1 / not dividing T / > T, one shape with a parallel branch.
const HeadLossShape kShapes[] = {{1, 1, 1, 1},      {1, 5, 7, 256},    {13, 7, 11, 3},
                                 {13, 37, 50, 256}, {64, 24, 300, 16}, {5, 3, 1, 2}};

template <typename T>
void compare_fast_ref(double rtol, double atol) {
  for (const auto& s : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "T=" << s.n_tok << " H=" << s.H << " V=" << s.V << " chunk=" << s.chunk);
    auto h = random_vec<T>(s.n_tok * s.H, 1, -1, 1);
    auto w = random_vec<T>(s.V * s.H, 2, -1, 1);
    auto dw0 = random_vec<T>(s.V * s.H, 3);  // dW accumulates: start from non-zero
    auto tg = make_targets(s.n_tok, s.V, 4, 4);
    const T dloss = T(0.25);
    Result<T> a = run_fast<T>(s, h, w, tg, dw0, dloss), b = run_ref<T>(s, h, w, tg, dw0, dloss);
    EXPECT_NEAR(a.total, b.total, atol * s.n_tok + rtol * std::abs(b.total));
    EXPECT_TRUE(all_close(a.loss, b.loss, rtol, atol)) << "loss";
    EXPECT_TRUE(all_close(a.lse, b.lse, rtol, atol)) << "lse";
    EXPECT_TRUE(all_close(a.dh, b.dh, rtol, atol)) << "dh";
    EXPECT_TRUE(all_close(a.dw, b.dw, rtol, atol)) << "dw";
  }
}

TEST(HeadLoss, FastMatchesRefF32) {
  compare_fast_ref<float>(kF32Rtol, kF32Atol);
}
TEST(HeadLoss, FastMatchesRefF64) {
  compare_fast_ref<double>(kF64Rtol, kF64Atol);
}

TEST(HeadLoss, EqualsNaiveMinusLogSoftmaxAtTarget) {
  const HeadLossShape s{9, 6, 17, 4};
  auto h = random_vec<double>(s.n_tok * s.H, 5, -2, 2);
  auto w = random_vec<double>(s.V * s.H, 6, -2, 2);
  auto tg = make_targets(s.n_tok, s.V, 0, 7);
  std::vector<double> loss(s.n_tok), lse(s.n_tok), ws(head_loss_workspace_elems(s));
  double total = 0;
  head_loss_forward<double>(cpu_exec(), &total, loss.data(), lse.data(), h.data(), w.data(),
                            tg.data(), s, ws.data());
  double naive_total = 0;
  for (int64_t t = 0; t < s.n_tok; ++t) {
    std::vector<double> z(s.V);
    double se = 0;
    for (int64_t v = 0; v < s.V; ++v) {
      for (int64_t k = 0; k < s.H; ++k) z[v] += h[t * s.H + k] * w[v * s.H + k];
      se += std::exp(z[v]);  // no max shift: logits are O(10) here
    }
    double naive = -std::log(std::exp(z[tg[t]]) / se);
    EXPECT_NEAR(loss[t], naive, 1e-12) << "token " << t;
    naive_total += naive;
  }
  EXPECT_NEAR(total, naive_total, 1e-11);
}

template <typename T>
void chunk_invariance() {
  const int64_t T_ = 13, H = 9, V = 29;
  auto h = random_vec<T>(T_ * H, 8);
  auto w = random_vec<T>(V * H, 9);
  auto dw0 = random_vec<T>(V * H, 10);
  auto tg = make_targets(T_, V, 5, 11);
  Result<T> base = run_fast<T>({T_, H, V, 1}, h, w, tg, dw0, T(1));
  for (int64_t chunk : {3, 13, 100}) {
    SCOPED_TRACE(::testing::Message() << "chunk=" << chunk);
    Result<T> r = run_fast<T>({T_, H, V, chunk}, h, w, tg, dw0, T(1));
    if constexpr (std::is_same_v<T, double>) {
      // f64 GEMM is plain loops: a row's logits do not depend on the chunk, so per-token
      // quantities are bitwise equal. dW sums over tokens chunk by chunk (the grouping of the
      // sum changes), so it is only close.
      EXPECT_EQ(r.total, base.total);
      EXPECT_EQ(r.loss, base.loss);
      EXPECT_EQ(r.lse, base.lse);
      EXPECT_EQ(r.dh, base.dh);
      EXPECT_TRUE(all_close(r.dw, base.dw, kF64Rtol, kF64Atol));
    } else {
      // oneDNN sgemm picks kernels (and so summation orders) by M: chunk 1 vs 3 changes the last
      // bits of the logits. Each chunk size is itself deterministic.
      EXPECT_NEAR(r.total, base.total, kF32Rtol * std::abs(base.total));
      EXPECT_TRUE(all_close(r.loss, base.loss, kF32Rtol, kF32Atol));
      EXPECT_TRUE(all_close(r.lse, base.lse, kF32Rtol, kF32Atol));
      EXPECT_TRUE(all_close(r.dh, base.dh, kF32Rtol, kF32Atol));
      EXPECT_TRUE(all_close(r.dw, base.dw, kF32Rtol, kF32Atol));
      Result<T> again = run_fast<T>({T_, H, V, chunk}, h, w, tg, dw0, T(1));
      EXPECT_EQ(again.loss, r.loss);
      EXPECT_EQ(again.dh, r.dh);
      EXPECT_EQ(again.dw, r.dw);
    }
  }
}

TEST(HeadLoss, ChunkSizeDoesNotChangeResultsF32) {
  chunk_invariance<float>();
}
TEST(HeadLoss, ChunkSizeDoesNotChangeResultsF64) {
  chunk_invariance<double>();
}

TEST(HeadLoss, IgnoredTargetsContributeNothing) {
  const int64_t T = 11, H = 5, V = 13;
  auto h = random_vec<double>(T * H, 12);
  auto w = random_vec<double>(V * H, 13);
  auto tg = make_targets(T, V, 3, 14);  // tokens 1, 4, 7, 10 ignored
  std::vector<double> zero_dw(V * H, 0.0);
  Result<double> all = run_fast<double>({T, H, V, 4}, h, w, tg, zero_dw, 1.0);
  // The same batch with the ignored tokens removed.
  std::vector<double> hk;
  std::vector<int32_t> tk;
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] < 0) {
      EXPECT_EQ(all.loss[t], 0.0);
      for (int64_t k = 0; k < H; ++k) EXPECT_EQ(all.dh[t * H + k], 0.0);
      continue;
    }
    hk.insert(hk.end(), h.begin() + t * H, h.begin() + (t + 1) * H);
    tk.push_back(tg[t]);
  }
  const int64_t Tk = int64_t(tk.size());
  ASSERT_EQ(Tk, 7);
  Result<double> kept = run_fast<double>({Tk, H, V, 4}, hk, w, tk, zero_dw, 1.0);
  EXPECT_NEAR(all.total, kept.total, 1e-12);
  EXPECT_TRUE(all_close(all.dw, kept.dw, kF64Rtol, kF64Atol));
  // All targets ignored: zero loss, zero gradients.
  std::vector<int32_t> none(T, -1);
  Result<double> nil = run_fast<double>({T, H, V, 4}, h, w, none, zero_dw, 1.0);
  EXPECT_EQ(nil.total, 0.0);
  for (double g : nil.dw) EXPECT_EQ(g, 0.0);
  for (double g : nil.dh) EXPECT_EQ(g, 0.0);
}

TEST(HeadLoss, TargetOutOfRangeThrows) {
  const HeadLossShape s{3, 2, 5, 2};
  std::vector<double> h(6), w(10), loss(3), lse(3), ws(head_loss_workspace_elems(s));
  std::vector<int32_t> tg = {0, 5, 1};
  try {
    double total = 0;
    head_loss_forward<double>(cpu_exec(), &total, loss.data(), lse.data(), h.data(), w.data(),
                              tg.data(), s, ws.data());
    ADD_FAILURE() << "target 5 >= V = 5 accepted";
  } catch (const moecore::Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 5 at position 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(head_loss_forward_ref(loss.data(), lse.data(), h.data(), w.data(), tg.data(), s),
               moecore::Error);
}

// --bf16 head on h, W in {-1, -1/2, 0, 1/2, 1}: the logits are exact in the f32 and in the bf16
// GEMM, so the forward must equal the f32 forward bitwise, and the backward must be the bf16
// GEMMs of exactly bf16(the f32 path's dlogits) (read from the f32 workspace, which holds every
// row when chunk >= T): f32 accumulation against f64 sums of the same products.
// Both bf16 GEMM paths (native oneDNN bf16, widen to f32 + sgemm), on any machine, and the
// widened-operand form (W given widened, Param::data16w), which must equal the widen path
// bitwise.
TEST(HeadLoss, Bf16PathUsesTheRoundedF32Gradient) {
  std::vector<float> widen_dh[2], widen_dw[2];  // per T, from the widen path's runs
  for (int run = 0; run < 6; ++run) {
    const int64_t T = run % 2 ? 64 : 13;  // 64 x 300 takes the parallel branch
    const bool widened_form = run >= 4;
    const ops::Bf16GemmPath path = run < 2 ? ops::Bf16GemmPath::Native : ops::Bf16GemmPath::Widen;
    if (testing::runnable_bf16_gemm_paths({path}).empty()) continue;
    testing::ScopedBf16GemmPath scope(path);
    const int64_t H = 8, V = 300;
    SCOPED_TRACE(::testing::Message() << "T=" << T << " path=" << ops::bf16_gemm_path_name(path)
                                      << (widened_form ? " widened operands" : ""));
    std::mt19937 gen(21);
    auto pick = [&] { return 0.5f * static_cast<float>(static_cast<int>(gen() % 5) - 2); };
    std::vector<float> h(T * H), w(V * H);
    for (auto& x : h) x = pick();
    for (auto& x : w) x = pick();
    auto tg = make_targets(T, V, 5, 22);
    const float dloss = 0.375f;
    // f32, one chunk: the workspace ends up holding every row's dlogits.
    const HeadLossShape s32{T, H, V, T};
    std::vector<float> loss(T), lse(T), ws(head_loss_workspace_elems(s32)), dh(T * H),
        dw(V * H, 0.f);
    double total = 0;
    head_loss_forward<float>(cpu_exec(), &total, loss.data(), lse.data(), h.data(), w.data(),
                             tg.data(), s32, ws.data());
    head_loss_backward<float>(cpu_exec(), dh.data(), dw.data(), h.data(), w.data(), tg.data(),
                              lse.data(), &dloss, s32, ws.data());
    // bf16, chunks of 16.
    const HeadLossShape s16{T, H, V, 16};
    std::vector<bf16> w16(V * H), h16(T * H), dz16(head_loss_workspace_elems(s16));
    ops::cast_f32_to_bf16(cpu_exec(), w16.data(), w.data(), V * H);
    std::vector<float> ws32(ops::head_loss_bf16_workspace_elems(cpu_exec(), s16)), w32(V * H),
        h32(T * H);
    ops::round_f32_to_bf16(cpu_exec(), w32.data(), w.data(), V * H);
    ops::HeadLossBf16 b{w16.data(), h16.data(), dz16.data(), ws32.data()};
    if (widened_form) b = ops::HeadLossBf16{.w_VH_wide = w32.data(), .h32 = h32.data()};
    std::vector<float> loss16(T), lse16(T), ws16(head_loss_workspace_elems(s16)), dh16(T * H),
        dw16(V * H, 0.f);
    double total16 = 0;
    head_loss_forward<float>(cpu_exec(), &total16, loss16.data(), lse16.data(), h.data(), w.data(),
                             tg.data(), s16, ws16.data(), &b);
    head_loss_backward<float>(cpu_exec(), dh16.data(), dw16.data(), h.data(), w.data(), tg.data(),
                              lse16.data(), &dloss, s16, ws16.data(), &b);
    EXPECT_EQ(total16, total);
    EXPECT_EQ(loss16, loss);
    EXPECT_EQ(lse16, lse);
    std::vector<double> dh_expect(T * H, 0.0), dw_expect(V * H, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t v = 0; v < V; ++v) {
        const double dz = bf16_to_float(float_to_bf16(ws[t * V + v]));
        if (tg[t] < 0) {
          EXPECT_EQ(dz, 0.0);
        }
        for (int64_t k = 0; k < H; ++k) {
          dh_expect[t * H + k] += dz * w[v * H + k];
          dw_expect[v * H + k] += dz * h[t * H + k];
        }
      }
    }
    EXPECT_TRUE(all_close(dh16, dh_expect, kF32Rtol, kF32Atol)) << "dh";
    EXPECT_TRUE(all_close(dw16, dw_expect, kF32Rtol, kF32Atol)) << "dw";
    if (path == ops::Bf16GemmPath::Widen && !widened_form) {
      widen_dh[run % 2] = dh16;
      widen_dw[run % 2] = dw16;
    } else if (widened_form) {
      EXPECT_EQ(0, std::memcmp(dh16.data(), widen_dh[run % 2].data(), dh16.size() * 4)) << "dh";
      EXPECT_EQ(0, std::memcmp(dw16.data(), widen_dw[run % 2].data(), dw16.size() * 4)) << "dw";
    }
  }
}

// loss = dloss * sum_t loss_t, so dloss is also exercised.
template <bool kFast>
void gradcheck(const HeadLossShape& s) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " T=" << s.n_tok << " H=" << s.H
                                    << " V=" << s.V << " chunk=" << s.chunk);
  auto h = random_vec<double>(s.n_tok * s.H, 15);
  auto w = random_vec<double>(s.V * s.H, 16);
  auto tg = make_targets(s.n_tok, s.V, 3, 17);
  const double dloss = 0.7;
  std::vector<double> loss(s.n_tok), lse(s.n_tok), ws(head_loss_workspace_elems(s)),
      dh(s.n_tok * s.H), dw(s.V * s.H, 0.0);
  auto f = [&] {
    double total = 0;
    if (kFast) {
      head_loss_forward<double>(cpu_exec(), &total, loss.data(), lse.data(), h.data(), w.data(),
                                tg.data(), s, ws.data());
    } else {
      total = head_loss_forward_ref(loss.data(), lse.data(), h.data(), w.data(), tg.data(), s);
    }
    return dloss * total;
  };
  f();
  if (kFast) {
    head_loss_backward<double>(cpu_exec(), dh.data(), dw.data(), h.data(), w.data(), tg.data(),
                               lse.data(), &dloss, s, ws.data());
  } else {
    head_loss_backward_ref(dh.data(), dw.data(), h.data(), w.data(), tg.data(), lse.data(), dloss,
                           s);
  }
  EXPECT_TRUE(check_gradient(f, h.data(), dh.data(), {s.n_tok, s.H}, "dh", 64));
  EXPECT_TRUE(check_gradient(f, w.data(), dw.data(), {s.V, s.H}, "dw", 64));
}

TEST(HeadLoss, GradientsMatchFiniteDifferences) {
  for (const HeadLossShape& s : {HeadLossShape{1, 1, 1, 1}, HeadLossShape{1, 3, 4, 8},
                                 HeadLossShape{7, 5, 9, 3}, HeadLossShape{13, 4, 6, 100}}) {
    gradcheck<true>(s);
    gradcheck<false>(s);
  }
}

}  // namespace
}  // namespace moecore::testing
