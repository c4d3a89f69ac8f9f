// --bf16: fc1's output h is kept in bf16 (nn/mlp.h, MlpSaved::h16_NF1), as Megatron's TE GEMMs
// write it: the f32 GEMM result plus the f32 bias, rounded to nearest even. Checked against a
// plain loop of that contract on every bf16 GEMM path the CPU has, with G groups of uneven rows
// (SwiGLU without biases, GeLU with them); the activation and its backward read the kept bf16 h,
// not the f32 memory the GEMM's products passed through (the backward's dh, other layers' workspace).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "common/bf16_gemm_paths.h"
#include "common/layer_testing.h"
#include "common/testing.h"
#include "nn/mlp.h"
#include "ops/gemm_bf16.h"

namespace moecore::nn {
namespace {

using testing::host;
using testing::random_vec;

struct Rig {
  ParamRegistry params{DType::F32};
  Param* fc1 = nullptr;
  Param* fc2 = nullptr;
  Param* b1 = nullptr;
  Param* b2 = nullptr;
  MlpShape sh;
  MlpSaved<float> s;
  Arena arena;
  static constexpr int64_t G = 2, N = 9;
  std::vector<int64_t> m_G{4, 5};
  DevPtr<int64_t> m_dev = nullptr;

  Rig(ops::Activation act, bool bias, bool widened) {
    sh = MlpShape{12, 10, act, bias};
    const int64_t H = sh.H, F = sh.F, F1 = sh.F1();
    params.enable_bf16_copies(widened);
    fc1 = &params.add(ParamSpec{"t.fc1", {G, F1, H}, ParamInit::Normal, 0.3, ParamKind::Expert,
                                true, {}, /*bf16_only=*/true});
    fc2 = &params.add(ParamSpec{"t.fc2", {G, H, F}, ParamInit::Normal, 0.2, ParamKind::Expert,
                                true, {}, /*bf16_only=*/true});
    if (bias) {
      b1 = &params.add(ParamSpec{"t.b1", {G, F1}, ParamInit::Zeros, 0.0, ParamKind::Expert,
                                 false, {}});
      b2 = &params.add(ParamSpec{"t.b2", {G, H}, ParamInit::Zeros, 0.0, ParamKind::Expert,
                                 false, {}});
    }
    testing::plan_layer(arena, params, 21, [&](Arena& a) {
      mlp_allocate(s, a, N, sh, "t", fc1, fc2, {}, G);
      m_dev = a.alloc<int64_t>(G, "t.m");
      s.fc1_f32 = a.alloc<float>(N * sh.F1(), "t.dh", MemKind::Workspace);  // the owner's dh
    });
    for (Param* b : {b1, b2}) {
      if (b == nullptr) continue;
      for (int64_t i = 0; i < b->local_numel(); ++i)
        host(b->data_as<float>())[i] = 0.3f * std::sin(1.7f * float(i));
    }
    params.refresh_bf16();
    std::copy(m_G.begin(), m_G.end(), host(m_dev));
  }
  MlpParams<DevPtr<const float>> values() const {
    return mlp_values<float>(*fc1, *fc2, b1, b2);
  }
  MlpParams<DevPtr<float>> grads() { return mlp_grads<float>(*fc1, *fc2, b1, b2); }
};

// The nearest bf16 of the f32 GEMM + bias, up to the f32 accumulation's error: h16 lies within
// half a bf16 ulp of the f64 plain loop, plus that error. A truncated or
// unrounded h (or one rounded before the bias) misses this on some element.
void expect_h16_is_rounded_gemm_plus_bias(const Rig& r, const std::vector<float>& x) {
  const int64_t H = r.sh.H, F1 = r.sh.F1();
  // The weight's bf16 values, in the form the path keeps them.
  auto w = [&](int64_t i) -> double {
    return r.fc1->data16 ? bf16_to_float(host(r.fc1->data16)[i]) : host(r.fc1->data16w)[i];
  };
  const bf16* h16 = host(r.s.h16_NF1);
  int64_t row = 0;
  for (int64_t g = 0; g < Rig::G; ++g) {
    for (int64_t i = 0; i < r.m_G[g]; ++i, ++row) {
      for (int64_t j = 0; j < F1; ++j) {
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < H; ++k) {
          const double p = double(bf16_to_float(float_to_bf16(x[row * H + k]))) *
                           w((g * F1 + j) * H + k);
          acc += p;
          mag += std::abs(p);
        }
        // The bias as the layers read it: its bf16 value (Param::values32), added in f32.
        if (r.b1 != nullptr) acc += host(r.b1->compute_as<float>())[g * F1 + j];
        const double got = bf16_to_float(h16[row * F1 + j]);
        // Half a bf16 ulp: bf16 keeps 8 significant bits, so 2^(exponent - 8).
        const double slack = (acc != 0 ? std::ldexp(1.0, std::ilogb(acc) - 8) : 0) + 1e-6 * (mag + 1.0);
        EXPECT_LE(std::abs(got - acc), slack) << "row " << row << " col " << j << ": " << got << " vs " << acc;
      }
    }
  }
}

struct Grads {
  std::vector<float> y, dx, dp;
  std::vector<std::vector<float>> params;
};

Grads run(ops::Activation act, bool bias, bool widened, bool poison_h32) {
  Rig r(act, bias, widened);
  EXPECT_EQ(r.s.widened, widened);
  EXPECT_TRUE(r.s.h16_NF1) << "--bf16 keeps fc1's output in bf16";
  const int64_t H = r.sh.H, F = r.sh.F, F1 = r.sh.F1();
  const std::vector<float> x = random_vec<float>(Rig::N * H, 3);
  const std::vector<float> p = random_vec<float>(Rig::N, 4);
  const std::vector<float> dy = random_vec<float>(Rig::N * H, 5);
  Grads out{std::vector<float>(Rig::N * H), std::vector<float>(Rig::N * H),
            std::vector<float>(Rig::N), {}};
  mlp_forward<float>(r.s, out.y.data(), x.data(), p.data(), r.m_dev, Rig::G, Rig::N, r.values(),
                     r.sh);
  expect_h16_is_rounded_gemm_plus_bias(r, x);
  // No f32 h of its own: fc1's bf16-output GEMM passed its f32 products through the owner's dh
  // workspace (fc1_f32), which the activation and the backward never read for h.
  EXPECT_FALSE(r.s.h_NF1) << "--bf16 plans no f32 h";
  if (poison_h32) {  // what another layer's use of the shared workspace leaves there
    for (int64_t i = 0; i < Rig::N * F1; ++i)
      host(r.s.fc1_f32)[i] = std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<float> da(Rig::N * F), dh(Rig::N * F1);
  r.params.zero_grads();
  mlp_backward<float>(r.s, out.dx.data(), out.dp.data(), r.grads(), dy.data(), r.values(), r.sh,
                      da.data(), dh.data());
  for (const Param& q : r.params.params()) {
    const float* g = host(q.grad_as<float>());
    out.params.emplace_back(g, g + q.local_numel());
  }
  return out;
}

TEST(MlpBf16, FcOneOutputIsKeptInBf16AndTheBackwardReadsIt) {
  for (ops::Bf16GemmPath path : testing::runnable_bf16_gemm_paths()) {
    testing::ScopedBf16GemmPath scope(path);
    for (bool widened : {false, true}) {
      for (auto [act, bias] : {std::pair{ops::Activation::SwiGLU, false},
                               std::pair{ops::Activation::GeLU, true}}) {
        SCOPED_TRACE(::testing::Message() << ops::bf16_gemm_path_name(path) << " widened="
                                          << widened << " bias=" << bias);
        const Grads clean = run(act, bias, widened, false);
        const Grads poisoned = run(act, bias, widened, true);
        EXPECT_EQ(clean.y, poisoned.y);
        EXPECT_EQ(clean.dx, poisoned.dx);
        EXPECT_EQ(clean.dp, poisoned.dp);
        ASSERT_EQ(clean.params.size(), poisoned.params.size());
        for (size_t i = 0; i < clean.params.size(); ++i)
          EXPECT_EQ(clean.params[i], poisoned.params[i]) << "parameter " << i;
      }
    }
  }
}

// The planner's view: under --bf16 the kept h is bf16 (2 bytes an element), its f32 form
// workspace.
TEST(MlpBf16, KeptActivationsCountHInBf16) {
  Rig r(ops::Activation::SwiGLU, false, false);
  const int64_t F1 = r.sh.F1(), F = r.sh.F, N = Rig::N;
  // h (bf16), the activation a (bf16 with bf16 weights; widened weights keep its f32 form) and
  // the rig's group sizes, each rounded up to the arena's alignment.
  auto aligned = [](int64_t bytes) {
    return (bytes + int64_t(Arena::kAlign) - 1) / int64_t(Arena::kAlign) * int64_t(Arena::kAlign);
  };
  EXPECT_EQ(int64_t(r.arena.bytes_of(MemKind::Activations)),
            aligned(N * F1 * 2) + aligned(N * F * 2) + aligned(Rig::G * 8));
}

}  // namespace
}  // namespace moecore::nn
