#include "nn/mlp.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/check.h"
#include "ops/activation.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/memory.h"
#include "ops/swiglu.h"

namespace moecore::nn {

// The widened-bf16 path's f32 operands when the weights come widened (Param::data16w):
// [x | dy] rounded from f32 (a and dh are written widened by the activation kernels).
static int64_t widened_elems(int64_t max_rows, MlpShape sh) {
  return max_rows * 2 * sh.H;
}

template <typename T>
void mlp_allocate(MlpSaved<T>& s, Arena& a, int64_t max_rows, MlpShape sh, const char* name,
                  const Param* fc1, const Param* fc2, MlpRecompute recompute, int64_t groups) {
  s.ex = &a.exec();
  s.recompute_fc1 = recompute.fc1;
  s.recompute_act = recompute.fc1 || recompute.act;
  const bool use16 =
      std::is_same_v<T, float> && fc1 != nullptr && fc2 != nullptr && fc1->has_bf16_copy();
  s.gemm16 = use16;
  s.widened = use16 && fc1->has_data16w && fc2->has_data16w;
  s.x_rounded = s.dy_rounded = false;  // until the owner says otherwise
  const int64_t F1 = sh.F1();
  {
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, s.recompute_fc1);
    // --bf16 keeps h in bf16 alone: fc1's bf16-output GEMM writes it; its f32 products pass
    // through the owner's dh workspace (MlpSaved::fc1_f32), so no f32 h is planned.
    if (use16) {
      s.h16_NF1 = a.alloc<bf16>(max_rows * F1, name);
      s.h_NF1 = nullptr;
    } else {
      s.h16_NF1 = nullptr;
      s.h_NF1 = a.alloc<T>(max_rows * F1, name);
    }
  }
  {
    // The activation only feeds fc2: under --bf16 it is kept as the bf16 GEMM input alone.
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, s.recompute_act);
    if (use16 && !s.widened)
      s.a16_NF = a.alloc<bf16>(max_rows * sh.F, name);
    else
      s.a_NF = a.alloc<T>(max_rows * sh.F, name);
  }
  if (use16) {
    s.fc1_16 = fc1->data16;
    s.fc2_16 = fc2->data16;
    s.fc1_16w = fc1->data16w;
    s.fc2_16w = fc2->data16w;
    const int64_t width = std::max(F1, sh.H);
    if (!s.widened) {
      s.ws_a16 = a.alloc<bf16>(max_rows * width, name, MemKind::Workspace);
      s.ws_b16 = a.alloc<bf16>(max_rows * width, name, MemKind::Workspace);
    }
    // The widened-bf16 GEMM path's f32 operands (none on the native path).
    const int threads = omp_get_max_threads();
    int64_t ws32 = 0;
    if (s.widened) {
      ws32 = widened_elems(max_rows, sh);
    } else {
      const Exec& ex = a.exec();
      const int64_t F = sh.F, H = sh.H;
      // fc1 and fc2 forward and data gradients (N, K), then the two weight gradients.
      for (const auto& [n, k] :
           {std::pair{F1, H}, std::pair{H, F}, std::pair{F, H}, std::pair{H, F1}})
        ws32 = std::max(ws32, ops::grouped_gemm_bf16_workspace_elems(ex, max_rows, n, k, threads));
      ws32 = std::max({ws32, ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, max_rows, H, F),
                       ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, max_rows, F1, H)});
    }
    if (ws32 > 0) s.ws32 = a.alloc<float>(ws32, name, MemKind::Workspace);
  }
  // Every grouped GEMM of the MLP reuses one table and workspace (one stream: a call's table is
  // read before the next call's kernel writes it).
  s.gws = {};
  if (const int64_t bytes = ops::grouped_gemm_workspace_bytes(a.exec(), groups); bytes > 0)
    s.gws = {a.alloc<std::byte>(bytes, name, MemKind::Workspace), bytes};
}

