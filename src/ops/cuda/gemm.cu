// The GEMMs of ops/gemm.h and ops/gemm_bf16.h on the GPU: host-side dispatch to the library
// calls of ops/cuda/blas.h (no kernel of its own but the bf16 casts of ops/cuda/cast.cu).
// Dense GEMMs: one cuBLASLt matmul per call (f32 with TF32 off unless --fp32-matmul-precision
// high, f64, bf16 in / f32 out), the descriptor from desc::gemm_desc. Grouped GEMMs (the switches
// choose, ops/gemm.h): one strided-batched matmul when every group's rows are known on the host,
// from device tables (the table kernel of ops/cuda/grouped_gemm_tables.cu, then the build's
// device_grouped_gemm; no host read of the sizes), or cublasGemmGroupedBatchedEx from the group
// sizes in host memory (the switches read them: the documented sync point kGroupedGemmSizes).
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/sync_audit.h"
#include "ops/cast.h"
#include "ops/cuda/blas.h"
#include "ops/cuda/grouped_gemm_device.h"
#include "ops/cuda/launch.cuh"
#include "ops/f32_matmul_precision.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops::cuda {

namespace {

// f32 GEMMs take TF32 products where --fp32-matmul-precision high asks for them
// (ops/f32_matmul_precision.h), full f32 otherwise; f64 stays f64.
template <typename T>
desc::GemmTypes gemm_types(const Exec& ex) {
  if constexpr (std::is_same_v<T, double>) return desc::GemmTypes::F64;
  return f32_gemm_tf32(ex.device) ? desc::GemmTypes::F32Tf32 : desc::GemmTypes::F32;
}

int64_t ld(int64_t cols) {
  return cols > 1 ? cols : 1;
}

void matmul(const Exec& ex, desc::GemmTypes types, bool trans_a, bool trans_b, int64_t M, int64_t N,
            int64_t K, double alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
            double beta, void* C, int64_t ldc) {
  desc::GemmCall call;
  call.types = types;
  call.trans_a = trans_a;
  call.trans_b = trans_b;
  call.M = M;
  call.N = N;
  call.K = K;
  call.lda = lda;
  call.ldb = ldb;
  call.ldc = ldc;
  call.alpha = alpha;
  call.beta = beta;
  const desc::LtMatmulDesc d = desc::gemm_desc(call);
  run_matmul(ex, d, A, B, C, blas_handles(ex));
}

// The grouped call's problem and pointer tables are host vectors built per call, after the sizes'
// read (kGroupedGemmSizes): the host work of that documented sync point, which no captured step
// can contain anyway. The audit (--sync-audit) does not count their allocations; they go with
// the sync, when the sizes stay on the device (a device-side grouped GEMM).
void grouped_forward(const Exec& ex, desc::GemmTypes types, const int64_t* m_G_host, int64_t G,
                     int64_t N, int64_t K, const void* x, const void* w, bool trans_w, void* y) {
  const SyncAudit::Paused host_tables;
  const desc::GroupedBatchedDesc d =
      desc::grouped_batched_forward(types, m_G_host, G, N, K, trans_w);
  run_grouped_batched(ex, d, x, w, y, blas_handles(ex));
}

void grouped_wgrad(const Exec& ex, desc::GemmTypes types, const int64_t* m_G_host, int64_t G,
                   int64_t N, int64_t K, const void* dy, const void* x, void* dw) {
  const SyncAudit::Paused host_tables;  // as grouped_forward's
  const desc::GroupedBatchedDesc d = desc::grouped_batched_wgrad(types, m_G_host, G, N, K);
  run_grouped_batched(ex, d, dy, x, dw, blas_handles(ex));
}

// Every group `rows` rows: one strided-batched matmul over the groups' blocks, the sizes known
// on the host (ops/gemm.h): no sync, capturable.
void fixed_forward(const Exec& ex, desc::GemmTypes types, int64_t rows, int64_t G, int64_t N,
                   int64_t K, const void* x, const void* w, bool trans_w, void* y) {
  const desc::LtMatmulDesc d =
      desc::gemm_desc(desc::padded_grouped_forward_call(types, G, rows, N, K, trans_w));
  run_matmul(ex, d, x, w, y, blas_handles(ex));
}

void fixed_wgrad(const Exec& ex, desc::GemmTypes types, int64_t rows, int64_t G, int64_t N,
                 int64_t K, const void* dy, const void* x, void* dw) {
  const desc::LtMatmulDesc d =
      desc::gemm_desc(desc::padded_grouped_wgrad_call(types, G, rows, N, K));
  run_matmul(ex, d, dy, x, dw, blas_handles(ex));
}

}  // namespace

