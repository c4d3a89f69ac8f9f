// The token layouts on the GPU. tokens_to_sequence_major: one block (the batch's B * S tokens are
// few) whose threads stride over the sequence-major tokens, copying ids and targets, and count
// the counted targets in a fixed block tree (no atomics; an integer sum, so exactly the CPU's).
// sequence_positions: a thread per token. roll_tokens: one block like tokens_to_sequence_major (the
// count in the same fixed tree). All bitwise the CPU's.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/token_layout.h"

namespace moecore::ops::cuda {

namespace kernels {
// Dynamic shared memory: blockDim.x / 32 + 1 values of int64_t.
__global__ void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                         const int32_t* ids_BS, const int32_t* targets_BS,
                                         int64_t B, int64_t S) {
  int64_t n = 0;
  for (int64_t t = threadIdx.x; t < B * S; t += blockDim.x) {
    const int64_t s = t / B, b = t % B;
    const int32_t tgt = targets_BS[b * S + s];
    ids_T[t] = ids_BS[b * S + s];
    targets_T[t] = tgt;
    n += tgt >= 0 ? 1 : 0;
  }
  n = block_sum(n, dynamic_shared<int64_t>());
  if (threadIdx.x == 0) *counted = n;
}

// Dynamic shared memory as tokens_to_sequence_major's.
__global__ void roll_tokens(int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                            int64_t shift, int32_t fill) {
  int64_t n = 0;
  for (int64_t t = threadIdx.x; t < n_tok; t += blockDim.x) {
    const int32_t v = t < n_tok - shift ? in_T[t + shift] : fill;
    out_T[t] = v;
    n += v >= 0 ? 1 : 0;
  }
  if (counted == nullptr) return;  // every thread alike: no barrier is left half-reached
  n = block_sum(n, dynamic_shared<int64_t>());
  if (threadIdx.x == 0) *counted = n;
}

__global__ void sequence_positions(int32_t* pos_T, int64_t n_tok, int64_t B) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n_tok;
       t += int64_t(gridDim.x) * blockDim.x)
    pos_T[t] = int32_t(t / B);
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;
}  // namespace

void tokens_to_sequence_major(void* stream, int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S) {
  MOE_KERNEL_CHECK(B >= 0 && S >= 0, "[tokens_to_sequence_major] negative shape B=" +
                                         std::to_string(B) + " S=" + std::to_string(S) +
                                         ": pass the micro-batch size and the sequence length");
  // Launched even for no tokens: *counted is then 0.
  launch("tokens_to_sequence_major", kernels::tokens_to_sequence_major, dim3(1),
         dim3(unsigned(kBlock)), size_t(kBlock / 32 + 1) * sizeof(int64_t), stream, ids_T,
         targets_T, counted, ids_BS, targets_BS, B, S);
}

void roll_tokens(void* stream, int32_t* out_T, int64_t* counted, const int32_t* in_T,
                 int64_t n_tok, int64_t shift, int32_t fill) {
  MOE_KERNEL_CHECK(n_tok >= 0 && shift >= 0, "[roll_tokens] n_tok=" + std::to_string(n_tok) +
                                                  " shift=" + std::to_string(shift) +
                                                  ": both must be >= 0");
  // Launched even for no tokens: *counted is then 0.
  launch("roll_tokens", kernels::roll_tokens, dim3(1), dim3(unsigned(kBlock)),
         size_t(kBlock / 32 + 1) * sizeof(int64_t), stream, out_T, counted, in_T, n_tok, shift,
         fill);
}

void sequence_positions(void* stream, int32_t* pos_T, int64_t n_tok, int64_t B) {
  MOE_KERNEL_CHECK(n_tok >= 0 && B >= 1, "[sequence_positions] n_tok=" + std::to_string(n_tok) +
                                             " B=" + std::to_string(B) +
                                             ": n_tok must be >= 0 and the micro-batch B >= 1");
  if (n_tok == 0) return;
  const int64_t blocks = std::min(kMaxBlocks, (n_tok + kBlock - 1) / kBlock);
  launch("sequence_positions", kernels::sequence_positions, dim3(unsigned(blocks)),
         dim3(unsigned(kBlock)), 0, stream, pos_T, n_tok, B);
}

}  // namespace moecore::ops::cuda
