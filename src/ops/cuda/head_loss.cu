// The output head fused with cross entropy on the GPU (ops/cross_entropy.h), chunked over tokens
// as on the CPU: per chunk the logits GEMM (cuBLASLt, ops/cuda/gemm.cu) into the [chunk, V]
// workspace, then one block per row: the row's max and its sum of exp(z - max) in f64 (each
// thread's elements in order, then the block's fixed tree), the log-sum-exp and the loss
// (forward), or the dlogits in place / as bf16 (backward), then the backward's two GEMMs. The
// forward's loss sum: one block over loss_T in a fixed tree (f64), written to *sum after the last
// chunk, so it does not depend on the chunk size. No atomics: bitwise the same run to run.
// Targets are not checked on the host (that would be a sync): a target >= V gives a NaN loss
// and NaN gradients (the step's non-finite guard stops there), a target < 0 is ignored.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops::cuda {

namespace kernels {

constexpr int kRowBlock = 256;

__device__ __forceinline__ float exp_of(float x) {
  return expf(x);
}
__device__ __forceinline__ double exp_of(double x) {
  return exp(x);
}

// The log-sum-exp of row z[0, V) in f64, in every thread.
template <typename T>
__device__ __forceinline__ double row_lse(const T* z, int64_t V, double* shared) {
  T mx = z[0];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = z[v] > mx ? z[v] : mx;
  // NaN logits: a NaN max makes every exp NaN, so the loss is NaN, as on the CPU.
  const double m = block_max(double(mx), shared);
  __syncthreads();  // shared is reused by the sum
  double part = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) part += double(exp_of(T(z[v] - T(m))));
  const double se = block_sum(part, shared);
  return m + log(se);
}

// Block i: row i of the chunk (token c0 + i).
template <typename T>
__global__ void head_loss_rows(T* loss_T, T* lse_T, const T* z_MV, const int32_t* target_T,
                               int64_t c0, int64_t V) {
  __shared__ double shared[kRowBlock / 32 + 1];
  const int64_t i = blockIdx.x, t = c0 + i;
  const T* z = z_MV + i * V;
  const double lse = row_lse(z, V, shared);
  if (threadIdx.x == 0) {
    const int32_t tgt = target_T[t];
    lse_T[t] = T(lse);
    if (tgt >= V)
      loss_T[t] = T(NAN);
    else
      loss_T[t] = tgt >= 0 ? T(lse - double(z[tgt])) : T(0);
  }
}

// *sum = the sum of loss_T[0, n) in f64: each thread's elements in order, then the block's tree.
template <typename T>
__global__ void head_loss_sum(double* sum, const T* loss_T, int64_t n) {
  __shared__ double shared[kRowBlock / 32 + 1];
  double part = 0;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) part += double(loss_T[t]);
  const double s = block_sum(part, shared);
  if (threadIdx.x == 0) *sum = s;
}

// The dlogits of one element: (exp(z - lse) - [v == tgt]) * dloss; the target's entry rounds as
// (e - 1) * dloss, as on the CPU.
template <typename T>
__device__ __forceinline__ T dlogit(T z, T lse, bool is_target, T dloss) {
  const T e = exp_of(T(z - lse));
  return is_target ? (e - T(1)) * dloss : e * dloss;
}

// Mode: 0 the dlogits in place in T; 1 the same rounded to bf16 values in place (f32, the widened
// GEMMs' input); 2 as bf16 bits into dz16 (the bf16 GEMMs' input). Each element is read and
// written by the same thread. Ignored tokens (tgt < 0) get zeros; tgt >= V NaNs.
template <typename T, int Mode>
__global__ void head_loss_grad_rows(T* z_MV, uint16_t* dz16, const int32_t* target_T,
                                    const T* lse_T, const T* dloss, int64_t c0, int64_t V) {
  const int64_t i = blockIdx.x, t = c0 + i;
  T* z = z_MV + i * V;
  const int32_t tgt = target_T[t];
  const T d = *dloss, lse = lse_T[t];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    T g = tgt < 0 ? T(0) : tgt >= V ? T(NAN) : dlogit(z[v], lse, v == tgt, d);
    if constexpr (Mode == 0) {
      z[v] = g;
    } else if constexpr (Mode == 1) {
      z[v] = f32_bf16_rounded(float(g));
    } else {
      dz16[i * V + v] = f32_to_bf16_bits(float(g));
    }
  }
}

}  // namespace kernels