namespace {

// The activation's ops: ops/swiglu.h for SwiGLU, ops/activation.h for the element-wise ones,
// each in the form its consumer reads (T, bf16, or bf16 values widened to f32). Under --bf16 they
// read h as the kept bf16 (h16), widened on load: bitwise the f32 forms on widened values.
template <typename T>
void act_fwd(const Exec& ex, MlpShape sh, DevPtr<T> a, DevPtr<const T> h, DevPtr<const T> p,
             int64_t N) {
  if (sh.act == ops::Activation::SwiGLU) return ops::swiglu_forward(ex, a, h, p, N, sh.F);
  ops::activation_forward(ex, sh.act, a, h, p, N, sh.F);
}
void act_fwd_bf16(const Exec& ex, MlpShape sh, DevPtr<bf16> a16, DevPtr<const bf16> h,
                  DevPtr<const float> p, int64_t N) {
  if (sh.act == ops::Activation::SwiGLU) return ops::swiglu_forward_bf16(ex, a16, h, p, N, sh.F);
  ops::activation_forward_bf16(ex, sh.act, a16, h, p, N, sh.F);
}
void act_fwd_bf16w(const Exec& ex, MlpShape sh, DevPtr<float> a, DevPtr<const bf16> h,
                   DevPtr<const float> p, int64_t N) {
  if (sh.act == ops::Activation::SwiGLU) return ops::swiglu_forward_bf16w(ex, a, h, p, N, sh.F);
  ops::activation_forward_bf16w(ex, sh.act, a, h, p, N, sh.F);
}
template <typename T>
void act_bwd(const Exec& ex, MlpShape sh, DevPtr<T> dh, DevPtr<T> dp, DevPtr<const T> da,
             DevPtr<const T> h, DevPtr<const T> p, int64_t N) {
  if (sh.act == ops::Activation::SwiGLU) return ops::swiglu_backward(ex, dh, dp, da, h, p, N, sh.F);
  ops::activation_backward(ex, sh.act, dh, dp, da, h, p, N, sh.F);
}
// dh in f32 from the bf16 h (--bf16 with biases: the fc1 bias gradient reads dh's f32 values).
void act_bwd_h16(const Exec& ex, MlpShape sh, DevPtr<float> dh, DevPtr<float> dp,
                 DevPtr<const float> da, DevPtr<const bf16> h, DevPtr<const float> p, int64_t N) {
  if (sh.act == ops::Activation::SwiGLU) return ops::swiglu_backward(ex, dh, dp, da, h, p, N, sh.F);
  ops::activation_backward(ex, sh.act, dh, dp, da, h, p, N, sh.F);
}
void act_bwd_bf16(const Exec& ex, MlpShape sh, DevPtr<bf16> dh16, DevPtr<float> dp,
                  DevPtr<const float> da, DevPtr<const bf16> h, DevPtr<const float> p, int64_t N) {
  if (sh.act == ops::Activation::SwiGLU)
    return ops::swiglu_backward_bf16(ex, dh16, dp, da, h, p, N, sh.F);
  ops::activation_backward_bf16(ex, sh.act, dh16, dp, da, h, p, N, sh.F);
}
void act_bwd_bf16w(const Exec& ex, MlpShape sh, DevPtr<float> dh, DevPtr<float> dp,
                   DevPtr<const float> da, DevPtr<const bf16> h, DevPtr<const float> p,
                   int64_t N) {
  if (sh.act == ops::Activation::SwiGLU)
    return ops::swiglu_backward_bf16w(ex, dh, dp, da, h, p, N, sh.F);
  ops::activation_backward_bf16w(ex, sh.act, dh, dp, da, h, p, N, sh.F);
}

template <typename P>
void check_biases(const MlpParams<P>& w, MlpShape sh, const char* what) {
  MOE_CHECK((w.fc1_bias != nullptr) == sh.bias &&
                (w.fc2_bias != nullptr) == (sh.bias && sh.fc2_bias_here),
            "[mlp] {}: the biases must be given exactly when the MLP has them (bias={}, fc2's "
            "bias added here={})",
            what, sh.bias, sh.fc2_bias_here);
}

// h = x fc1^T + b1 (the forward's first GEMM; also its recomputation).
template <typename T>
void fc1_forward(const MlpSaved<T>& s, DevPtr<const T> fc1, DevPtr<const T> fc1_bias, MlpShape sh) {
  const int64_t F1 = sh.F1();
  if constexpr (std::is_same_v<T, float>) {
    MOE_CHECK(!s.h16_NF1 || s.fc1_f32,
              "[mlp] --bf16: fc1's f32 products need the owner's dh workspace (MlpSaved::fc1_f32)");
    // --bf16: h written in bf16 by the GEMM, rounded once after the f32 bias (a bf16 D with the
    // bias in the epilogue); the activation and its backward read it so, on both GEMM paths.
    if (s.widened) {  // x rounded straight into f32, one pass (none when it came rounded)
      DevPtr<const float> x32 = s.x_NH;
      if (s.x16_NH) {  // bf16 rows: widened, exact
        ops::cast_bf16_to_f32(*s.ex, s.ws32, s.x16_NH, s.N * sh.H);
        x32 = s.ws32;
      } else if (!s.x_rounded) {
        ops::round_f32_to_bf16(*s.ex, s.ws32, s.x_NH, s.N * sh.H);
        x32 = s.ws32;
      }
      return ops::grouped_gemm_widened_bf16_out(*s.ex, s.m_G, s.G, F1, sh.H, s.N, x32, s.fc1_16w,
                                                true, fc1_bias, s.h16_NF1, s.fc1_f32, s.gws,
                                                s.rows_per_group);
    }
    if (s.fc1_16 != nullptr) {
      DevPtr<const bf16> x16 = s.x16_NH;
      if (!x16) {
        ops::cast_f32_to_bf16(*s.ex, s.ws_a16, s.x_NH, s.N * sh.H);
        x16 = s.ws_a16;
      }
      return ops::grouped_gemm_bf16_out(*s.ex, s.m_G, s.G, F1, sh.H, s.N, x16, s.fc1_16, true,
                                        fc1_bias, s.h16_NF1, s.fc1_f32, s.ws32, s.fc1_16w,
                                        s.gws, s.rows_per_group);
    }
  }
  ops::grouped_gemm(*s.ex, s.m_G, s.G, F1, sh.H, s.x_NH, fc1, /*trans_w=*/true, s.h_NF1, s.gws,
                    s.rows_per_group);
  if (sh.bias) {
    ops::grouped_bias_forward(*s.ex, s.h_NF1, fc1_bias, DevPtr<const T>(nullptr), s.m_G, s.G, F1);
  }
}

// a = act(h) * p, in bf16 when that is what fc2 reads.
template <typename T>
void act_forward(const MlpSaved<T>& s, MlpShape sh) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) return act_fwd_bf16w(*s.ex, sh, s.a_NF, s.h16_NF1, s.p_N, s.N);
    if (s.a16_NF != nullptr) return act_fwd_bf16(*s.ex, sh, s.a16_NF, s.h16_NF1, s.p_N, s.N);
  }
  act_fwd<T>(*s.ex, sh, s.a_NF, s.h_NF1, s.p_N, s.N);
}

