// The MLP activations' forms that read h in bf16 (--bf16 keeps fc1's output so): every output
// bitwise the f32-h form's on the widened h (what the MLP computed before it kept h in bf16, so
// training digests do not move), dp included, guard bytes intact; and the f32 outputs within
// f32's tolerance of the plain-loop reference on the widened h.
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.h"
#include "ops/activation.h"
#include "ops/cast.h"
#include "ops/swiglu.h"

namespace moecore::testing {
namespace {

using ops::Activation;

// N = 0, one row, F not a multiple of 8 or 16 (the dp lanes' tail), a parallel shape.
const std::pair<int64_t, int64_t> kShapes[] = {{0, 5}, {1, 1}, {3, 7}, {13, 37}, {64, 300}};

// The ten calls of one activation: the f32-h forms and the bf16-h forms (W: h's row width).
struct Forms {
  int64_t W;
  Activation act;
  bool gated() const { return act == Activation::SwiGLU; }
  void fwd16(bf16* a, const float* h, const float* p, int64_t N, int64_t F) const {
    if (gated()) return ops::swiglu_forward_bf16(cpu_exec(), a, h, p, N, F);
    ops::activation_forward_bf16(cpu_exec(), act, a, h, p, N, F);
  }
  void fwd16(bf16* a, const bf16* h, const float* p, int64_t N, int64_t F) const {
    if (gated()) return ops::swiglu_forward_bf16(cpu_exec(), a, h, p, N, F);
    ops::activation_forward_bf16(cpu_exec(), act, a, h, p, N, F);
  }
  template <typename H>
  void fwd16w(float* a, const H* h, const float* p, int64_t N, int64_t F) const {
    if (gated()) return ops::swiglu_forward_bf16w(cpu_exec(), a, h, p, N, F);
    ops::activation_forward_bf16w(cpu_exec(), act, a, h, p, N, F);
  }
  template <typename H>
  void bwd32(float* dh, float* dp, const float* da, const H* h, const float* p, int64_t N,
             int64_t F) const {
    if constexpr (std::is_same_v<H, float>) {  // the templates: T not deducible from pointers
      if (gated()) return ops::swiglu_backward<float>(cpu_exec(), dh, dp, da, h, p, N, F);
      ops::activation_backward<float>(cpu_exec(), act, dh, dp, da, h, p, N, F);
    } else {
      if (gated()) return ops::swiglu_backward(cpu_exec(), dh, dp, da, h, p, N, F);
      ops::activation_backward(cpu_exec(), act, dh, dp, da, h, p, N, F);
    }
  }
  template <typename H>
  void bwd16(bf16* dh, float* dp, const float* da, const H* h, const float* p, int64_t N,
             int64_t F) const {
    if (gated()) return ops::swiglu_backward_bf16(cpu_exec(), dh, dp, da, h, p, N, F);
    ops::activation_backward_bf16(cpu_exec(), act, dh, dp, da, h, p, N, F);
  }
  template <typename H>
  void bwd16w(float* dh, float* dp, const float* da, const H* h, const float* p, int64_t N,
              int64_t F) const {
    if (gated()) return ops::swiglu_backward_bf16w(cpu_exec(), dh, dp, da, h, p, N, F);
    ops::activation_backward_bf16w(cpu_exec(), act, dh, dp, da, h, p, N, F);
  }
  void ref_fwd(float* a, const bf16* h, const float* p, int64_t N, int64_t F) const {
    if (gated()) return ops::swiglu_forward_ref(a, h, p, N, F);
    ops::activation_forward_ref(act, a, h, p, N, F);
  }
  void ref_bwd(float* dh, float* dp, const float* da, const bf16* h, const float* p, int64_t N,
               int64_t F) const {
    if (gated()) return ops::swiglu_backward_ref(dh, dp, da, h, p, N, F);
    ops::activation_backward_ref(act, dh, dp, da, h, p, N, F);
  }
};

template <typename T, typename U>
bool same_bytes(const Guarded<T>& a, const std::vector<U>& b) {
  static_assert(sizeof(T) == sizeof(U));
  return a.size() == int64_t(b.size()) &&
         (b.empty() || std::memcmp(a.data(), b.data(), b.size() * sizeof(U)) == 0);
}
bf16* as_bf16(Guarded<uint16_t>& g) { return reinterpret_cast<bf16*>(g.data()); }

void check(Activation act) {
  SCOPED_TRACE(ops::activation_name(act));
  for (auto [N, F] : kShapes) {
    for (bool with_p : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " F=" << F << " p=" << with_p);
      const Forms fm{ops::activation_fc1_width(act, F), act};
      const int64_t W = fm.W;
      const auto h32 = random_vec<float>(N * W, 21, -6, 6);
      std::vector<bf16> h16(size_t(N * W));
      std::vector<float> hw(size_t(N * W));
      ops::cast_f32_to_bf16(cpu_exec(), h16.data(), h32.data(), N * W);
      ops::cast_bf16_to_f32(cpu_exec(), hw.data(), h16.data(), N * W);
      const auto p_vals = random_vec<float>(N, 22, 0, 1);
      const auto da = random_vec<float>(N * F, 23);
      const float* p = with_p ? p_vals.data() : nullptr;

      // The f32-h forms on the widened h: what the bf16-h forms must write, bit for bit.
      std::vector<bf16> a16_w(size_t(N * F)), dh16_w(size_t(N * W));
      std::vector<float> aw_w(size_t(N * F)), dh_w(size_t(N * W)), dhw_w(size_t(N * W));
      std::vector<float> dp_w(size_t(N), -1.f), dp16_w(size_t(N), -1.f), dpw_w(size_t(N), -1.f);
      fm.fwd16(a16_w.data(), hw.data(), p, N, F);
      fm.fwd16w(aw_w.data(), hw.data(), p, N, F);
      fm.bwd32(dh_w.data(), dp_w.data(), da.data(), hw.data(), p, N, F);
      fm.bwd16(dh16_w.data(), dp16_w.data(), da.data(), hw.data(), p, N, F);
      fm.bwd16w(dhw_w.data(), dpw_w.data(), da.data(), hw.data(), p, N, F);

      Guarded<uint16_t> a16(N * F), dh16(N * W);  // bf16 bits
      Guarded<float> aw(N * F), dh(N * W), dhw(N * W), dp(N, -1.f), dp16(N, -1.f), dpw(N, -1.f);
      fm.fwd16(as_bf16(a16), h16.data(), p, N, F);
      fm.fwd16w(aw.data(), h16.data(), p, N, F);
      fm.bwd32(dh.data(), dp.data(), da.data(), h16.data(), p, N, F);
      fm.bwd16(as_bf16(dh16), dp16.data(), da.data(), h16.data(), p, N, F);
      fm.bwd16w(dhw.data(), dpw.data(), da.data(), h16.data(), p, N, F);
      EXPECT_TRUE(same_bytes(a16, a16_w)) << "a (bf16)";
      EXPECT_TRUE(same_bytes(aw, aw_w)) << "a (widened)";
      EXPECT_TRUE(same_bytes(dh, dh_w)) << "dh (f32)";
      EXPECT_TRUE(same_bytes(dh16, dh16_w)) << "dh (bf16)";
      EXPECT_TRUE(same_bytes(dhw, dhw_w)) << "dh (widened)";
      EXPECT_TRUE(same_bytes(dp, dp_w)) << "dp (f32 dh)";  // -1 where p is null: unwritten
      EXPECT_TRUE(same_bytes(dp16, dp16_w)) << "dp (bf16 dh)";
      EXPECT_TRUE(same_bytes(dpw, dpw_w)) << "dp (widened dh)";
      for (const auto* g : {&aw, &dh, &dhw, &dp, &dp16, &dpw}) EXPECT_TRUE(g->intact());
      EXPECT_TRUE(a16.intact());
      EXPECT_TRUE(dh16.intact());

      // Against the oracle on the widened h: f32's tolerance for the f32 outputs.
      Guarded<float> a_r(N * F), dh_r(N * W), dp_r(N);
      fm.ref_fwd(a_r.data(), h16.data(), p, N, F);
      fm.ref_bwd(dh_r.data(), dp_r.data(), da.data(), h16.data(), p, N, F);
      std::vector<float> a32(size_t(N * F));
      if (fm.gated())
        ops::swiglu_forward<float>(cpu_exec(), a32.data(), hw.data(), p, N, F);
      else
        ops::activation_forward<float>(cpu_exec(), act, a32.data(), hw.data(), p, N, F);
      EXPECT_TRUE(all_close(a32, a_r.vec(), kF32Rtol, kF32Atol)) << "a";
      EXPECT_TRUE(all_close(dh.vec(), dh_r.vec(), kF32Rtol, kF32Atol)) << "dh";
      if (with_p) {
        EXPECT_TRUE(all_close(dp.vec(), dp_r.vec(), kF32Rtol, kF32Atol)) << "dp";
      }
    }
  }
}

TEST(ActivationBf16H, SwigluIsTheF32FormOnWidenedH) { check(Activation::SwiGLU); }
TEST(ActivationBf16H, ElementwiseAreTheF32FormsOnWidenedH) {
  for (Activation act : {Activation::GeLU, Activation::GeLUTanh, Activation::SquaredReLU})
    check(act);
}

}  // namespace
}  // namespace moecore::testing