namespace {

struct Bf16Args {  // HeadLossBf16, unwrapped
  const bf16* w_VH;
  bf16* h16;
  bf16* dz16;
  const float* w_VH_wide;
  float* h32;
};

template <typename T>
void check_args(const char* who, const HeadLossShape& s, const void* workspace, const Bf16Args* b) {
  MOE_KERNEL_CHECK(s.n_tok >= 0 && s.H >= 1 && s.V >= 1 && s.chunk >= 1,
                   std::string("[") + who + "] bad shape n_tok=" + std::to_string(s.n_tok) +
                       " H=" + std::to_string(s.H) + " V=" + std::to_string(s.V) +
                       " chunk=" + std::to_string(s.chunk) + ": all but n_tok must be >= 1");
  MOE_KERNEL_CHECK(workspace != nullptr || s.n_tok == 0,
                   std::string("[") + who +
                       "] null workspace with n_tok=" + std::to_string(s.n_tok) +
                       ": allocate head_loss_workspace_elems(shape) elements");
  if (b == nullptr) return;
  MOE_KERNEL_CHECK((std::is_same_v<T, float>),
                   std::string("[") + who + "] the bf16 path needs an f32 model");
  if (b->w_VH_wide != nullptr) {
    MOE_KERNEL_CHECK(b->h32 != nullptr,
                     std::string("[") + who + "] widened bf16 weights need the h32 workspace");
  } else {
    MOE_KERNEL_CHECK(b->w_VH && b->h16 && b->dz16,
                     std::string("[") + who +
                         "] the bf16 path needs bf16 weights and the h16 and dz16 workspaces");
  }
}

// z [m, V] = the chunk's logits (rows [c0, c0 + m) of h times W^T).
template <typename T>
void chunk_logits(const Exec& ex, T* z, const T* h_TH, const T* w_VH, int64_t c0, int64_t m,
                  const HeadLossShape& s, const Bf16Args* b) {
  if constexpr (std::is_same_v<T, float>) {
    if (b != nullptr && b->w_VH_wide != nullptr) {
      return gemm<float>(ex, false, true, m, s.V, s.H, 1.f, b->h32 + c0 * s.H, s.H, b->w_VH_wide,
                         s.H, 0.f, z, s.V);
    }
    if (b != nullptr) {
      return gemm_bf16(ex, false, true, m, s.V, s.H, b->h16 + c0 * s.H, s.H, b->w_VH, s.H, 0.f, z,
                       s.V);
    }
  }
  gemm<T>(ex, false, true, m, s.V, s.H, T(1), h_TH + c0 * s.H, s.H, w_VH, s.H, T(0), z, s.V);
}

Bf16Args unwrap(const HeadLossBf16* b) {
  return Bf16Args{raw_ptr(b->w_VH), raw_ptr(b->h16), raw_ptr(b->dz16), raw_ptr(b->w_VH_wide),
                  raw_ptr(b->h32)};
}

}  // namespace

template <typename T>
void head_loss_forward(const Exec& ex, double* sum, T* loss_T, T* lse_T, const T* h_TH,
                       const T* w_VH, const int32_t* target_T, const HeadLossShape& s, T* workspace,
                       const HeadLossBf16* bf16_in) {
  Bf16Args raw{};
  if (bf16_in != nullptr) raw = unwrap(bf16_in);
  const Bf16Args* b = bf16_in != nullptr ? &raw : nullptr;
  check_args<T>("head_loss_forward", s, workspace, b);
  if constexpr (std::is_same_v<T, float>) {
    if (b != nullptr && b->w_VH_wide != nullptr)
      round_f32_to_bf16(ex.stream, b->h32, h_TH, s.n_tok * s.H);
    else if (b != nullptr)
      cast_f32_to_bf16(ex.stream, b->h16, h_TH, s.n_tok * s.H);
  }
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    chunk_logits(ex, workspace, h_TH, w_VH, c0, m, s, b);
    launch("head_loss_rows", kernels::head_loss_rows<T>, dim3(unsigned(m)),
           dim3(unsigned(kernels::kRowBlock)), 0, ex.stream, loss_T, lse_T,
           static_cast<const T*>(workspace), target_T, c0, s.V);
  }
  launch("head_loss_sum", kernels::head_loss_sum<T>, dim3(1), dim3(unsigned(kernels::kRowBlock)), 0,
         ex.stream, sum, static_cast<const T*>(loss_T), s.n_tok);
}

