// bf16 GEMM with f32 accumulation and output, for --bf16 mixed precision: the inputs are bf16
// (weights: the bf16 copies of the fp32 master weights; activations: cast on the way in), the
// product accumulates in f32. Two paths compute that same contract, chosen once per process
// from what the CPU has (bf16_gemm_path()):
//   Native: oneDNN's bf16 kernels (AVX512-BF16 dot products; about 2x the fp32 rate on Zen 4).
//   Widen:  the bf16 operands widened to f32 (exact) into planned f32 workspace, then the f32
//           GEMM (dnnl_sgemm). On CPUs without AVX512-BF16 oneDNN emulates bf16 at ~1/6 of its
//           sgemm rate (Ice Lake: 32 vs 211 GFLOP/s), so widening is the fast correct path.
// Every entry point takes `ws32`, f32 workspace of the size its *_workspace_elems function
// returns for the context's path (0 on Native: ws32 may then be null). Callers plan it. The
// path belongs to the execution context: the CPU backend's is chosen as above, CUDA's is
// always Native (cuBLASLt takes bf16 operands with f32 accumulation), so a plan made for a GPU
// on any host has no widened copies and no ws32.
// The weight operand may also come already widened (`b32` / `w32`: the same bf16 values in
// f32, same layout; Param::data16w, written by the optimizer): the widen path then reads it
// instead of widening the weight at every GEMM. The native path ignores it.
#pragma once

#include <cstdint>
#include <string>

#include "core/dev_ptr.h"
#include "core/exec.h"

#include "core/dtype.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/gemm.h"

namespace moecore::ops {

enum class Bf16GemmPath { Native, Widen };

// The process-wide choice, made on first use: MOECORE_BF16_GEMM=native|widen if set, else
// Native when oneDNN's effective ISA (which honours DNNL_MAX_CPU_ISA) has AVX512-BF16 dot
// products, else Widen.
Bf16GemmPath bf16_gemm_path();
// The path of an execution context: the CPU's choice above on the CPU, Native on CUDA.
Bf16GemmPath bf16_gemm_path(const Exec& ex);
// Whether the native path can run at all: oneDNN builds bf16 matmuls from AVX-512 (avx512_core)
// up, natively with AVX512-BF16 and emulated without; below AVX-512 (AVX2 CPUs, or
// DNNL_MAX_CPU_ISA=AVX2) only the widen path exists.
bool bf16_native_available();
// Overrides the choice (tests run both paths where both exist). Plan workspaces after it.
// Native where it is not available is an error.
void set_bf16_gemm_path(Bf16GemmPath path);
const char* bf16_gemm_path_name(Bf16GemmPath path);  // "native" / "widen"
// One line for the start-up log, e.g. "[gemm] bf16 GEMMs: widen to f32 + sgemm (CPU has no
// AVX512-BF16)".
std::string bf16_gemm_path_line();

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
               int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc,
               float* ws32, const float* b32 = nullptr);
void linear_forward_bf16(float* y_MN, const float* x_MK, const bf16* w_NK, int64_t M, int64_t N,
                         int64_t K, bf16* x16, float* ws32, const float* w32 = nullptr,
                         bool x_rounded = false);
void linear_backward_bf16(float* dx_MK, float* dw_NK, const float* dy_MN, const float* x_MK,
                          const bf16* w_NK, int64_t M, int64_t N, int64_t K, bf16* dy16, bf16* x16,
                          float* ws32, const float* w32 = nullptr, bool x_rounded = false);
void grouped_gemm_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* x16,
                       const bf16* w, bool trans_w, float* y, float* ws32,
                       const float* w32 = nullptr);
