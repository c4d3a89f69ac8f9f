// Output head + cross entropy fast path, chunked over tokens: per chunk one GEMM for the logits
// into the [chunk, V] workspace, row-wise log-sum-exp (OpenMP over rows, exp sums in f64), and in
// the backward two more GEMMs (dh = dlogits W, dW += dlogits^T h). Peak memory is the workspace,
// never [T, V] logits. Each row is a max pass and one exp pass (forward) or one exp pass that
// writes the gradient (backward, in bf16 straight into the GEMM input); rows are independent, so
// results do not depend on the thread count.
#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>
#include <type_traits>

#include "core/check.h"
#include "ops/cast.h"
#include "ops/cpu/fast_exp.h"
#include "ops/cpu/row_max.h"
#include "ops/cross_entropy.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;

void check_args(const HeadLossShape& s, const int32_t* target_T, const void* workspace) {
  MOE_CHECK(s.n_tok >= 0 && s.H >= 1 && s.V >= 1 && s.chunk >= 1,
            "[head_loss] bad shape n_tok={} H={} V={} chunk={}: all but n_tok must be >= 1",
            s.n_tok, s.H, s.V, s.chunk);
  MOE_CHECK(workspace != nullptr || s.n_tok == 0,
            "[head_loss] null workspace: allocate head_loss_workspace_elems(shape) = {} elements",
            head_loss_workspace_elems(s));
  for (int64_t t = 0; t < s.n_tok; ++t) {
    MOE_CHECK(target_T[t] < s.V,
              "[head_loss] target {} at position {} >= V={}: the data and --vocab-size disagree",
              target_T[t], t, s.V);
  }
}

// The bf16 operands' addresses, unwrapped once at the op's entry.
struct RawHeadBf16 {
  const bf16* w_VH;
  bf16* h16;
  bf16* dz16;
  float* ws32;
  const float* w_VH_wide;
  float* h32;
};
std::optional<RawHeadBf16> unwrap(const HeadLossBf16* b) {
  if (b == nullptr) return std::nullopt;
  return RawHeadBf16{raw_ptr(b->w_VH), raw_ptr(b->h16),       raw_ptr(b->dz16),
                     raw_ptr(b->ws32), raw_ptr(b->w_VH_wide), raw_ptr(b->h32)};
}

// z_MV = h_MH W_VH^T for rows [c0, c0 + m) (bf16 inputs when given: h16 holds bf16(h)).
template <typename T>
void chunk_logits(T* z, const T* h_TH, const T* w_VH, int64_t c0, int64_t m, const HeadLossShape& s,
                  const RawHeadBf16* bf16) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16 != nullptr && bf16->w_VH_wide != nullptr) {
      return cpu::gemm<float>(false, true, m, s.V, s.H, 1.f, bf16->h32 + c0 * s.H, s.H,
                              bf16->w_VH_wide, s.H, 0.f, z, s.V);
    }
    if (bf16 != nullptr) {
      cpu::gemm_bf16(false, true, m, s.V, s.H, bf16->h16 + c0 * s.H, s.H, bf16->w_VH, s.H, 0.f, z,
                     s.V, bf16->ws32, bf16->w_VH_wide);
      return;
    }
  }
  cpu::gemm<T>(false, true, m, s.V, s.H, T(1), h_TH + c0 * s.H, s.H, w_VH, s.H, T(0), z, s.V);
}

// The forward (convert_h) writes h's bf16 form into h16 / h32; the backward reads it as the
// forward left it, as it reads lse_T.
template <typename T>
void check_bf16(const RawHeadBf16* bf16, const T* h_TH, const HeadLossShape& s, bool convert_h) {
  if (bf16 == nullptr) return;
  MOE_CHECK((std::is_same_v<T, float>), "[head_loss] the bf16 path needs an f32 model");
  if (bf16->w_VH_wide != nullptr) {
    MOE_CHECK(bf16->h32 != nullptr, "[head_loss] widened bf16 weights need the h32 workspace");
    if constexpr (std::is_same_v<T, float>) {
      if (convert_h) cpu::round_f32_to_bf16(bf16->h32, h_TH, s.n_tok * s.H);
    }
    return;
  }
  MOE_CHECK(bf16->w_VH && bf16->h16 && bf16->dz16,
            "[head_loss] the bf16 path needs bf16 weights and the h16 and dz16 workspaces");
  if constexpr (std::is_same_v<T, float>) {
    if (convert_h) cpu::cast_f32_to_bf16(bf16->h16, h_TH, s.n_tok * s.H);
  }
}