template <typename T>
void head_loss_backward(const Exec& ex, T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH,
                        const int32_t* target_T, const T* lse_T, const T* dloss,
                        const HeadLossShape& s, T* workspace, const HeadLossBf16* bf16_in) {
  Bf16Args raw{};
  if (bf16_in != nullptr) raw = unwrap(bf16_in);
  const Bf16Args* b = bf16_in != nullptr ? &raw : nullptr;
  check_args<T>("head_loss_backward", s, workspace, b);
  const int64_t V = s.V, H = s.H;
  const bool widened = b != nullptr && b->w_VH_wide != nullptr;
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    chunk_logits(ex, workspace, h_TH, w_VH, c0, m, s, b);
    const dim3 grid{unsigned(m)}, block{unsigned(kernels::kRowBlock)};
    if constexpr (std::is_same_v<T, float>) {
      if (widened) {
        launch("head_loss_grad_rows", kernels::head_loss_grad_rows<float, 1>, grid, block, 0,
               ex.stream, workspace, static_cast<uint16_t*>(nullptr), target_T, lse_T, dloss, c0,
               V);
        gemm<float>(ex, false, false, m, H, V, 1.f, workspace, V, b->w_VH_wide, H, 0.f,
                    dh_TH + c0 * H, H);
        gemm<float>(ex, true, false, V, H, m, 1.f, workspace, V, b->h32 + c0 * H, H, 1.f, dw_VH, H);
        continue;
      }
      if (b != nullptr) {
        launch("head_loss_grad_rows", kernels::head_loss_grad_rows<float, 2>, grid, block, 0,
               ex.stream, workspace, reinterpret_cast<uint16_t*>(b->dz16), target_T, lse_T, dloss,
               c0, V);
        gemm_bf16(ex, false, false, m, H, V, b->dz16, V, b->w_VH, H, 0.f, dh_TH + c0 * H, H);
        gemm_bf16(ex, true, false, V, H, m, b->dz16, V, b->h16 + c0 * H, H, 1.f, dw_VH, H);
        continue;
      }
    }
    launch("head_loss_grad_rows", kernels::head_loss_grad_rows<T, 0>, grid, block, 0, ex.stream,
           workspace, static_cast<uint16_t*>(nullptr), target_T, lse_T, dloss, c0, V);
    gemm<T>(ex, false, false, m, H, V, T(1), workspace, V, w_VH, H, T(0), dh_TH + c0 * H, H);
    gemm<T>(ex, true, false, V, H, m, T(1), workspace, V, h_TH + c0 * H, H, T(1), dw_VH, H);
  }
}

template void head_loss_forward<float>(const Exec&, double*, float*, float*, const float*,
                                       const float*, const int32_t*, const HeadLossShape&, float*,
                                       const HeadLossBf16*);
template void head_loss_forward<double>(const Exec&, double*, double*, double*, const double*,
                                        const double*, const int32_t*, const HeadLossShape&,
                                        double*, const HeadLossBf16*);
template void head_loss_backward<float>(const Exec&, float*, float*, const float*, const float*,
                                        const int32_t*, const float*, const float*,
                                        const HeadLossShape&, float*, const HeadLossBf16*);
template void head_loss_backward<double>(const Exec&, double*, double*, const double*,
                                         const double*, const int32_t*, const double*,
                                         const double*, const HeadLossShape&, double*,
                                         const HeadLossBf16*);

}  // namespace moecore::ops::cuda