void grouped_gemm_wgrad_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* dy16,
                             const bf16* x16, float* dw, float* ws32);
}  // namespace cpu
// The CUDA paths (ops/cuda/gemm.cu): the native path always (cuBLASLt, bf16 operands, f32
// accumulation and output), so ws32, b32 and w32 are unused; the f32 activations are cast into
// the caller's bf16 workspaces (x16, dy16) by ops/cuda/cast.cu. The grouped forms take the path
// ops::grouped_gemm's take on CUDA (ops/gemm.h): device tables where the backend takes bf16 at
// the call's N and K (no host read of m_G), else m_G read on the host (kGroupedGemmSizes).
namespace cuda {
void gemm_bf16(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
void linear_forward_bf16(const Exec& ex, float* y_MN, const float* x_MK, const bf16* w_NK,
                         int64_t M, int64_t N, int64_t K, bf16* x16);
void linear_backward_bf16(const Exec& ex, float* dx_MK, float* dw_NK, const float* dy_MN,
                          const float* x_MK, const bf16* w_NK, int64_t M, int64_t N, int64_t K,
                          bf16* dy16, bf16* x16);
void grouped_gemm_bf16(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                       const bf16* x16, const bf16* w, bool trans_w, float* y);
void grouped_gemm_wgrad_bf16(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N,
                             int64_t K, const bf16* dy16, const bf16* x16, float* dw);
// Every group `rows` rows (> 0): one strided-batched matmul, no sizes read (ops/gemm.h).
void grouped_gemm_bf16(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                       const bf16* x16, const bf16* w, bool trans_w, float* y);
void grouped_gemm_wgrad_bf16(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                             const bf16* dy16, const bf16* x16, float* dw);
// The same forward with a bf16 D (desc::GemmTypes::Bf16Bf16: the f32 accumulation rounded to
// nearest even once): one strided-batched cuBLASLt matmul writing bf16.
void grouped_gemm_bf16_out(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                           const bf16* x16, const bf16* w, bool trans_w, bf16* y16);
}  // namespace cuda
// Whether the bf16 grouped forward of this shape writes a bf16 D from device tables on CUDA: its
// f32-output calls take the device tables (grouped_gemm_path) and the build's backend takes
// Bf16Bf16 there too (ops/grouped_gemm_path.cpp).
bool grouped_gemm_device_bf16_output(int64_t N, int64_t K);

// C[M,N] = op(A) op(B) + beta * C (beta 0 or 1), row-major with row strides lda/ldb/ldc.
inline void gemm_bf16(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                      DevPtr<const bf16> A, int64_t lda, DevPtr<const bf16> B, int64_t ldb,
                      float beta, DevPtr<float> C, int64_t ldc, DevPtr<float> ws32,
                      DevPtr<const float> b32 = nullptr) {
  if (ex.on_cpu())
    return cpu::gemm_bf16(trans_a, trans_b, M, N, K, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                          raw_ptr(C), ldc, raw_ptr(ws32), raw_ptr(b32));
  return cuda::gemm_bf16(ex, trans_a, trans_b, M, N, K, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                         raw_ptr(C), ldc);
}
int64_t gemm_bf16_workspace_elems(const Exec& ex, int64_t M, int64_t N, int64_t K);
void gemm_bf16_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                   int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The bf16 "linear": y[M,N] = bf16(x)[M,K] * w^T, w [N,K] bf16; x16 is workspace of M*K.
// (Widen rounds x straight into ws32; x16 is then unused.) x_rounded: x already holds bf16
// values (its producer rounded it, e.g. rmsnorm_forward_bf16w), so the widen path reads it as
// it is instead of rounding it again; the results are the same.
inline void linear_forward_bf16(const Exec& ex, DevPtr<float> y_MN, DevPtr<const float> x_MK,
                                DevPtr<const bf16> w_NK, int64_t M, int64_t N, int64_t K,
                                DevPtr<bf16> x16, DevPtr<float> ws32,
                                DevPtr<const float> w32 = nullptr, bool x_rounded = false) {
  if (ex.on_cpu())
    return cpu::linear_forward_bf16(raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K,
                                    raw_ptr(x16), raw_ptr(ws32), raw_ptr(w32), x_rounded);
  return cuda::linear_forward_bf16(ex, raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K,
                                   raw_ptr(x16));
}
// dx[M,K] = bf16(dy) * w (dx may be null); dw[N,K] += bf16(dy)^T * bf16(x) in f32.
// dy16 and x16 are workspace of M*N and M*K.
inline void linear_backward_bf16(const Exec& ex, DevPtr<float> dx_MK, DevPtr<float> dw_NK,
                                 DevPtr<const float> dy_MN, DevPtr<const float> x_MK,
                                 DevPtr<const bf16> w_NK, int64_t M, int64_t N, int64_t K,
                                 DevPtr<bf16> dy16, DevPtr<bf16> x16, DevPtr<float> ws32,
                                 DevPtr<const float> w32 = nullptr, bool x_rounded = false) {
  if (ex.on_cpu())
    return cpu::linear_backward_bf16(raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN), raw_ptr(x_MK),
                                     raw_ptr(w_NK), M, N, K, raw_ptr(dy16), raw_ptr(x16),
                                     raw_ptr(ws32), raw_ptr(w32), x_rounded);
  return cuda::linear_backward_bf16(ex, raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN),
                                    raw_ptr(x_MK), raw_ptr(w_NK), M, N, K, raw_ptr(dy16),
                                    raw_ptr(x16));
}
// ws32 of linear_forward_bf16 and linear_backward_bf16 at this shape.
int64_t linear_bf16_workspace_elems(const Exec& ex, int64_t M, int64_t N, int64_t K);

