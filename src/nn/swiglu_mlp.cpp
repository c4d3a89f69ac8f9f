#include "nn/swiglu_mlp.h"

#include <omp.h>

#include <algorithm>
#include <utility>
#include <type_traits>

#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/memory.h"
#include "ops/swiglu.h"

namespace moecore::nn {

// The widened-bf16 path's f32 operands when the weights come widened (Param::data16w):
// [x | dy] rounded from f32 (a and dh are written widened by the SwiGLU kernels).
static int64_t widened_elems(int64_t max_rows, SwigluMlpShape sh) {
  return max_rows * 2 * sh.H;
}

template <typename T>
void swiglu_mlp_allocate(SwigluMlpSaved<T>& s, Arena& a, int64_t max_rows, SwigluMlpShape sh,
                         const char* name, const Param* fc1, const Param* fc2,
                         SwigluRecompute recompute) {
  s.ex = &a.exec();
  s.recompute_fc1 = recompute.fc1;
  s.recompute_act = recompute.fc1 || recompute.act;
  const bool use16 =
      std::is_same_v<T, float> && fc1 != nullptr && fc2 != nullptr && fc1->has_bf16_copy();
  s.widened = use16 && fc1->has_data16w && fc2->has_data16w;
  s.x_rounded = s.dy_rounded = false;  // until the owner says otherwise
  {
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, s.recompute_fc1);
    s.h_N2F = a.alloc<T>(max_rows * 2 * sh.F, name);
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
    const int64_t width = std::max(2 * sh.F, sh.H);
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
      const int64_t F = sh.F, F2 = 2 * sh.F, H = sh.H;
      // fc1 and fc2 forward and data gradients (N, K), then the two weight gradients.
      for (const auto& [n, k] :
           {std::pair{F2, H}, std::pair{H, F}, std::pair{F, H}, std::pair{H, F2}})
        ws32 = std::max(ws32, ops::grouped_gemm_bf16_workspace_elems(ex, max_rows, n, k, threads));
      ws32 = std::max({ws32, ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, max_rows, H, F),
                       ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, max_rows, F2, H)});
    }
    if (ws32 > 0) s.ws32 = a.alloc<float>(ws32, name, MemKind::Workspace);
  }
}

namespace {

// h = x fc1^T (the forward's first GEMM; also its recomputation).
template <typename T>
void fc1_forward(const SwigluMlpSaved<T>& s, DevPtr<const T> fc1, SwigluMlpShape sh) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) {  // x rounded straight into f32, one pass (none when it came rounded)
      DevPtr<const float> x32 = s.x_NH;
      if (!s.x_rounded) {
        ops::round_f32_to_bf16(*s.ex, s.ws32, s.x_NH, s.N * sh.H);
        x32 = s.ws32;
      }
      return ops::grouped_gemm(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, x32, s.fc1_16w, true, s.h_N2F);
    }
    if (s.fc1_16 != nullptr) {
      ops::cast_f32_to_bf16(*s.ex, s.ws_a16, s.x_NH, s.N * sh.H);
      ops::grouped_gemm_bf16(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, s.ws_a16, s.fc1_16, true, s.h_N2F,
                             s.ws32, s.fc1_16w);
      return;
    }
  }
  ops::grouped_gemm(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, s.x_NH, fc1, /*trans_w=*/true, s.h_N2F);
}

// a = silu(gate) * up * p, in bf16 when that is what fc2 reads.
template <typename T>
void act_forward(const SwigluMlpSaved<T>& s, SwigluMlpShape sh) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) return ops::swiglu_forward_bf16w(*s.ex, s.a_NF, s.h_N2F, s.p_N, s.N, sh.F);
    if (s.a16_NF != nullptr)
      return ops::swiglu_forward_bf16(*s.ex, s.a16_NF, s.h_N2F, s.p_N, s.N, sh.F);
  }
  ops::swiglu_forward(*s.ex, s.a_NF, s.h_N2F, s.p_N, s.N, sh.F);
}

}  // namespace

