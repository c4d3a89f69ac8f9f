// GEMM and grouped GEMM. Row-major. `*_ref` are plain loops (the oracle); the unsuffixed
// functions take the execution context and switch to its backend: on the CPU the fast path
// (oneDNN sgemm for f32; loops for f64, which only reference computations and gradient checks
// use).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/desc/gemm_desc.h"
#include "ops/f32_matmul_precision.h"
#include "ops/grouped_gemm_tables.h"
#include "ops/memory.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <typename T>
void linear_forward(T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N, int64_t K,
                    bool accumulate = false);
template <typename T>
void linear_backward(T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK, const T* w_NK, int64_t M,
                     int64_t N, int64_t K, bool accumulate_dx = false);
template <typename T>
void grouped_gemm(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                  bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                        const T* x, T* dw);
}  // namespace cpu
// The CUDA paths (ops/cuda/gemm.cu): cuBLASLt matmuls (ops/cuda/blas.h), f32 with TF32 off
// (unless --fp32-matmul-precision high: ops/f32_matmul_precision.h), f64 in f64. The grouped
// GEMMs take one of three paths:
// - Fixed rows (the caller knows on the host that every group has rows_per_group > 0 rows: the
//   dense MLP's one group of tokens, padded dispatch's capacity blocks): one strided-batched
//   matmul (desc::padded_grouped_*_call) that reads no size: no sync, capturable in a CUDA
//   graph (core/stream_graph.h).
// - Device tables (otherwise, where the build's device-table backend takes the call, chosen
//   from the types, N and K by grouped_gemm_path below, the same for every call of a shape,
//   ops/cuda/grouped_gemm_device.h: CUTLASS's pointer-array grouped GEMM on sm_90a, the emulated
//   build's interpreter): the problem table is written on the stream from m_G by a kernel
//   (ops/grouped_gemm_tables.h) and the GEMM runs from it. The host never reads m_G: no sync, and
//   the call can be captured in a CUDA graph. The table and the library's workspace are the
//   caller's device memory, planned with its other workspaces (GroupedGemmWorkspace,
//   grouped_gemm_workspace_bytes): nothing is allocated per call.
// - Host tables (a build or device without that backend, a shape it does not take, or
//   MOECORE_GROUPED_GEMM=host): cublasGemmGroupedBatchedEx, whose group sizes are host arrays:
//   the switch reads m_G on the host (grouped_gemm_host_sizes: ops::read_back, a wait for the
//   stream), the documented sync point kGroupedGemmSizes (docs/design.md, "The execution
//   model"), and the library's problem tables are built on the host, so such a step is not
//   capturable. The cuda:: grouped forms below take those host sizes (m_G_host). Experts with no
//   rows make no problem.
inline constexpr const char* kGroupedGemmSizes =
    "grouped GEMM group sizes read on the host (cublasGemmGroupedBatchedEx takes host arrays)";
// m_G [G] of the context's memory in host memory, inside the sync point kGroupedGemmSizes (empty
// for G <= 0: the callee checks G). Part of the grouped GEMMs' switches, not an op of its own (the
// ops take the context first; the backend harness lists them so).
inline std::vector<int64_t> grouped_gemm_host_sizes(DevPtr<const int64_t> m_G, int64_t G,
                                                    const Exec& ex) {
  std::vector<int64_t> sizes;
  if (G <= 0) return sizes;
  {
    // The sync point's host copy of the sizes: not counted by the audit, as the grouped call's
    // host tables are not (ops/cuda/gemm.cu).
    const SyncAudit::Paused host_copy;
    sizes.resize(static_cast<size_t>(G));
  }
  SyncAudit::Point point(kGroupedGemmSizes);
  read_back(ex, sizes.data(), m_G, G);
  return sizes;
}

// The device memory of one grouped GEMM's device-table path: its problem table (G
// GroupedGemmProblem, at the first 256-byte boundary) and, after it, the backend's workspace
// (cuda::device_grouped_gemm_workspace_bytes). Unused on the CPU and on the host-table path
// (null there is fine). One per layer: every grouped GEMM of the layer reuses it (a call's table
// is read before the next call's kernel writes it: one stream).
struct GroupedGemmWorkspace {
  DevPtr<std::byte> data = nullptr;
  int64_t bytes = 0;
};
// Its size for grouped GEMMs of up to G groups on ex: 0 on the CPU, under
// MOECORE_GROUPED_GEMM=host, and where the build's backend takes no type at all (the stub).
// Sizing one on a context that runs (one with a stream; a sizing pass's has none) plans its calls:
// a workspace serves two distinct device-table calls a step (beta 0: the forwards and dgrads;
// beta 1: the wgrads), whose parameters the backend keeps (cuda::device_grouped_gemm_reserve_calls
// with the process's count), so the layers x forms of a step never rebuild them after the first.
int64_t grouped_gemm_workspace_bytes(const Exec& ex, int64_t G);