// Grouped (per local expert) versions over rows stacked by group, as grouped_gemm in gemm.h,
// on inputs already cast to bf16 (the caller casts each activation once and reuses it):
//   y_g = x16_g * op(w_g),  w [G, N, K] (trans_w) or [G, K, N].
// gws: the device-table path's memory (ops/gemm.h, GroupedGemmWorkspace). rows_per_group > 0:
// every group has that many rows (ops/gemm.h: no sizes read on CUDA).
inline void grouped_gemm_bf16(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                              int64_t K, DevPtr<const bf16> x16, DevPtr<const bf16> w, bool trans_w,
                              DevPtr<float> y, DevPtr<float> ws32,
                              DevPtr<const float> w32 = nullptr, GroupedGemmWorkspace gws = {},
                              int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm_bf16(raw_ptr(m_G), G, N, K, raw_ptr(x16), raw_ptr(w), trans_w,
                                  raw_ptr(y), raw_ptr(ws32), raw_ptr(w32));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm_bf16(ex, rows_per_group, G, N, K, raw_ptr(x16), raw_ptr(w), trans_w,
                                   raw_ptr(y));
  }
  if (grouped_gemm_path(desc::GemmTypes::Bf16F32, N, K) == GroupedGemmPath::Device) {
    return cuda::grouped_gemm_device_tables(
        {&ex, desc::GemmTypes::Bf16F32, GroupedGemmForm::Forward, raw_ptr(m_G), G, N, K, trans_w,
         raw_ptr(x16), raw_ptr(w), raw_ptr(y), raw_ptr(gws.data), gws.bytes});
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm_bf16(ex, sizes.data(), G, N, K, raw_ptr(x16), raw_ptr(w), trans_w,
                                 raw_ptr(y));
}
//   dw_g[N, K] += dy16_g^T * x16_g (f32 accumulate).
inline void grouped_gemm_wgrad_bf16(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                                    int64_t K, DevPtr<const bf16> dy16, DevPtr<const bf16> x16,
                                    DevPtr<float> dw, DevPtr<float> ws32,
                                    GroupedGemmWorkspace gws = {}, int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm_wgrad_bf16(raw_ptr(m_G), G, N, K, raw_ptr(dy16), raw_ptr(x16),
                                        raw_ptr(dw), raw_ptr(ws32));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm_wgrad_bf16(ex, rows_per_group, G, N, K, raw_ptr(dy16), raw_ptr(x16),
                                         raw_ptr(dw));
  }
  if (grouped_gemm_path(desc::GemmTypes::Bf16F32, N, K) == GroupedGemmPath::Device) {
    return cuda::grouped_gemm_device_tables(
        {&ex, desc::GemmTypes::Bf16F32, GroupedGemmForm::Wgrad, raw_ptr(m_G), G, N, K, false,
         raw_ptr(dy16), raw_ptr(x16), raw_ptr(dw), raw_ptr(gws.data), gws.bytes});
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm_wgrad_bf16(ex, sizes.data(), G, N, K, raw_ptr(dy16), raw_ptr(x16),
                                       raw_ptr(dw));
}
// ws32 for up to max_rows rows in all groups, with up to `threads` OpenMP threads.
int64_t grouped_gemm_bf16_workspace_elems(const Exec& ex, int64_t max_rows, int64_t N, int64_t K,
                                          int threads);
int64_t grouped_gemm_wgrad_bf16_workspace_elems(const Exec& ex, int64_t max_rows, int64_t N,
                                                int64_t K);