// The forward's first half from s's input rows (x_NH, or x16_NH): fc1 and the activation.
template <typename T>
void forward_rows_fc1(MlpSaved<T>& s, DevPtr<const T> p_N, DevPtr<const int64_t> m_G, int64_t G,
                      int64_t N, const MlpParams<DevPtr<const T>>& w, MlpShape sh,
                      int64_t rows_per_group) {
  check_biases(w, sh, "forward");
  MOE_CHECK(rows_per_group >= 0 && (rows_per_group == 0 || rows_per_group * G == N),
            "[mlp] {} rows per group x {} groups != {} rows", rows_per_group, G, N);
  s.p_N = p_N;
  s.m_G = m_G;
  s.G = G;
  s.N = N;
  s.rows_per_group = rows_per_group;
  fc1_forward(s, w.fc1, w.fc1_bias, sh);
  act_forward(s, sh);
}

// Its second half: y = fc2 on the activation s kept (+ its bias).
template <typename T>
void forward_rows_fc2(const MlpSaved<T>& s, DevPtr<T> y_NH, const MlpParams<DevPtr<const T>>& w,
                      MlpShape sh) {
  const DevPtr<const int64_t> m_G = s.m_G;
  const int64_t G = s.G;
  [&] {
    if constexpr (std::is_same_v<T, float>) {
      if (s.widened)
        return ops::grouped_gemm(*s.ex, m_G, G, sh.H, sh.F, s.a_NF, s.fc2_16w, true, y_NH, s.gws,
                                 s.rows_per_group);
      if (s.fc2_16 != nullptr) {
        return ops::grouped_gemm_bf16(*s.ex, m_G, G, sh.H, sh.F, s.a16_NF, s.fc2_16, true, y_NH,
                                      s.ws32, s.fc2_16w, s.gws, s.rows_per_group);
      }
    }
    ops::grouped_gemm(*s.ex, m_G, G, sh.H, sh.F, s.a_NF, w.fc2, /*trans_w=*/true, y_NH, s.gws,
                      s.rows_per_group);
  }();
  // fc2's bias times the row's prob: Megatron's grouped experts add `t + b * p` per expert
  // (megatron/core/transformer/moe/experts.py, TEGroupedMLP._apply_bias), so a token's output
  // is sum_k p_k (a_k fc2_k^T + b2_k) and combine stays a plain sum.
  if (w.fc2_bias != nullptr) ops::grouped_bias_forward(*s.ex, y_NH, w.fc2_bias, s.p_N, m_G, G, sh.H);
}

