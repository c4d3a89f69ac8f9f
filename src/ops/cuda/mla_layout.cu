// MLA layout on the GPU: mla_split a thread per element of a q / k / v row position (grid-stride),
// mla_merge a thread per (row, position) for the copies and a thread per (token, rotated dim) for
// dk_pe's sum over the heads in head order. The CPU path's operations (a copy, a product by the q
// scale, the same sum): bitwise the CPU's.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/mla_layout.h"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void mla_split(T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up,
                          const T* k_pe, int64_t n, int64_t heads, int64_t qk, int64_t pe,
                          int64_t dv, int64_t Dp, T c) {
  const int64_t dq = qk + pe, dkv = qk + dv;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / Dp, j = e % Dp, t = r / heads;
    q[e] = j < qk ? c * q_up[r * dq + j] : j < dq ? c * q_pe[r * pe + (j - qk)] : T(0);
    k[e] = j < qk ? kv_up[r * dkv + j] : j < dq ? k_pe[t * pe + (j - qk)] : T(0);
    v[e] = j < dv ? kv_up[r * dkv + qk + j] : T(0);
  }
}

template <typename T>
__global__ void mla_merge_rows(T* dq_up, T* dq_pe, T* dkv_up, const T* dq, const T* dk, const T* dv,
                               int64_t n, int64_t qk, int64_t pe, int64_t dvw, int64_t Dp, T c) {
  const int64_t dqw = qk + pe, dkv = qk + dvw;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / Dp, j = e % Dp;
    if (j < qk) {
      dq_up[r * dqw + j] = c * dq[e];
      dkv_up[r * dkv + j] = dk[e];
    } else if (j < dqw) {
      dq_pe[r * pe + (j - qk)] = c * dq[e];
    }
    if (j < dvw) dkv_up[r * dkv + qk + j] = dv[e];
  }
}

template <typename T>
__global__ void mla_merge_k_pe(T* dk_pe, const T* dk, int64_t n, int64_t heads, int64_t qk,
                               int64_t pe, int64_t Dp) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / pe, i = e % pe;
    T acc = T(0);
    for (int64_t h = 0; h < heads; ++h) acc += dk[(t * heads + h) * Dp + qk + i];
    dk_pe[e] = acc;
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;

void check(const MlaLayoutShape& s, const char* op) {
  MOE_KERNEL_CHECK(s.n_tok >= 0 && s.heads >= 0 && s.qk >= 0 && s.pe >= 1 && s.dv >= 1,
                   std::string("[") + op + "] bad shape n_tok=" + std::to_string(s.n_tok) +
                       " heads=" + std::to_string(s.heads) + " qk=" + std::to_string(s.qk) +
                       " pe=" + std::to_string(s.pe) + " dv=" + std::to_string(s.dv) +
                       ": sizes >= 0, pe and dv >= 1");
}
dim3 grid_for(int64_t n) {
  return dim3(unsigned(std::min(kMaxBlocks, (n + kBlock - 1) / kBlock)));
}
}  // namespace

template <typename T>
void mla_split(void* stream, T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up,
               const T* k_pe, const MlaLayoutShape& s, double q_scale) {
  check(s, "mla_split");
  const int64_t n = s.n_tok * s.heads * s.Dp();
  if (n == 0) return;
  launch("mla_split", kernels::mla_split<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream, q, k,
         v, q_up, q_pe, kv_up, k_pe, n, s.heads, s.qk, s.pe, s.dv, s.Dp(), static_cast<T>(q_scale));
}

template <typename T>
void mla_merge(void* stream, T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk,
               const T* dv, const MlaLayoutShape& s, double q_scale) {
  check(s, "mla_merge");
  const int64_t n = s.n_tok * s.heads * s.Dp(), n_pe = s.n_tok * s.pe;
  if (n > 0) {
    launch("mla_merge", kernels::mla_merge_rows<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream,
           dq_up, dq_pe, dkv_up, dq, dk, dv, n, s.qk, s.pe, s.dv, s.Dp(), static_cast<T>(q_scale));
  }
  if (n_pe > 0) {
    launch("mla_merge", kernels::mla_merge_k_pe<T>, grid_for(n_pe), dim3(unsigned(kBlock)), 0,
           stream, dk_pe, dk, n_pe, s.heads, s.qk, s.pe, s.Dp());
  }
}

#define MOECORE_INSTANTIATE_MLA_LAYOUT_CUDA(T)                                          \
  template void mla_split<T>(void*, T*, T*, T*, const T*, const T*, const T*, const T*, \
                             const MlaLayoutShape&, double);                            \
  template void mla_merge<T>(void*, T*, T*, T*, T*, const T*, const T*, const T*,       \
                             const MlaLayoutShape&, double);
MOECORE_INSTANTIATE_MLA_LAYOUT_CUDA(float)
MOECORE_INSTANTIATE_MLA_LAYOUT_CUDA(double)
#undef MOECORE_INSTANTIATE_MLA_LAYOUT_CUDA

}  // namespace moecore::ops::cuda