// Which path the grouped GEMMs take on CUDA. MOECORE_GROUPED_GEMM: `auto` (or unset): device
// tables where supported; `host`: always the host tables (the old path, for comparison);
// `device`: device tables, a call the backend does not take is an error naming why. Read once.
enum class GroupedGemmPath { Device, Host };
enum class GroupedGemmPathChoice { Auto, Host, Device };
GroupedGemmPathChoice grouped_gemm_path_choice();
// Overrides the choice for this process (tests run both paths); plan workspaces after it.
void set_grouped_gemm_path_choice(GroupedGemmPathChoice choice);
// The path of a CUDA grouped GEMM of these types whose fixed dims are N and K (every form: the
// dgrad's N and K are the forward's exchanged). The backend's answer
// (cuda::device_grouped_gemm_supported) is probed once per process and shape.
GroupedGemmPath grouped_gemm_path(desc::GemmTypes types, int64_t N, int64_t K);
// The start-up line: which path the grouped GEMMs of a run of these types take, and why, for the
// fixed dims `dims` of its layers (their N and K are pairs of them: H, F, fc1's width), e.g.
// "[gemm] grouped GEMMs: device tables (the group sizes stay on the device: no host sync)".
std::string grouped_gemm_path_line(const Exec& ex, desc::GemmTypes types,
                                   std::span<const int64_t> dims);
namespace detail {
inline int64_t grouped_table_bytes(int64_t G) {
  return (G * int64_t(sizeof(cuda::GroupedGemmProblem)) + 255) / 256 * 256;
}
}  // namespace detail
// The size whatever the path (the device-table call checks its workspace against it): 255 bytes
// to reach the first 256-byte boundary, the table, the backend's workspace.
inline int64_t grouped_gemm_device_workspace_bytes(int64_t G) {
  if (G <= 0) return 0;
  return 255 + detail::grouped_table_bytes(G) +
         static_cast<int64_t>(cuda::device_grouped_gemm_workspace_bytes(G));
}

namespace cuda {
template <typename T>
void gemm(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <typename T>
void linear_forward(const Exec& ex, T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N,
                    int64_t K, bool accumulate);
template <typename T>
void linear_backward(const Exec& ex, T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK,
                     const T* w_NK, int64_t M, int64_t N, int64_t K, bool accumulate_dx);
template <typename T>
void grouped_gemm(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                  const T* x, const T* w, bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                        const T* dy, const T* x, T* dw);
// Every group `rows` rows (> 0): one strided-batched matmul, no sizes read.
template <typename T>
void grouped_gemm(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K, const T* x,
                  const T* w, bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K, const T* dy,
                        const T* x, T* dw);
// One grouped GEMM on the device-table path: the table written from m_G (device memory) into
// the workspace on ex's stream, then device_grouped_gemm from it (beta 1 for Wgrad, else 0).
struct DeviceTablesCall {
  const Exec* ex = nullptr;
  desc::GemmTypes types = desc::GemmTypes::F32;
  GroupedGemmForm form = GroupedGemmForm::Forward;
  const int64_t* m_G = nullptr;
  int64_t G = 0, N = 0, K = 0;
  bool trans_w = false;
  const void* a = nullptr;  // Forward: x, w, y; Wgrad: dy, x, dw
  const void* b = nullptr;
  void* d = nullptr;
  std::byte* workspace = nullptr;
  int64_t workspace_bytes = 0;
};
void grouped_gemm_device_tables(const DeviceTablesCall& call);
}  // namespace cuda

// The types of a grouped GEMM of T on ex: f32 takes TF32 products where
// --fp32-matmul-precision high asks for them on CUDA (F32Tf32, as the dense GEMMs do: the
// device-table backend is asked about, and computes, TF32), f64 stays f64.
template <typename T>
desc::GemmTypes grouped_gemm_types(const Exec& ex) {
  if constexpr (std::is_same_v<T, double>) return desc::GemmTypes::F64;
  return f32_gemm_tf32(ex.device) ? desc::GemmTypes::F32Tf32 : desc::GemmTypes::F32;
}

// C[M,N] = alpha * op(A) * op(B) + beta * C, op(A) is [M,K], op(B) is [K,N].
// lda/ldb/ldc are the row strides of A, B, C as stored (before op).
template <typename T>
void gemm(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          DevPtr<const T> A, int64_t lda, DevPtr<const T> B, int64_t ldb, T beta, DevPtr<T> C,
          int64_t ldc) {
  if (ex.on_cpu())
    return cpu::gemm(trans_a, trans_b, M, N, K, alpha, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                     raw_ptr(C), ldc);
  return cuda::gemm(ex, trans_a, trans_b, M, N, K, alpha, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                    raw_ptr(C), ldc);
}
template <typename T>
void gemm_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
              int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Convenience for contiguous operands: y[M,N] (+)= x[M,K] * w^T with w [N,K]  (a "linear").
template <typename T>
void linear_forward(const Exec& ex, DevPtr<T> y_MN, DevPtr<const T> x_MK, DevPtr<const T> w_NK,
                    int64_t M, int64_t N, int64_t K, bool accumulate = false) {
  if (ex.on_cpu())
    return cpu::linear_forward(raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K, accumulate);
  return cuda::linear_forward(ex, raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K, accumulate);
}
// dx[M,K] (+)= dy[M,N] * w[N,K];  dw[N,K] += dy^T * x  (dw always accumulates). dx may be
// null (a first layer needs no input gradient).
template <typename T>
void linear_backward(const Exec& ex, DevPtr<T> dx_MK, DevPtr<T> dw_NK, DevPtr<const T> dy_MN,
                     DevPtr<const T> x_MK, DevPtr<const T> w_NK, int64_t M, int64_t N, int64_t K,
                     bool accumulate_dx = false) {
  if (ex.on_cpu())
    return cpu::linear_backward(raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN), raw_ptr(x_MK),
                                raw_ptr(w_NK), M, N, K, accumulate_dx);
  return cuda::linear_backward(ex, raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN), raw_ptr(x_MK),
                               raw_ptr(w_NK), M, N, K, accumulate_dx);
}