// The forward from s's input rows (x_NH, or x16_NH).
template <typename T>
void forward_rows(MlpSaved<T>& s, DevPtr<T> y_NH, DevPtr<const T> p_N, DevPtr<const int64_t> m_G,
                  int64_t G, int64_t N, const MlpParams<DevPtr<const T>>& w, MlpShape sh,
                  int64_t rows_per_group) {
  forward_rows_fc1(s, p_N, m_G, G, N, w, sh, rows_per_group);
  forward_rows_fc2(s, y_NH, w, sh);
}

}  // namespace

template <typename T>
void mlp_forward(MlpSaved<T>& s, DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
                 DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                 const MlpParams<DevPtr<const T>>& w, MlpShape sh, int64_t rows_per_group) {
  s.x_NH = x_NH;
  s.x16_NH = nullptr;
  forward_rows(s, y_NH, p_N, m_G, G, N, w, sh, rows_per_group);
}

void mlp_forward(MlpSaved<float>& s, DevPtr<float> y_NH, DevPtr<const bf16> x16_NH,
                 DevPtr<const float> p_N, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                 const MlpParams<DevPtr<const float>>& w, MlpShape sh, int64_t rows_per_group) {
  MOE_CHECK(s.gemm16, "[mlp] bf16 input rows need the weights' bf16 copies (--bf16)");
  s.x_NH = nullptr;
  s.x16_NH = x16_NH;
  forward_rows(s, y_NH, p_N, m_G, G, N, w, sh, rows_per_group);
}