void grouped_gemm_device_tables(const DeviceTablesCall& c) {
  MOE_KERNEL_CHECK(
      c.ex != nullptr && c.G >= 0 && c.N >= 0 && c.K >= 0 && (c.G == 0 || c.m_G != nullptr),
      "[grouped_gemm] device tables: G=" + std::to_string(c.G) + " N=" + std::to_string(c.N) +
          " K=" + std::to_string(c.K) + ": sizes >= 0, the context and m_G set");
  if (c.G == 0) return;
  // The table at the workspace's first 256-byte boundary, the backend's workspace after it.
  const int64_t need = grouped_gemm_device_workspace_bytes(c.G);
  MOE_KERNEL_CHECK(c.workspace != nullptr && c.workspace_bytes >= need,
                   "[grouped_gemm] the device-table path needs its planned workspace of " +
                       std::to_string(need) + " bytes for " + std::to_string(c.G) +
                       " groups, got " + std::to_string(c.workspace_bytes) +
                       (c.workspace == nullptr ? " (none)" : "") +
                       ": plan ops::grouped_gemm_workspace_bytes(ex, G) with the layer's other "
                       "workspaces and pass it (GroupedGemmWorkspace)");
  const uintptr_t base = reinterpret_cast<uintptr_t>(c.workspace);
  const uintptr_t table_at = (base + 255) / 256 * 256;
  auto* table = reinterpret_cast<GroupedGemmProblem*>(table_at);
  std::byte* lib = c.workspace + (table_at - base) + detail::grouped_table_bytes(c.G);
  const size_t lib_bytes = size_t(c.workspace_bytes - (lib - c.workspace));
  grouped_gemm_tables(c.ex->stream, table, c.m_G, c.G, c.form, c.types, c.N, c.K, c.trans_w, c.a,
                      c.b, c.d);
  device_grouped_gemm(*c.ex, c.types, table, c.G, c.form == GroupedGemmForm::Wgrad ? 1.f : 0.f, lib,
                      lib_bytes);
}

template <typename T>
void gemm(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  matmul(ex, gemm_types<T>(ex), trans_a, trans_b, M, N, K, double(alpha), A, lda, B, ldb,
         double(beta), C, ldc);
}

template <typename T>
void linear_forward(const Exec& ex, T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N,
                    int64_t K, bool accumulate) {
  gemm<T>(ex, false, true, M, N, K, T(1), x_MK, ld(K), w_NK, ld(K), accumulate ? T(1) : T(0), y_MN,
          ld(N));
}

template <typename T>
void linear_backward(const Exec& ex, T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK,
                     const T* w_NK, int64_t M, int64_t N, int64_t K, bool accumulate_dx) {
  if (dx_MK != nullptr) {
    gemm<T>(ex, false, false, M, K, N, T(1), dy_MN, ld(N), w_NK, ld(K), accumulate_dx ? T(1) : T(0),
            dx_MK, ld(K));
  }
  gemm<T>(ex, true, false, N, K, M, T(1), dy_MN, ld(N), x_MK, ld(K), T(1), dw_NK, ld(K));
}

template <typename T>
void grouped_gemm(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                  const T* x, const T* w, bool trans_w, T* y) {
  grouped_forward(ex, gemm_types<T>(ex), m_G_host, G, N, K, x, w, trans_w, y);
}

template <typename T>
void grouped_gemm_wgrad(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                        const T* dy, const T* x, T* dw) {
  grouped_wgrad(ex, gemm_types<T>(ex), m_G_host, G, N, K, dy, x, dw);
}

template <typename T>
void grouped_gemm(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K, const T* x,
                  const T* w, bool trans_w, T* y) {
  fixed_forward(ex, gemm_types<T>(ex), rows, G, N, K, x, w, trans_w, y);
}

template <typename T>
void grouped_gemm_wgrad(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K, const T* dy,
                        const T* x, T* dw) {
  fixed_wgrad(ex, gemm_types<T>(ex), rows, G, N, K, dy, x, dw);
}

#define MOECORE_INSTANTIATE_CUDA_GEMM(T)                                                          \
  template void gemm<T>(const Exec&, bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, \
                        const T*, int64_t, T, T*, int64_t);                                       \
  template void linear_forward<T>(const Exec&, T*, const T*, const T*, int64_t, int64_t, int64_t, \
                                  bool);                                                          \
  template void linear_backward<T>(const Exec&, T*, T*, const T*, const T*, const T*, int64_t,    \
                                   int64_t, int64_t, bool);                                       \
  template void grouped_gemm<T>(const Exec&, const int64_t*, int64_t, int64_t, int64_t, const T*, \
                                const T*, bool, T*);                                              \
  template void grouped_gemm_wgrad<T>(const Exec&, const int64_t*, int64_t, int64_t, int64_t,     \
                                      const T*, const T*, T*);                                    \
  template void grouped_gemm<T>(const Exec&, int64_t, int64_t, int64_t, int64_t, const T*,        \
                                const T*, bool, T*);                                              \
  template void grouped_gemm_wgrad<T>(const Exec&, int64_t, int64_t, int64_t, int64_t, const T*,  \
                                      const T*, T*);