// One row of logits -> dlogits = (exp(z - lse) - [v == tgt]) * dloss, in place; the target's
// entry is recomputed from its saved logit so that it rounds as (e - 1) * dloss. Ignored
// tokens (tgt < 0) get zeros: no gradient into dh or dW.
template <typename T>
void softmax_grad_row(T* z, int64_t V, int32_t tgt, T lse, T dloss) {
  if (tgt < 0) {
    std::fill(z, z + V, T(0));
    return;
  }
  const T zt = z[tgt];
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) z[v] = fast_exp(z[v] - lse) * dloss;
  z[tgt] = (fast_exp(zt - lse) - T(1)) * dloss;
}

// The same row rounded to bf16 values in place (the widened head GEMMs' input): bitwise
// softmax_grad_row_bf16's values, widened.
void softmax_grad_row_bf16w(float* z, int64_t V, int32_t tgt, float lse, float dloss) {
  if (tgt < 0) {
    std::fill(z, z + V, 0.f);
    return;
  }
  const float zt = z[tgt];
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    z[v] = f32_bf16_rounded(fast_exp(z[v] - lse) * dloss);
  }
  z[tgt] = f32_bf16_rounded((fast_exp(zt - lse) - 1.0f) * dloss);
}

// The same row written as bf16 bits (the bf16 head GEMMs' input): the values of
// softmax_grad_row, rounded as cast_f32_to_bf16 rounds them.
void softmax_grad_row_bf16(uint16_t* d16, const float* z, int64_t V, int32_t tgt, float lse,
                           float dloss) {
  if (tgt < 0) {
    std::fill(d16, d16 + V, uint16_t{0});  // bf16 +0
    return;
  }
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) d16[v] = f32_to_bf16_bits(fast_exp(z[v] - lse) * dloss);
  d16[tgt] = f32_to_bf16_bits((fast_exp(z[tgt] - lse) - 1.0f) * dloss);
}
}  // namespace

// A chunk larger than the batch only ever holds n_tok rows.
int64_t head_loss_workspace_elems(const HeadLossShape& s) {
  return std::max<int64_t>(0, std::min(s.chunk, s.n_tok)) * s.V;
}

int64_t head_loss_bf16_workspace_elems(const Exec& ex, const HeadLossShape& s) {
  const int64_t m = std::max<int64_t>(0, std::min(s.chunk, s.n_tok));
  return std::max({gemm_bf16_workspace_elems(ex, m, s.V, s.H),
                   gemm_bf16_workspace_elems(ex, m, s.H, s.V),
                   gemm_bf16_workspace_elems(ex, s.V, s.H, m)});
}

namespace cpu {

template <typename T>
double head_loss_forward(T* loss_T, T* lse_T, const T* h_TH, const T* w_VH, const int32_t* target_T,
                         const HeadLossShape& s, T* workspace, const HeadLossBf16* bf16_in) {
  const std::optional<RawHeadBf16> raw_bf16 = unwrap(bf16_in);
  const RawHeadBf16* bf16 = raw_bf16 ? &*raw_bf16 : nullptr;
  check_args(s, target_T, workspace);
  check_bf16(bf16, h_TH, s, /*convert_h=*/true);
  const int64_t V = s.V;
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    chunk_logits(workspace, h_TH, w_VH, c0, m, s, bf16);
#pragma omp parallel for schedule(static) if (m * V >= kParallelMin)
    for (int64_t i = 0; i < m; ++i) {
      const T* z = workspace + i * V;
      const T mx = row_max(z, V);
      // Blocks of 256 summed in f32 (vectorised), the blocks in f64: V is up to ~1e5, a plain
      // f32 sum would lose ~sqrt(V) ulps of the log-sum-exp.
      double se = 0;
      for (int64_t v0 = 0; v0 < V; v0 += 256) {
        const int64_t v1 = std::min(V, v0 + 256);
        T part = 0;
#pragma omp simd reduction(+ : part)
        for (int64_t v = v0; v < v1; ++v) part += fast_exp(z[v] - mx);
        se += double(part);
      }
      const double lse = double(mx) + std::log(se);
      const int64_t t = c0 + i;
      lse_T[t] = T(lse);
      loss_T[t] = target_T[t] >= 0 ? T(lse - double(z[target_T[t]])) : T(0);
    }
  }
  double total = 0;  // serial, in token order: independent of chunk and thread count
  for (int64_t t = 0; t < s.n_tok; ++t) total += double(loss_T[t]);
  return total;
}