namespace {

// The backward's first half: recomputation, fc2's GEMMs and the activation's backward (dp
// assigned, fc2's gradients and fc1's bias gradient accumulated). It leaves dh for the second
// half: in dh_NF1 (f32 GEMMs, widened or not), in s.ws_a16 (native bf16 GEMMs).
template <typename T>
void backward_fc2(const MlpSaved<T>& s, DevPtr<T> dp_N, const MlpParams<DevPtr<T>>& grad,
                  DevPtr<const T> dy_NH, const MlpParams<DevPtr<const T>>& w, MlpShape sh,
                  DevPtr<T> da_NF, DevPtr<T> dh_NF1, DevPtr<const bf16> dy16_NH) {
  check_biases(w, sh, "backward");
  check_biases(grad, sh, "backward (gradients)");
  MOE_CHECK(!(sh.bias && (s.dy_rounded || dy16_NH)),
            "[mlp] dy arrives rounded to bf16, but fc2's bias gradient needs its f32 values");
  MOE_CHECK(!dy16_NH || s.gemm16, "[mlp] a bf16 dy needs the weights' bf16 copies (--bf16)");
  const int64_t F1 = sh.F1();
  // Recomputation: the forward's arithmetic again, so the values are bitwise the forward's.
  if (s.recompute_fc1) fc1_forward(s, w.fc1, w.fc1_bias, sh);
  if (s.recompute_act) act_forward(s, sh);
  const DevPtr<const T> no_p = nullptr;
  // dh's f32 values, then the fc1 bias gradient from them (before any rounding to bf16).
  auto dh_f32_and_fc1_bias = [&] {
    if constexpr (std::is_same_v<T, float>) {
      if (s.h16_NF1)
        act_bwd_h16(*s.ex, sh, dh_NF1, dp_N, da_NF, s.h16_NF1, s.p_N, s.N);
      else
        act_bwd<T>(*s.ex, sh, dh_NF1, dp_N, da_NF, s.h_NF1, s.p_N, s.N);
    } else {
      act_bwd<T>(*s.ex, sh, dh_NF1, dp_N, da_NF, s.h_NF1, s.p_N, s.N);
    }
    ops::grouped_bias_backward(*s.ex, grad.fc1_bias, DevPtr<T>(nullptr), dh_NF1, w.fc1_bias, no_p,
                               s.m_G, s.G, F1);
  };
  // fc2's bias: db2 += sum p dy, dp += dy . b2 (after the activation assigned dp).
  auto fc2_bias = [&] {
    if (w.fc2_bias == nullptr) return;  // another TP rank adds it
    ops::grouped_bias_backward(*s.ex, grad.fc2_bias, dp_N, dy_NH, w.fc2_bias, s.p_N, s.m_G, s.G,
                               sh.H);
  };
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) {  // f32 GEMMs on bf16 values: dy rounded; dh written so
      DevPtr<const float> dy32 = dy_NH;
      if (dy16_NH) {  // bf16 rows: widened, exact
        ops::cast_bf16_to_f32(*s.ex, s.ws32 + s.N * sh.H, dy16_NH, s.N * sh.H);
        dy32 = s.ws32 + s.N * sh.H;
      } else if (!s.dy_rounded) {
        ops::round_f32_to_bf16(*s.ex, s.ws32 + s.N * sh.H, dy_NH, s.N * sh.H);
        dy32 = s.ws32 + s.N * sh.H;
      }
      ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.F, sh.H, dy32, s.fc2_16w, false, da_NF, s.gws,
                        s.rows_per_group);
      ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, sh.H, sh.F, dy32, s.a_NF, grad.fc2, s.gws,
                              s.rows_per_group);
      if (sh.bias) {
        dh_f32_and_fc1_bias();
        ops::round_f32_to_bf16(*s.ex, dh_NF1, dh_NF1, s.N * F1);  // = the bf16w kernel's output
        fc2_bias();
      } else {
        act_bwd_bf16w(*s.ex, sh, dh_NF1, dp_N, da_NF, s.h16_NF1, s.p_N, s.N);
      }
      return;
    }
    if (s.fc1_16 != nullptr) {  // the same products on bf16 inputs, f32 accumulation
      DevPtr<const bf16> dy16 = dy16_NH;
      if (!dy16) {
        ops::cast_f32_to_bf16(*s.ex, s.ws_a16, dy_NH, s.N * sh.H);
        dy16 = s.ws_a16;
      }
      ops::grouped_gemm_bf16(*s.ex, s.m_G, s.G, sh.F, sh.H, dy16, s.fc2_16, false, da_NF, s.ws32,
                             s.fc2_16w, s.gws, s.rows_per_group);
      ops::grouped_gemm_wgrad_bf16(*s.ex, s.m_G, s.G, sh.H, sh.F, dy16, s.a16_NF, grad.fc2, s.ws32,
                                   s.gws, s.rows_per_group);
      // dh only feeds fc1's GEMMs: written as bf16 straight away (with biases, its f32 values
      // first, for the fc1 bias gradient, then their cast: the bf16 kernel's output bitwise).
      if (sh.bias) {
        dh_f32_and_fc1_bias();
        ops::cast_f32_to_bf16(*s.ex, s.ws_a16, dh_NF1, s.N * F1);
        fc2_bias();
      } else {
        act_bwd_bf16(*s.ex, sh, s.ws_a16, dp_N, da_NF, s.h16_NF1, s.p_N, s.N);
      }
      return;
    }
  }
  // fc2: y = a fc2^T  ->  da = dy fc2 (fc2_g is [H, F] = [K, N] untransposed), dfc2 += dy^T a.
  ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.F, sh.H, dy_NH, w.fc2, /*trans_w=*/false, da_NF, s.gws,
                    s.rows_per_group);
  ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, sh.H, sh.F, dy_NH, s.a_NF, grad.fc2, s.gws,
                          s.rows_per_group);
  if (sh.bias) {
    dh_f32_and_fc1_bias();
    fc2_bias();
  } else {
    act_bwd<T>(*s.ex, sh, dh_NF1, dp_N, da_NF, s.h_NF1, s.p_N, s.N);
  }
}