MOECORE_INSTANTIATE_CUDA_GEMM(float)
MOECORE_INSTANTIATE_CUDA_GEMM(double)
#undef MOECORE_INSTANTIATE_CUDA_GEMM

// The bf16 forms: always the native path (bf16_gemm_path(ex) is Native on CUDA), so ws32 and the
// widened weights are unused; the f32 activations are cast into the caller's bf16 workspace.
void gemm_bf16(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, float* C,
               int64_t ldc) {
  MOE_KERNEL_CHECK(beta == 0.f || beta == 1.f,
                   "[gemm_bf16] beta=" + std::to_string(beta) + " must be 0 or 1");
  matmul(ex, desc::GemmTypes::Bf16F32, trans_a, trans_b, M, N, K, 1.0, A, lda, B, ldb, double(beta),
         C, ldc);
}

void linear_forward_bf16(const Exec& ex, float* y_MN, const float* x_MK, const bf16* w_NK,
                         int64_t M, int64_t N, int64_t K, bf16* x16) {
  MOE_KERNEL_CHECK(M >= 0 && N >= 0 && K >= 0 && (M * K == 0 || x16 != nullptr),
                   "[linear_forward_bf16] M=" + std::to_string(M) + " N=" + std::to_string(N) +
                       " K=" + std::to_string(K) +
                       ": sizes >= 0 and the x16 workspace of M*K set (the CUDA path casts x)");
  cast_f32_to_bf16(ex.stream, x16, x_MK, M * K);
  gemm_bf16(ex, false, true, M, N, K, x16, ld(K), w_NK, ld(K), 0.f, y_MN, ld(N));
}

void linear_backward_bf16(const Exec& ex, float* dx_MK, float* dw_NK, const float* dy_MN,
                          const float* x_MK, const bf16* w_NK, int64_t M, int64_t N, int64_t K,
                          bf16* dy16, bf16* x16) {
  MOE_KERNEL_CHECK(M >= 0 && N >= 0 && K >= 0 && (M * N == 0 || dy16 != nullptr) &&
                       (M * K == 0 || x16 != nullptr),
                   "[linear_backward_bf16] M=" + std::to_string(M) + " N=" + std::to_string(N) +
                       " K=" + std::to_string(K) +
                       ": sizes >= 0 and the workspaces dy16 (M*N) and x16 (M*K) set");
  cast_f32_to_bf16(ex.stream, dy16, dy_MN, M * N);
  if (dx_MK != nullptr)
    gemm_bf16(ex, false, false, M, K, N, dy16, ld(N), w_NK, ld(K), 0.f, dx_MK, ld(K));
  cast_f32_to_bf16(ex.stream, x16, x_MK, M * K);
  gemm_bf16(ex, true, false, N, K, M, dy16, ld(N), x16, ld(K), 1.f, dw_NK, ld(K));
}

void grouped_gemm_bf16(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                       const bf16* x16, const bf16* w, bool trans_w, float* y) {
  grouped_forward(ex, desc::GemmTypes::Bf16F32, m_G_host, G, N, K, x16, w, trans_w, y);
}

void grouped_gemm_wgrad_bf16(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N,
                             int64_t K, const bf16* dy16, const bf16* x16, float* dw) {
  grouped_wgrad(ex, desc::GemmTypes::Bf16F32, m_G_host, G, N, K, dy16, x16, dw);
}

void grouped_gemm_bf16(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                       const bf16* x16, const bf16* w, bool trans_w, float* y) {
  fixed_forward(ex, desc::GemmTypes::Bf16F32, rows, G, N, K, x16, w, trans_w, y);
}

void grouped_gemm_wgrad_bf16(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                             const bf16* dy16, const bf16* x16, float* dw) {
  fixed_wgrad(ex, desc::GemmTypes::Bf16F32, rows, G, N, K, dy16, x16, dw);
}

void grouped_gemm_bf16_out(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                           const bf16* x16, const bf16* w, bool trans_w, bf16* y16) {
  fixed_forward(ex, desc::GemmTypes::Bf16Bf16, rows, G, N, K, x16, w, trans_w, y16);
}

}  // namespace moecore::ops::cuda