template <typename T>
void head_loss_backward(T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH, const int32_t* target_T,
                        const T* lse_T, T dloss, const HeadLossShape& s, T* workspace,
                        const HeadLossBf16* bf16_in) {
  const std::optional<RawHeadBf16> raw_bf16 = unwrap(bf16_in);
  const RawHeadBf16* bf16 = raw_bf16 ? &*raw_bf16 : nullptr;
  check_args(s, target_T, workspace);
  check_bf16(bf16, h_TH, s, /*convert_h=*/false);
  const int64_t V = s.V, H = s.H;
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    chunk_logits(workspace, h_TH, w_VH, c0, m, s, bf16);
    // Logits -> dlogits = (softmax - onehot) * dloss in one pass over each row: in place, or
    // (bf16) straight into the bf16 GEMM input, so the f32 dlogits are never written.
    uint16_t* dz16 = nullptr;
    bool widened = false;
    if constexpr (std::is_same_v<T, float>) {
      widened = bf16 != nullptr && bf16->w_VH_wide != nullptr;
      if (bf16 != nullptr && !widened) dz16 = reinterpret_cast<uint16_t*>(bf16->dz16);
    }
#pragma omp parallel for schedule(static) if (m * V >= kParallelMin)
    for (int64_t i = 0; i < m; ++i) {
      T* z = workspace + i * V;
      const int64_t t = c0 + i;
      const int32_t tgt = target_T[t];
      if constexpr (std::is_same_v<T, float>) {
        if (widened) {
          softmax_grad_row_bf16w(z, V, tgt, lse_T[t], dloss);
          continue;
        }
        if (dz16 != nullptr) {
          softmax_grad_row_bf16(dz16 + i * V, z, V, tgt, lse_T[t], dloss);
          continue;
        }
      }
      softmax_grad_row(z, V, tgt, lse_T[t], dloss);
    }
    if constexpr (std::is_same_v<T, float>) {
      if (widened) {
        gemm<float>(false, false, m, H, V, 1.f, workspace, V, bf16->w_VH_wide, H, 0.f,
                    dh_TH + c0 * H, H);
        gemm<float>(true, false, V, H, m, 1.f, workspace, V, bf16->h32 + c0 * H, H, 1.f, dw_VH, H);
        continue;
      }
      if (bf16 != nullptr) {
        gemm_bf16(false, false, m, H, V, bf16->dz16, V, bf16->w_VH, H, 0.f, dh_TH + c0 * H, H,
                  bf16->ws32, bf16->w_VH_wide);
        gemm_bf16(true, false, V, H, m, bf16->dz16, V, bf16->h16 + c0 * H, H, 1.f, dw_VH, H,
                  bf16->ws32);
        continue;
      }
    }
    gemm<T>(false, false, m, H, V, T(1), workspace, V, w_VH, H, T(0), dh_TH + c0 * H, H);
    gemm<T>(true, false, V, H, m, T(1), workspace, V, h_TH + c0 * H, H, T(1), dw_VH, H);
  }
}

template double head_loss_forward<float>(float*, float*, const float*, const float*, const int32_t*,
                                         const HeadLossShape&, float*, const HeadLossBf16*);
template double head_loss_forward<double>(double*, double*, const double*, const double*,
                                          const int32_t*, const HeadLossShape&, double*,
                                          const HeadLossBf16*);
template void head_loss_backward<float>(float*, float*, const float*, const float*, const int32_t*,
                                        const float*, float, const HeadLossShape&, float*,
                                        const HeadLossBf16*);
template void head_loss_backward<double>(double*, double*, const double*, const double*,
                                         const int32_t*, const double*, double,
                                         const HeadLossShape&, double*, const HeadLossBf16*);

}  // namespace cpu
}  // namespace moecore::ops