// The second half: fc1's GEMMs from the dh the first left (dx assigned, fc1's gradient
// accumulated). dy is no longer read: dx may take its memory.
template <typename T>
void backward_fc1(const MlpSaved<T>& s, DevPtr<T> dx_NH, const MlpParams<DevPtr<T>>& grad,
                  const MlpParams<DevPtr<const T>>& w, MlpShape sh, DevPtr<T> dh_NF1) {
  const int64_t F1 = sh.F1();
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) {  // x rounded (dh was written so)
      DevPtr<float> x32 = s.ws32;
      DevPtr<const float> x_in = s.x_NH;
      if (s.x16_NH) {
        ops::cast_bf16_to_f32(*s.ex, x32, s.x16_NH, s.N * sh.H);
        x_in = x32;
      } else if (!s.x_rounded) {
        ops::round_f32_to_bf16(*s.ex, x32, s.x_NH, s.N * sh.H);
        x_in = x32;
      }
      ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.H, F1, dh_NF1, s.fc1_16w, false, dx_NH, s.gws,
                        s.rows_per_group);
      ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, F1, sh.H, dh_NF1, x_in, grad.fc1, s.gws,
                              s.rows_per_group);
      return;
    }
    if (s.fc1_16 != nullptr) {  // dh as bf16 in ws_a16
      DevPtr<const bf16> x16 = s.x16_NH;
      if (!x16) {
        ops::cast_f32_to_bf16(*s.ex, s.ws_b16, s.x_NH, s.N * sh.H);
        x16 = s.ws_b16;
      }
      ops::grouped_gemm_bf16(*s.ex, s.m_G, s.G, sh.H, F1, s.ws_a16, s.fc1_16, false, dx_NH, s.ws32,
                             s.fc1_16w, s.gws, s.rows_per_group);
      ops::grouped_gemm_wgrad_bf16(*s.ex, s.m_G, s.G, F1, sh.H, s.ws_a16, x16, grad.fc1, s.ws32,
                                   s.gws, s.rows_per_group);
      return;
    }
  }
  // fc1: h = x fc1^T  ->  dx = dh fc1, dfc1 += dh^T x.
  ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.H, F1, dh_NF1, w.fc1, /*trans_w=*/false, dx_NH, s.gws,
                    s.rows_per_group);
  ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, F1, sh.H, dh_NF1, s.x_NH, grad.fc1, s.gws,
                          s.rows_per_group);
}

}  // namespace

template <typename T>
void mlp_backward(const MlpSaved<T>& s, DevPtr<T> dx_NH, DevPtr<T> dp_N,
                  const MlpParams<DevPtr<T>>& grad, DevPtr<const T> dy_NH,
                  const MlpParams<DevPtr<const T>>& w, MlpShape sh, DevPtr<T> da_NF,
                  DevPtr<T> dh_NF1, DevPtr<const bf16> dy16_NH) {
  backward_fc2(s, dp_N, grad, dy_NH, w, sh, da_NF, dh_NF1, dy16_NH);
  backward_fc1(s, dx_NH, grad, w, sh, dh_NF1);
}

template <typename T>
MLP<T>::MLP(int64_t hidden, int64_t ffn, ops::Activation act, bool bias, double init_std,
            double out_init_std, ParamRegistry& params, const std::string& prefix, TpShard tp)
    : sh_{hidden, ffn, act, bias} {
  MOE_CHECK(ffn % tp.size == 0,
            "[mlp] '{}': ffn width {} is not divisible by the tensor-parallel size {}; choose an "
            "ffn width that is a multiple of it",
            prefix, ffn, tp.size);
  const int64_t F1 = sh_.F1();          // global
  const int parts = F1 == ffn ? 1 : 2;  // gated: [gate; up]
  sh_.F = ffn / tp.size;                // this rank's share
  sh_.fc2_bias_here = tp.rank == 0;
  const TpRole sharded = tp.sharded();
  fc1_ = &params.add(ParamSpec{prefix + ".linear_fc1.weight",
                               {F1, hidden},
                               ParamInit::Normal,
                               init_std,
                               ParamKind::Dense,
                               true,
                               tp.slice(0, F1, parts),
                               /*bf16_only=*/true,
                               sharded});
  fc2_ = &params.add(ParamSpec{prefix + ".linear_fc2.weight",
                               {hidden, ffn},
                               ParamInit::Normal,
                               out_init_std,
                               ParamKind::Dense,
                               true,
                               tp.slice(1, ffn),
                               /*bf16_only=*/true,
                               sharded});
  if (bias) {
    // Megatron: biases start at zero and take no weight decay.
    fc1_bias_ = &params.add(ParamSpec{prefix + ".linear_fc1.bias",
                                      {F1},
                                      ParamInit::Zeros,
                                      0.0,
                                      ParamKind::Dense,
                                      false,
                                      tp.slice(0, F1, parts),
                                      false,
                                      sharded});
    fc2_bias_ = &params.add(ParamSpec{prefix + ".linear_fc2.bias",
                                      {hidden},
                                      ParamInit::Zeros,
                                      0.0,
                                      ParamKind::Dense,
                                      false,
                                      {},
                                      false,
                                      tp.partial()});
  }
}