// Grouped GEMM over G groups (local experts), one call, zero-row groups allowed.
// x is stacked by rows: group g owns rows [sum_{h<g} m_G[h], + m_G[g]).
// Forward:  y_g[m_g, N] = x_g[m_g, K] * op(w_g),  w is [G, N, K] if trans_w else [G, K, N].
// ws: the device-table path's memory (GroupedGemmWorkspace; the other paths and the CPU leave
// it unused). rows_per_group > 0: every m_g equals it (the caller knows it on the host); see
// above.
template <typename T>
void grouped_gemm(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N, int64_t K,
                  DevPtr<const T> x, DevPtr<const T> w, bool trans_w, DevPtr<T> y,
                  GroupedGemmWorkspace ws = {}, int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm(raw_ptr(m_G), G, N, K, raw_ptr(x), raw_ptr(w), trans_w, raw_ptr(y));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm(ex, rows_per_group, G, N, K, raw_ptr(x), raw_ptr(w), trans_w,
                              raw_ptr(y));
  }
  const desc::GemmTypes types = grouped_gemm_types<T>(ex);
  if (grouped_gemm_path(types, N, K) == GroupedGemmPath::Device) {
    return cuda::grouped_gemm_device_tables({&ex, types, GroupedGemmForm::Forward, raw_ptr(m_G), G,
                                             N, K, trans_w, raw_ptr(x), raw_ptr(w), raw_ptr(y),
                                             raw_ptr(ws.data), ws.bytes});
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm(ex, sizes.data(), G, N, K, raw_ptr(x), raw_ptr(w), trans_w, raw_ptr(y));
}
template <typename T>
void grouped_gemm_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                      bool trans_w, T* y);
// Weight gradient: dw_g[N, K] += dy_g[m_g, N]^T * x_g[m_g, K]  (dw is [G, N, K], accumulated).
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N, int64_t K,
                        DevPtr<const T> dy, DevPtr<const T> x, DevPtr<T> dw,
                        GroupedGemmWorkspace ws = {}, int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm_wgrad(raw_ptr(m_G), G, N, K, raw_ptr(dy), raw_ptr(x), raw_ptr(dw));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm_wgrad(ex, rows_per_group, G, N, K, raw_ptr(dy), raw_ptr(x),
                                    raw_ptr(dw));
  }
  const desc::GemmTypes types = grouped_gemm_types<T>(ex);
  if (grouped_gemm_path(types, N, K) == GroupedGemmPath::Device) {
    return cuda::grouped_gemm_device_tables({&ex, types, GroupedGemmForm::Wgrad, raw_ptr(m_G), G, N,
                                             K, false, raw_ptr(dy), raw_ptr(x), raw_ptr(dw),
                                             raw_ptr(ws.data), ws.bytes});
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm_wgrad(ex, sizes.data(), G, N, K, raw_ptr(dy), raw_ptr(x), raw_ptr(dw));
}
template <typename T>
void grouped_gemm_wgrad_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                            const T* x, T* dw);

}  // namespace moecore::ops
