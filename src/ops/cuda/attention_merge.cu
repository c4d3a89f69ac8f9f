// The log-sum-exp merge on the GPU: a thread per (query row, b, head), its weights from the
// shared body (attention_merge_weights, in double), then its D values; every output has one
// writer, so the same bits run to run.
#include <algorithm>
#include <string>

#include "ops/attention_merge.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void attention_merge(T* out, T* lse, const T* out_i, const T* lse_i, int64_t rows,
                                int64_t B, int64_t H, int64_t D, int64_t lse_ld) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int64_t h = r % H, b = (r / H) % B, i = r / (H * B);
  const int64_t at = (b * H + h) * lse_ld + i;
  double merged, w, w_i;
  attention_merge_weights(double(lse[at]), double(lse_i[at]), merged, w, w_i);
  T* o = out + r * D;
  const T* o2 = out_i + r * D;
  for (int64_t d = 0; d < D; ++d) o[d] = T(w * double(o[d]) + w_i * double(o2[d]));
  lse[at] = T(merged);
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 128;
}  // namespace

template <typename T>
void attention_merge(void* stream, T* out, T* lse, const T* out_i, const T* lse_i,
                     const AttentionShape& s) {
  check_attention_merge_shape(s, "attention_merge");
  const int64_t rows = s.S * s.B * s.Hq;
  if (rows == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  MOE_KERNEL_CHECK(blocks <= 0x7fffffff, "[attention_merge] " + std::to_string(rows) +
                                             " rows need over 2^31-1 blocks: split the batch");
  launch("attention_merge", kernels::attention_merge<T>, dim3(unsigned(blocks)),
         dim3(unsigned(kBlock)), 0, stream, out, lse, out_i, lse_i, rows, s.B, s.Hq, s.D,
         s.lse_ld());
}

template void attention_merge<float>(void*, float*, float*, const float*, const float*,
                                     const AttentionShape&);
template void attention_merge<double>(void*, double*, double*, const double*, const double*,
                                      const AttentionShape&);

}  // namespace moecore::ops::cuda
