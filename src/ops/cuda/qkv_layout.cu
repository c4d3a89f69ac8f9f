// The fused QKV projection's layout on the GPU: a thread per element of the fused rows (grid-
// stride), each copying one value between the fused row and its part (q, k or v). Pure copies:
// bitwise the CPU's.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/qkv_layout.h"

namespace moecore::ops::cuda {

namespace kernels {
// Element e of the fused rows [n_tok, Hkv, qpg + 2, D] and the offset of its value in its part
// (0 q [n_tok, Hq, D], 1 k, 2 v [n_tok, Hkv, D]).
struct QkvPiece {
  int part;
  int64_t offset;
};
__device__ __forceinline__ QkvPiece qkv_piece(int64_t e, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t qpg = Hq / Hkv, group = (qpg + 2) * D, row = Hkv * group;
  const int64_t t = e / row, g = (e % row) / group, w = e % group;
  const int64_t head = w / D, d = w % D;
  if (head < qpg) return {0, (t * Hq + g * qpg + head) * D + d};
  return {int(head - qpg + 1), (t * Hkv + g) * D + d};
}

template <typename T>
__global__ void split_qkv(T* q, T* k, T* v, const T* fused, int64_t n, int64_t Hq, int64_t Hkv,
                          int64_t D) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const QkvPiece p = qkv_piece(e, Hq, Hkv, D);
    // A select, not an array of the three pointers: a runtime index would place it in local
    // memory.
    (p.part == 0 ? q : p.part == 1 ? k : v)[p.offset] = fused[e];
  }
}

template <typename T>
__global__ void fuse_qkv(T* fused, const T* q, const T* k, const T* v, int64_t n, int64_t Hq,
                         int64_t Hkv, int64_t D) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const QkvPiece p = qkv_piece(e, Hq, Hkv, D);
    fused[e] = (p.part == 0 ? q : p.part == 1 ? k : v)[p.offset];
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;  // grid-stride beyond 1M elements

void check(const QkvShape& s, const char* op) {
  MOE_KERNEL_CHECK(s.n_tok >= 0 && s.Hkv >= 1 && s.D >= 1 && s.Hq >= s.Hkv && s.Hq % s.Hkv == 0,
                   std::string("[") + op + "] n_tok=" + std::to_string(s.n_tok) +
                       " Hq=" + std::to_string(s.Hq) + " Hkv=" + std::to_string(s.Hkv) +
                       " D=" + std::to_string(s.D) +
                       ": sizes must be >= 0, Hkv and D >= 1, and the query heads a multiple of "
                       "the KV heads");
}
dim3 grid_for(int64_t n) {
  return dim3(unsigned(std::min(kMaxBlocks, (n + kBlock - 1) / kBlock)));
}
}  // namespace

template <typename T>
void split_qkv(void* stream, T* q, T* k, T* v, const T* fused, const QkvShape& s) {
  check(s, "split_qkv");
  const int64_t n = s.n_tok * (s.Hq + 2 * s.Hkv) * s.D;
  if (n == 0) return;
  launch("split_qkv", kernels::split_qkv<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream, q, k,
         v, fused, n, s.Hq, s.Hkv, s.D);
}

template <typename T>
void fuse_qkv(void* stream, T* fused, const T* q, const T* k, const T* v, const QkvShape& s) {
  check(s, "fuse_qkv");
  const int64_t n = s.n_tok * (s.Hq + 2 * s.Hkv) * s.D;
  if (n == 0) return;
  launch("fuse_qkv", kernels::fuse_qkv<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream, fused, q,
         k, v, n, s.Hq, s.Hkv, s.D);
}

template void split_qkv<float>(void*, float*, float*, float*, const float*, const QkvShape&);
template void split_qkv<double>(void*, double*, double*, double*, const double*, const QkvShape&);
template void fuse_qkv<float>(void*, float*, const float*, const float*, const float*,
                              const QkvShape&);
template void fuse_qkv<double>(void*, double*, const double*, const double*, const double*,
                               const QkvShape&);

}  // namespace moecore::ops::cuda