template <typename T>
void MLP<T>::output_grad_rounded() {
  MOE_CHECK(!sh_.bias, "[mlp] with biases dy must arrive in f32 (fc2's bias gradient sums it)");
  saved_.dy_rounded = saved_.widened;
}

template <typename T>
MlpParams<DevPtr<const T>> MLP<T>::values() const {
  return mlp_values<T>(*fc1_, *fc2_, fc1_bias_, sh_.fc2_bias_here ? fc2_bias_ : nullptr);
}

template <typename T>
void MLP<T>::allocate(Arena& a, int64_t max_tokens, bool recompute) {
  mlp_allocate(saved_, a, max_tokens, sh_, "mlp.saved", fc1_, fc2_,
               MlpRecompute{recompute, recompute});
  da_ = a.alloc<T>(max_tokens * sh_.F, "mlp.da", MemKind::Workspace);
  dh_ = a.alloc<T>(max_tokens * sh_.F1(), "mlp.dh", MemKind::Workspace);
  saved_.fc1_f32 = saved_.h16_NF1 ? dh_ : nullptr;
  rows_dev_ = a.alloc<int64_t>(1, "mlp.rows", MemKind::State);
}

template <typename T>
void MLP<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok) {
  forward_fc1(x_TH, n_tok);
  forward_fc2(y_TH);
}

template <typename T>
void MLP<T>::forward_fc1(DevPtr<const T> x_TH, int64_t n_tok) {
  // One group of n_tok rows, known here: the CUDA GEMMs take it from the host, the CPU's and the
  // bias ops from memory, written when it changes (the first forward, in the warm-up step before
  // any CUDA graph capture: a capture cannot copy from this pageable host value).
  if (n_tok != rows_) {
    rows_ = n_tok;
    ops::copy<int64_t>(*saved_.ex, rows_dev_, &rows_, 1);
  }
  saved_.x_NH = x_TH;
  saved_.x16_NH = nullptr;
  forward_rows_fc1(saved_, DevPtr<const T>(nullptr), DevPtr<const int64_t>(rows_dev_), 1, n_tok,
                   values(), sh_, n_tok);
}

template <typename T>
void MLP<T>::forward_fc2(DevPtr<T> y_TH) {
  forward_rows_fc2(saved_, y_TH, values(), sh_);
}

template <typename T>
void MLP<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH) {
  backward_fc2(dy_TH);
  backward_fc1(dx_TH);
}

template <typename T>
void MLP<T>::backward_fc2(DevPtr<const T> dy_TH) {
  const MlpParams<DevPtr<T>> grad =
      mlp_grads<T>(*fc1_, *fc2_, fc1_bias_, sh_.fc2_bias_here ? fc2_bias_ : nullptr);
  nn::backward_fc2(saved_, DevPtr<T>(nullptr), grad, dy_TH, values(), sh_, da_, dh_,
                   DevPtr<const bf16>(nullptr));
}

template <typename T>
void MLP<T>::backward_fc1(DevPtr<T> dx_TH) {
  const MlpParams<DevPtr<T>> grad =
      mlp_grads<T>(*fc1_, *fc2_, fc1_bias_, sh_.fc2_bias_here ? fc2_bias_ : nullptr);
  nn::backward_fc1(saved_, dx_TH, grad, values(), sh_, dh_);
}

#define MOECORE_INSTANTIATE(T)                                                                \
  template void mlp_allocate<T>(MlpSaved<T>&, Arena&, int64_t, MlpShape, const char*,         \
                                const Param*, const Param*, MlpRecompute, int64_t);           \
  template void mlp_forward<T>(MlpSaved<T>&, DevPtr<T>, DevPtr<const T>, DevPtr<const T>,     \
                               DevPtr<const int64_t>, int64_t, int64_t,                       \
                               const MlpParams<DevPtr<const T>>&, MlpShape, int64_t);         \
  template void mlp_backward<T>(                                                              \
      const MlpSaved<T>&, DevPtr<T>, DevPtr<T>, const MlpParams<DevPtr<T>>&, DevPtr<const T>, \
      const MlpParams<DevPtr<const T>>&, MlpShape, DevPtr<T>, DevPtr<T>, DevPtr<const bf16>); \
  template class MLP<T>;
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::nn