template <typename T>
void swiglu_mlp_forward(SwigluMlpSaved<T>& s, DevPtr<T> y_NH, DevPtr<const T> x_NH,
                        DevPtr<const T> p_N, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                        DevPtr<const T> fc1, DevPtr<const T> fc2, SwigluMlpShape sh) {
  s.x_NH = x_NH;
  s.p_N = p_N;
  s.m_G = m_G;
  s.G = G;
  s.N = N;
  fc1_forward(s, fc1, sh);
  act_forward(s, sh);
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened)
      return ops::grouped_gemm(*s.ex, m_G, G, sh.H, sh.F, s.a_NF, s.fc2_16w, true, y_NH);
    if (s.fc2_16 != nullptr) {
      return ops::grouped_gemm_bf16(*s.ex, m_G, G, sh.H, sh.F, s.a16_NF, s.fc2_16, true, y_NH,
                                    s.ws32, s.fc2_16w);
    }
  }
  ops::grouped_gemm(*s.ex, m_G, G, sh.H, sh.F, s.a_NF, fc2, /*trans_w=*/true, y_NH);
}

template <typename T>
void swiglu_mlp_backward(const SwigluMlpSaved<T>& s, DevPtr<T> dx_NH, DevPtr<T> dp_N,
                         DevPtr<T> dfc1, DevPtr<T> dfc2, DevPtr<const T> dy_NH, DevPtr<const T> fc1,
                         DevPtr<const T> fc2, SwigluMlpShape sh, DevPtr<T> da_NF,
                         DevPtr<T> dh_N2F) {
  // Recomputation: the forward's arithmetic again, so the values are bitwise the forward's.
  if (s.recompute_fc1) fc1_forward(s, fc1, sh);
  if (s.recompute_act) act_forward(s, sh);
  if constexpr (std::is_same_v<T, float>) {
    if (s.widened) {  // f32 GEMMs on bf16 values: dy, x rounded; a, dh written so by SwiGLU
      DevPtr<float> x32 = s.ws32;
      DevPtr<const float> dy32 = dy_NH;
      if (!s.dy_rounded) {
        ops::round_f32_to_bf16(*s.ex, s.ws32 + s.N * sh.H, dy_NH, s.N * sh.H);
        dy32 = s.ws32 + s.N * sh.H;
      }
      ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.F, sh.H, dy32, s.fc2_16w, false, da_NF);
      ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, sh.H, sh.F, dy32, s.a_NF, dfc2);
      ops::swiglu_backward_bf16w(*s.ex, dh_N2F, dp_N, da_NF, s.h_N2F, s.p_N, s.N, sh.F);
      DevPtr<const float> x_in = s.x_NH;
      if (!s.x_rounded) {
        ops::round_f32_to_bf16(*s.ex, x32, s.x_NH, s.N * sh.H);
        x_in = x32;
      }
      ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.H, 2 * sh.F, dh_N2F, s.fc1_16w, false, dx_NH);
      ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, dh_N2F, x_in, dfc1);
      return;
    }
    if (s.fc1_16 != nullptr) {  // the same products on bf16 inputs, f32 accumulation
      ops::cast_f32_to_bf16(*s.ex, s.ws_a16, dy_NH, s.N * sh.H);
      ops::grouped_gemm_bf16(*s.ex, s.m_G, s.G, sh.F, sh.H, s.ws_a16, s.fc2_16, false, da_NF,
                             s.ws32, s.fc2_16w);
      ops::grouped_gemm_wgrad_bf16(*s.ex, s.m_G, s.G, sh.H, sh.F, s.ws_a16, s.a16_NF, dfc2, s.ws32);
      // dh only feeds fc1's GEMMs: written as bf16 straight away.
      ops::swiglu_backward_bf16(*s.ex, s.ws_a16, dp_N, da_NF, s.h_N2F, s.p_N, s.N, sh.F);
      ops::cast_f32_to_bf16(*s.ex, s.ws_b16, s.x_NH, s.N * sh.H);
      ops::grouped_gemm_bf16(*s.ex, s.m_G, s.G, sh.H, 2 * sh.F, s.ws_a16, s.fc1_16, false, dx_NH,
                             s.ws32, s.fc1_16w);
      ops::grouped_gemm_wgrad_bf16(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, s.ws_a16, s.ws_b16, dfc1,
                                   s.ws32);
      return;
    }
  }
  // fc2: y = a fc2^T  ->  da = dy fc2 (fc2_g is [H, F] = [K, N] untransposed), dfc2 += dy^T a.
  ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.F, sh.H, dy_NH, fc2, /*trans_w=*/false, da_NF);
  ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, sh.H, sh.F, dy_NH, s.a_NF, dfc2);
  ops::swiglu_backward(*s.ex, dh_N2F, dp_N, da_NF, s.h_N2F, s.p_N, s.N, sh.F);
  // fc1: h = x fc1^T  ->  dx = dh fc1, dfc1 += dh^T x.
  ops::grouped_gemm(*s.ex, s.m_G, s.G, sh.H, 2 * sh.F, dh_N2F, fc1, /*trans_w=*/false, dx_NH);
  ops::grouped_gemm_wgrad(*s.ex, s.m_G, s.G, 2 * sh.F, sh.H, dh_N2F, s.x_NH, dfc1);
}