// The bf16-output forms (fc1's h under --bf16): a bf16 D with the f32 bias in the epilogue and one
// rounding,
//   y16_g[m_g, N] = round_rne(x_g op(w_g) accumulated in f32 (+ bias_g, f32)),
// bitwise what grouped_gemm_bf16 (or, on widened operands, the f32 grouped_gemm), then
// grouped_bias_forward, then cast_f32_to_bf16 wrote. The f32 products pass through h32 [rows, N],
// the caller's f32 memory: the library calls are exactly the f32-output ones (the same M, N, K),
// which is what keeps the bits. Computing the products a block of rows at a time into a small
// slot was tried and is not bitwise: oneDNN's sgemm and bf16 GEMM choose their kernels from M as
// well (likely the sgemm's copy-based or no-copy driver, a threshold on M and N in oneDNN's
// sources; not traced further): bench-small's fc1, 2048 x 1024 x 512, differs from 128-row
// blocks in some elements. The caller lends memory that is dead in the forward (the MLP:
// its backward's dh workspace), so no f32 h is planned. bias_GN [G, N] f32 or null; `rows` = the
// sum of m_G (the caller knows it; the CUDA cast reads no size). The CPU adds the bias and rounds
// in one pass; CUDA runs grouped_bias_forward and cast_f32_to_bf16 with a bias. Without one, CUDA
// writes the bf16 D in the GEMM itself where the library takes it (desc::GemmTypes::Bf16Bf16):
// the strided-batched form (rows_per_group) always, the device tables where the build's backend
// has a bf16-output kernel (grouped_gemm_device_bf16_output); h32 is then not written. That
// saves the f32 write and the cast pass's read, not memory (h32 is the dh the backward needs
// anyway). Its bits are the f32 output's rounded once as long as the library sums in the same
// order for either output type: the emulated build's interpreters do; a GPU's heuristic may
// pick another algorithm for another output type (another f32 summation order, rounded once).
namespace cpu {
void grouped_bias_round_bf16(bf16* y16, const float* h32, const float* bias_GN, const int64_t* m_G,
                             int64_t G, int64_t N);
}  // namespace cpu
// The bf16-output forms' epilogue: y16 = round_rne(h32 + bias) over the groups' rows (the CPU in
// one pass; a device adds the bias in place, then casts).
inline void grouped_bias_round_bf16(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G,
                                    int64_t N, int64_t rows, DevPtr<const float> bias_GN,
                                    DevPtr<bf16> y16, DevPtr<float> h32) {
  if (ex.on_cpu())
    return cpu::grouped_bias_round_bf16(raw_ptr(y16), raw_ptr(h32), raw_ptr(bias_GN),
                                        raw_ptr(m_G), G, N);
  if (bias_GN != nullptr)
    grouped_bias_forward(ex, h32, bias_GN, DevPtr<const float>(nullptr), m_G, G, N);
  cast_f32_to_bf16(ex, y16, DevPtr<const float>(h32), rows * N);
}
inline void grouped_gemm_bf16_out(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                                  int64_t K, int64_t rows, DevPtr<const bf16> x16,
                                  DevPtr<const bf16> w, bool trans_w, DevPtr<const float> bias_GN,
                                  DevPtr<bf16> y16, DevPtr<float> h32, DevPtr<float> ws32,
                                  DevPtr<const float> w32 = nullptr, GroupedGemmWorkspace gws = {},
                                  int64_t rows_per_group = 0) {
  if (!ex.on_cpu() && bias_GN == nullptr) {
    if (rows_per_group > 0)
      return cuda::grouped_gemm_bf16_out(ex, rows_per_group, G, N, K, raw_ptr(x16), raw_ptr(w),
                                         trans_w, raw_ptr(y16));
    if (grouped_gemm_device_bf16_output(N, K)) {
      return cuda::grouped_gemm_device_tables(
          {&ex, desc::GemmTypes::Bf16Bf16, GroupedGemmForm::Forward, raw_ptr(m_G), G, N, K,
           trans_w, raw_ptr(x16), raw_ptr(w), raw_ptr(y16), raw_ptr(gws.data), gws.bytes});
    }
  }
  grouped_gemm_bf16(ex, m_G, G, N, K, x16, w, trans_w, h32, ws32, w32, gws, rows_per_group);
  grouped_bias_round_bf16(ex, m_G, G, N, rows, bias_GN, y16, h32);
}
// The same on f32 operands that hold bf16 values (the widen path's rounded activations and
// widened weights, Param::data16w): the f32 grouped_gemm's products.
inline void grouped_gemm_widened_bf16_out(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G,
                                          int64_t N, int64_t K, int64_t rows,
                                          DevPtr<const float> x32, DevPtr<const float> w32,
                                          bool trans_w, DevPtr<const float> bias_GN,
                                          DevPtr<bf16> y16, DevPtr<float> h32,
                                          GroupedGemmWorkspace gws = {},
                                          int64_t rows_per_group = 0) {
  grouped_gemm(ex, m_G, G, N, K, x32, w32, trans_w, h32, gws, rows_per_group);
  grouped_bias_round_bf16(ex, m_G, G, N, rows, bias_GN, y16, h32);
}
// The plain loops: f32 sums in k order, + bias, rounded to nearest even.
void grouped_gemm_bf16_out_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K,
                               const bf16* x16, const bf16* w, bool trans_w, const float* bias_GN,
                               bf16* y16);

}  // namespace moecore::ops
