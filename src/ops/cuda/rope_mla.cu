// MLA RoPE on the GPU: a thread per rotated pair of a row, grid-stride. It reads the f64
// factor * cos / sin tables of RopeMlaCache at the token's position, casts them to T as the CPU
// path does and rotates with the CPU path's explicit operations (a rounded product, then a fused
// multiply-add): bitwise the CPU path. Output and input never overlap (checked on the CPU), so
// the interleaved reads race with no write. A position outside the cache [0, max_pos) gives NaN.
#include <algorithm>
#include <limits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/rounding.cuh"
#include "ops/rope_mla.h"

namespace moecore::ops::cuda {

namespace kernels {
// backward false: out[i], out[i + half] from in's pair (the pairing's places), rotated by
// +angle; true: out's pair (the pairing's places) from in[i], in[i + half], by -angle.
template <typename T>
__global__ void rope_mla_rotate(T* out, const T* in, const int32_t* pos_T, int64_t n_tok,
                                int64_t n_heads, int64_t ld_out, int64_t ld_in, int64_t D,
                                int64_t max_pos, bool interleaved, const double* cos_PD,
                                const double* sin_PD, bool backward) {
  const int64_t half = D / 2, n = n_tok * n_heads * half;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / half, i = e % half, t = row / n_heads;
    const T* ir = in + row * ld_in;
    T* orow = out + row * ld_out;
    const int64_t pa = interleaved ? 2 * i : i, pb = interleaved ? 2 * i + 1 : i + half;
    const int64_t ia = backward ? i : pa, ib = backward ? i + half : pb;
    const int64_t oa = backward ? pa : i, ob = backward ? pb : i + half;
    const int64_t p = pos_T[t];
    if (p < 0 || p >= max_pos) {
      orow[oa] = orow[ob] = std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    const T c = static_cast<T>(cos_PD[p * half + i]);
    const T s0 = static_cast<T>(sin_PD[p * half + i]);
    const T s = backward ? -s0 : s0;  // exact: a sign flip
    const T a = ir[ia], b = ir[ib];
    orow[oa] = fma_rn(a, c, -mul_rn(b, s));  // a c - b s
    orow[ob] = fma_rn(b, c, mul_rn(a, s));   // b c + a s
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;

template <typename T>
void rope_mla_launch(const char* op, void* stream, T* out, const T* in, const int32_t* pos_T,
                     int64_t n_tok, int64_t n_heads, int64_t ld_out, int64_t ld_in,
                     const RopeMlaCache& cache, bool backward) {
  MOE_KERNEL_CHECK(cache.D > 0 && cache.D % 2 == 0 && cache.max_pos > 0 &&
                       cache.cos_PD != nullptr && cache.sin_PD != nullptr,
                   std::string("[") + op + "] cache not built (D=" + std::to_string(cache.D) +
                       ", max_pos=" + std::to_string(cache.max_pos) +
                       "): use make_rope_mla_cache or RopeMlaTables");
  MOE_KERNEL_CHECK(n_tok >= 0 && n_heads >= 0 && ld_out >= cache.D && ld_in >= cache.D,
                   std::string("[") + op + "] bad sizes n_tok=" + std::to_string(n_tok) +
                       " n_heads=" + std::to_string(n_heads) + " strides " +
                       std::to_string(ld_out) + " " + std::to_string(ld_in) +
                       " for D=" + std::to_string(cache.D));
  const int64_t n = n_tok * n_heads * (cache.D / 2);
  if (n == 0) return;
  const int64_t blocks = std::min(kMaxBlocks, (n + kBlock - 1) / kBlock);
  launch(op, kernels::rope_mla_rotate<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0, stream,
         out, in, pos_T, n_tok, n_heads, ld_out, ld_in, cache.D, cache.max_pos,
         cache.pairing == RopePairing::Interleaved, raw_ptr(cache.cos_PD), raw_ptr(cache.sin_PD),
         backward);
}
}  // namespace

template <typename T>
void rope_mla_forward(void* stream, T* y, const T* x, const int32_t* pos_T, int64_t n_tok,
                      int64_t n_heads, int64_t ldy, int64_t ldx, const RopeMlaCache& cache) {
  rope_mla_launch("rope_mla_forward", stream, y, x, pos_T, n_tok, n_heads, ldy, ldx, cache, false);
}

template <typename T>
void rope_mla_backward(void* stream, T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok,
                       int64_t n_heads, int64_t ldx, int64_t ldy, const RopeMlaCache& cache) {
  rope_mla_launch("rope_mla_backward", stream, dx, dy, pos_T, n_tok, n_heads, ldx, ldy, cache,
                  true);
}

#define MOECORE_INSTANTIATE_ROPE_MLA_CUDA(T)                                                \
  template void rope_mla_forward<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t,  \
                                    int64_t, int64_t, const RopeMlaCache&);                 \
  template void rope_mla_backward<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t, \
                                     int64_t, int64_t, const RopeMlaCache&);
MOECORE_INSTANTIATE_ROPE_MLA_CUDA(float)
MOECORE_INSTANTIATE_ROPE_MLA_CUDA(double)
#undef MOECORE_INSTANTIATE_ROPE_MLA_CUDA

}  // namespace moecore::ops::cuda