template <typename T>
MLP<T>::MLP(int64_t hidden, int64_t ffn, double init_std, double out_init_std,
            ParamRegistry& params, const std::string& prefix)
    : sh_{hidden, ffn} {
  fc1_ = &params.add(ParamSpec{prefix + ".linear_fc1.weight",
                               {2 * ffn, hidden},
                               ParamInit::Normal,
                               init_std,
                               ParamKind::Dense,
                               true,
                               {}});
  fc2_ = &params.add(ParamSpec{prefix + ".linear_fc2.weight",
                               {hidden, ffn},
                               ParamInit::Normal,
                               out_init_std,
                               ParamKind::Dense,
                               true,
                               {}});
}

template <typename T>
void MLP<T>::allocate(Arena& a, int64_t max_tokens, bool recompute) {
  swiglu_mlp_allocate(saved_, a, max_tokens, sh_, "mlp.saved", fc1_, fc2_,
                      SwigluRecompute{recompute, recompute});
  da_ = a.alloc<T>(max_tokens * sh_.F, "mlp.da", MemKind::Workspace);
  dh_ = a.alloc<T>(max_tokens * 2 * sh_.F, "mlp.dh", MemKind::Workspace);
  rows_dev_ = a.alloc<int64_t>(1, "mlp.rows", MemKind::State);
}

template <typename T>
void MLP<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok) {
  // One group of n_tok rows: the grouped GEMMs read the group size from memory.
  rows_ = n_tok;
  ops::copy<int64_t>(*saved_.ex, rows_dev_, &rows_, 1);
  swiglu_mlp_forward(saved_, y_TH, x_TH, DevPtr<const T>(nullptr), rows_dev_, 1, n_tok,
                     fc1_->data_as<T>(), fc2_->data_as<T>(), sh_);
}

template <typename T>
void MLP<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH) {
  swiglu_mlp_backward(saved_, dx_TH, DevPtr<T>(nullptr), fc1_->grad_as<T>(), fc2_->grad_as<T>(),
                      dy_TH, fc1_->data_as<T>(), fc2_->data_as<T>(), sh_, da_, dh_);
}

#define MOECORE_INSTANTIATE(T)                                                                    \
  template void swiglu_mlp_allocate<T>(SwigluMlpSaved<T>&, Arena&, int64_t, SwigluMlpShape,       \
                                       const char*, const Param*, const Param*, SwigluRecompute); \
  template void swiglu_mlp_forward<T>(SwigluMlpSaved<T>&, DevPtr<T>, DevPtr<const T>,             \
                                      DevPtr<const T>, DevPtr<const int64_t>, int64_t, int64_t,   \
                                      DevPtr<const T>, DevPtr<const T>, SwigluMlpShape);          \
  template void swiglu_mlp_backward<T>(const SwigluMlpSaved<T>&, DevPtr<T>, DevPtr<T>, DevPtr<T>, \
                                       DevPtr<T>, DevPtr<const T>, DevPtr<const T>,               \
                                       DevPtr<const T>, SwigluMlpShape, DevPtr<T>, DevPtr<T>);    \
  template class MLP<T>;
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::nn
