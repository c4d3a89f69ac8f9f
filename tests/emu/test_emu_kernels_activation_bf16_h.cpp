// The MLP activation kernels' bf16-h forms (src/ops/cuda/swiglu.cu, activation.cu: --bf16 keeps
// fc1's output in bf16) in the grid emulator: every output bitwise the f32-h kernel's on the
// widened h (dp's block tree included), in every resume order, NaN-poisoned guarded outputs
// written exactly; the forwards' 16-byte-load kernels (F % 8 == 0, h 16-byte aligned) and their
// one-element form (an h that is not 16-byte aligned) alike.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "emu/emu_testing.h"
#include "ops/activation.h"
#include "ops/cast.h"
#include "ops/swiglu.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using ops::Activation;
using testing::Guarded;
using testing::random_vec;

// h's forms: f32 (the widened values) or bf16 (the kept ones).
template <typename H>
void fwd16(Activation act, bf16* a, const H* h, const float* p, int64_t N, int64_t F) {
  if (act == Activation::SwiGLU) return ops::cuda::swiglu_forward_bf16(nullptr, a, h, p, N, F);
  ops::cuda::activation_forward_bf16(nullptr, act, a, h, p, N, F);
}
template <typename H>
void fwd16w(Activation act, float* a, const H* h, const float* p, int64_t N, int64_t F) {
  if (act == Activation::SwiGLU) return ops::cuda::swiglu_forward_bf16w(nullptr, a, h, p, N, F);
  ops::cuda::activation_forward_bf16w(nullptr, act, a, h, p, N, F);
}
template <typename H>
void bwd32(Activation act, float* dh, float* dp, const float* da, const H* h, const float* p,
           int64_t N, int64_t F) {
  if (act == Activation::SwiGLU)
    return ops::cuda::swiglu_backward(nullptr, dh, dp, da, h, p, N, F);
  ops::cuda::activation_backward(nullptr, act, dh, dp, da, h, p, N, F);
}
template <typename H>
void bwd16(Activation act, bf16* dh, float* dp, const float* da, const H* h, const float* p,
           int64_t N, int64_t F) {
  if (act == Activation::SwiGLU)
    return ops::cuda::swiglu_backward_bf16(nullptr, dh, dp, da, h, p, N, F);
  ops::cuda::activation_backward_bf16(nullptr, act, dh, dp, da, h, p, N, F);
}
template <typename H>
void bwd16w(Activation act, float* dh, float* dp, const float* da, const H* h, const float* p,
            int64_t N, int64_t F) {
  if (act == Activation::SwiGLU)
    return ops::cuda::swiglu_backward_bf16w(nullptr, dh, dp, da, h, p, N, F);
  ops::cuda::activation_backward_bf16w(nullptr, act, dh, dp, da, h, p, N, F);
}

// Every output of the five forms, NaN-poisoned and guarded, as bytes (dp when asked for).
template <typename H>
std::vector<unsigned char> run_all(Activation act, const H* h, const float* da, const float* p,
                                   int64_t N, int64_t F, int64_t W, bool* intact) {
  Guarded<uint16_t> a16(N * F, 0x7fc1), dh16(N * W, 0x7fc1);  // bf16 NaN bits
  Guarded<float> aw(N * F, NAN), dh(N * W, NAN), dhw(N * W, NAN);
  Guarded<float> dp(N, NAN), dp16(N, NAN), dpw(N, NAN);
  fwd16(act, reinterpret_cast<bf16*>(a16.data()), h, p, N, F);
  fwd16w(act, aw.data(), h, p, N, F);
  bwd32(act, dh.data(), dp.data(), da, h, p, N, F);
  bwd16(act, reinterpret_cast<bf16*>(dh16.data()), dp16.data(), da, h, p, N, F);
  bwd16w(act, dhw.data(), dpw.data(), da, h, p, N, F);
  *intact = a16.intact() && dh16.intact() && aw.intact() && dh.intact() && dhw.intact() &&
            dp.intact() && dp16.intact() && dpw.intact();
  std::vector<unsigned char> out = bytes_of(a16.data(), size_t(N * F));
  auto add = [&](const auto& b) { out.insert(out.end(), b.begin(), b.end()); };
  add(bytes_of(dh16.data(), size_t(N * W)));
  for (const Guarded<float>* g : {&aw, &dh, &dhw, &dp, &dp16, &dpw})
    add(bytes_of(g->data(), size_t(g->size())));
  return out;
}

// 16 bytes of storage: h16's buffer starts at a 16-byte boundary.
struct alignas(16) Chunk16 {
  uint16_t bits[8];
};

void check(Activation act, int64_t N, int64_t F, bool with_p, bool aligned) {
  SCOPED_TRACE(std::string(ops::activation_name(act)) + " rows=" + std::to_string(N) +
               " F=" + std::to_string(F) + (with_p ? " with p" : " p null") +
               (aligned ? "" : " h not 16-byte aligned"));
  const int64_t W = ops::activation_fc1_width(act, F);
  const std::vector<float> h32 = random_vec<float>(N * W, 71, -6.0, 6.0);
  // h16 at a 16-byte boundary of its buffer, or one element after it.
  std::vector<Chunk16> store(size_t((N * W + 8) / 8 + 1));
  bf16* h16 = reinterpret_cast<bf16*>(store.data()) + (aligned ? 0 : 1);
  ops::cast_f32_to_bf16(cpu_exec(), h16, h32.data(), N * W);
  std::vector<float> hw(size_t(N * W));
  ops::cast_bf16_to_f32(cpu_exec(), hw.data(), h16, N * W);
  const std::vector<float> da = random_vec<float>(N * F, 72);
  const std::vector<float> p_vals = random_vec<float>(N, 73, 0.1, 1.0);
  const float* p = with_p ? p_vals.data() : nullptr;

  bool intact_w = false, intact = false;
  const std::vector<unsigned char> want = run_all(act, hw.data(), da.data(), p, N, F, W, &intact_w);
  std::vector<unsigned char> got;
  EXPECT_EQ(order_dependence([&] {
              got = run_all(act, static_cast<const bf16*>(h16), da.data(), p, N, F, W, &intact);
              return got;
            }),
            "");
  EXPECT_TRUE(intact_w && intact) << "an output written outside its elements";
  ASSERT_EQ(got.size(), want.size());
  // (Compared as vectors: the shapes without elements give empty ones, whose data() may be null,
  // which memcmp must not be given.)
  EXPECT_TRUE(got == want) << "the bf16-h forms differ from the f32-h forms on the widened h";
}

// F % 8 == 0 (the forwards' 16-byte loads): one step, a block's worth (256 x 8) and over it;
// F not a multiple of 8, of the warp, over the block; F = 0; no rows.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {1, 8}, {3, 40}, {2, 2056}, {1, 1}, {3, 5}, {4, 257}, {3, 0}, {0, 8}};

TEST(EmuKernelsActivationBf16H, BitwiseTheF32FormsOnWidenedHInEveryOrder) {
  for (Activation act :
       {Activation::SwiGLU, Activation::GeLU, Activation::GeLUTanh, Activation::SquaredReLU}) {
    for (auto [N, F] : kShapes) {
      for (bool with_p : {true, false}) {
        check(act, N, F, with_p, /*aligned=*/true);
        if (F % 8 == 0 && N * F > 0) check(act, N, F, with_p, /*aligned=*/false);
      }
    }
  }
}

}  // namespace
}  // namespace moecore
