// Router selection on the GPU (f64 keys, docs/router.md), each result bitwise the CPU fast path's
// on the same inputs: the key and the top-K prefix element by element; the group mask one thread
// per row in the CPU's order (each group's top keys summed largest first, the groups picked best
// first with ties to the lower group); Sinkhorn in one block that iterates on the device (no host
// sync), each row / column sum on one thread in the CPU's order; capacity one block per expert:
// its pairs compacted in token order by a block scan, each pair's rank among them counted, the
// pairs ranked at or past the capacity dropped. No atomics anywhere.
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/memory.h"
#include "ops/router_select.h"

namespace moecore::ops::cuda {

namespace {
// cpu::sinkhorn_balance's constants (Megatron's): stop when mean |d1 change| <= tol; eps guards
// the divisions.
constexpr double kSinkhornTol = 1e-4;
constexpr double kSinkhornEps = 1e-8;
constexpr int kSinkhornMaxIters = 100000;
constexpr int64_t kMaxGroups = 256;
constexpr int64_t kBlock = 256;
constexpr int64_t kSinkhornMaxBlock = 1024;
}  // namespace

namespace kernels {
__global__ void routing_key(double* key_TE, const double* src_TE, const float* offset_E,
                            bool subtract, int64_t n, int64_t E) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double s = src_TE[i];
    const double off = offset_E[i % E];
    key_TE[i] = subtract ? s - off : s + off;
  }
}

// One thread per row. scratch's row holds each group's keys while its top kg are selected
// (largest first into the front, as std::partial_sort leaves them), then the group's score in
// the group's first slot.
__global__ void group_limited_mask(double* key_TE, double* scratch_TE, int64_t n_tok, int64_t E,
                                   int64_t G, int64_t g, int64_t K) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tok) return;
  const int64_t per = E / G, kg = K / g;
  double* key = key_TE + t * E;
  double* row = scratch_TE + t * E;
  for (int64_t j = 0; j < G; ++j) {
    double* seg = row + j * per;
    for (int64_t i = 0; i < per; ++i) seg[i] = key[j * per + i];
    double sum = 0;
    for (int64_t i = 0; i < kg; ++i) {
      int64_t best = i;
      for (int64_t m = i + 1; m < per; ++m) {
        if (seg[m] > seg[best]) best = m;
      }
      const double v = seg[best];
      seg[best] = seg[i];
      seg[i] = v;
      sum += v;
    }
    seg[0] = sum;
  }
  // g rounds, each picking the best group after the last pick in the order (score descending,
  // group ascending); NaN scores are never picked, as on the CPU.
  double last_s = 0;
  int64_t last_j = -1;
  for (int64_t r = 0; r < g; ++r) {
    int64_t best = -1;
    double best_s = 0;
    for (int64_t j = 0; j < G; ++j) {
      const double s = row[j * per];
      if (std::isnan(s)) continue;
      if (last_j >= 0 && !(s < last_s || (s == last_s && j > last_j))) continue;
      if (best < 0 || s > best_s) {
        best = j;
        best_s = s;
      }
    }
    if (best < 0) break;
    last_s = best_s;
    last_j = best;
  }
  for (int64_t j = 0; j < G; ++j) {
    const double s = row[j * per];
    const bool keep = last_j >= 0 && !std::isnan(s) && (s > last_s || (s == last_s && j <= last_j));
    if (keep) continue;
    for (int64_t i = 0; i < per; ++i) key[j * per + i] = -INFINITY;
  }
}

// One block: cost = exp(logits), then the Sinkhorn iterations until the mean |change of d1| is
// within the tolerance. d0 [T] and d1 [2 E] (d1, then the previous iteration's) live in the
// outputs. Each d0[t] is one thread's sum over e in order, each d1[e] one thread's sum over t in
// order, the error thread 0's sum over e: cpu::sinkhorn_balance's order. Not converging in the
// iteration limit leaves cost NaN (the step's non-finite check reports it; the device cannot
// throw). The sums' products are fused multiply-adds, as in the CPU paths.
__global__ void sinkhorn_balance(double* cost_TE, double* d0_T, double* d1_2E,
                                 const double* logits_TE, int64_t n, int64_t E, double tol,
                                 double eps, int max_iters) {
  __shared__ double s_error;
  const int64_t tid = threadIdx.x, nthr = blockDim.x;
  double* d1 = d1_2E;
  double* d1_old = d1_2E + E;
  for (int64_t i = tid; i < n * E; i += nthr) cost_TE[i] = std::exp(logits_TE[i]);
  for (int64_t t = tid; t < n; t += nthr) d0_T[t] = 1.0;
  for (int64_t e = tid; e < E; e += nthr) d1[e] = d1_old[e] = 1.0;
  __syncthreads();
  double error = 1e9;
  int iters = 0;
  while (error > tol) {
    if (++iters > max_iters) {
      for (int64_t i = tid; i < n * E; i += nthr) cost_TE[i] = NAN;
      return;  // every thread leaves here: iters and error are the same in every thread
    }
    for (int64_t t = tid; t < n; t += nthr) {
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc = std::fma(d1[e], cost_TE[t * E + e], acc);
      d0_T[t] = (1.0 / static_cast<double>(n)) * 1.0 / (acc + eps);
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += nthr) {
      double acc = 0;
      for (int64_t t = 0; t < n; ++t) acc = std::fma(d0_T[t], cost_TE[t * E + e], acc);
      d1[e] = (1.0 / static_cast<double>(E)) * 1.0 / (acc + eps);
    }
    __syncthreads();
    if (tid == 0) {
      double err = 0;
      for (int64_t e = 0; e < E; ++e) err += std::abs(d1_old[e] - d1[e]);
      s_error = err / static_cast<double>(E);
    }
    __syncthreads();
    error = s_error;
    for (int64_t e = tid; e < E; e += nthr) d1_old[e] = d1[e];
    // The next write of s_error and the next reads of d1_old follow two more barriers.
    __syncthreads();
  }
  for (int64_t i = tid; i < n * E; i += nthr) cost_TE[i] *= d1[i % E] * d0_T[i / E];
}

__global__ void topk_prefix(int32_t* idx_TK, const int32_t* idx_TK1, int64_t n, int64_t K,
                            int64_t K1) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    idx_TK[i] = idx_TK1[(i / K) * K1 + i % K];
  }
}

// One block per expert e (idx already holds routed). Its pairs' count n_e and the pairs of the
// lower experts (its list's start in cand) by block sums; its pairs compacted into cand in token
// order by a block scan of flags per chunk; if n_e > capacity each pair's rank (by probs: the
// pairs with a larger prob, or an equal prob and a lower (t, k); else its list position) decides
// it, idx -1 first, probs 0 after a barrier (the ranks read the probs). off: [E + 1] list offsets,
// then [E] counts (the dropped total's input). Dynamic shared memory: blockDim.x + blockDim.x / 32
// + 1 int64.
__global__ void capacity_per_expert(int32_t* idx_TK, double* probs_TK, int32_t* cand_N,
                                    int64_t* off_2E1, const int32_t* routed_TK, int64_t TK,
                                    int64_t E, int64_t cap, bool by_probs) {
  int64_t* scan = dynamic_shared<int64_t>();
  int64_t* red = scan + blockDim.x;
  const int64_t e = blockIdx.x, tid = threadIdx.x, nthr = blockDim.x;
  int64_t mine = 0, lower = 0;
  for (int64_t i = tid; i < TK; i += nthr) {
    const int32_t r = routed_TK[i];
    mine += r == e;
    lower += r < e;
  }
  const int64_t n_e = block_sum(mine, red);  // its result slot is rewritten after the next barrier
  const int64_t start = block_sum(lower, red);
  if (tid == 0) {
    if (e == 0) off_2E1[0] = 0;
    off_2E1[e + 1] = start + n_e;
    off_2E1[E + 1 + e] = n_e;
  }
  if (n_e <= cap) return;  // the same in every thread
  int64_t pos = 0;
  for (int64_t base = 0; base < TK; base += nthr) {
    const int64_t i = base + tid;
    const int64_t flag = i < TK && routed_TK[i] == e;
    scan[tid] = flag;
    __syncthreads();
    for (int64_t d = 1; d < nthr; d <<= 1) {  // inclusive Hillis-Steele scan
      const int64_t v = tid >= d ? scan[tid - d] : 0;
      __syncthreads();
      scan[tid] += v;
      __syncthreads();
    }
    if (flag) cand_N[start + pos + scan[tid] - 1] = int32_t(i);
    pos += scan[nthr - 1];
    __syncthreads();  // every thread has read the total before the next chunk's flags
  }
  const int32_t* list = cand_N + start;
  for (int64_t r = tid; r < n_e; r += nthr) {
    const int32_t i = list[r];
    int64_t rank = r;
    if (by_probs) {
      const double p = probs_TK[i];
      rank = 0;
      for (int64_t m = 0; m < n_e; ++m) {
        const int32_t j = list[m];
        rank += probs_TK[j] > p || (probs_TK[j] == p && j < i);
      }
    }
    if (rank >= cap) idx_TK[i] = -1;
  }
  __syncthreads();
  for (int64_t r = tid; r < n_e; r += nthr) {
    const int32_t i = list[r];
    if (idx_TK[i] == -1) probs_TK[i] = 0.0;
  }
}

// One thread: the dropped total from the experts' counts.
__global__ void capacity_dropped(int64_t* dropped, const int64_t* off_2E1, int64_t E, int64_t cap) {
  int64_t d = 0;
  for (int64_t e = 0; e < E; ++e) d += std::max<int64_t>(off_2E1[E + 1 + e] - cap, 0);
  *dropped = d;
}
}  // namespace kernels

namespace {
unsigned grid_for(int64_t n) {
  return unsigned(std::min<int64_t>((n + kBlock - 1) / kBlock, 65535));
}
}  // namespace

void routing_key(void* stream, double* key_TE, const double* src_TE, const float* offset_E,
                 bool subtract, int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E > 0, "[routing_key] tokens=" + std::to_string(n_tok) +
                                            " (>= 0), experts=" + std::to_string(E) + " (> 0)");
  const int64_t n = n_tok * E;
  if (n == 0) return;
  if (!offset_E) {
    if (key_TE != src_TE) copy_bytes(stream, key_TE, src_TE, sizeof(double) * n);
    return;
  }
  launch("routing_key", kernels::routing_key, dim3(grid_for(n)), dim3(unsigned(kBlock)), 0, stream,
         key_TE, src_TE, offset_E, subtract, n, E);
}

void group_limited_mask(void* stream, double* key_TE, double* scratch_TE, int64_t n_tok, int64_t E,
                        int64_t num_groups, int64_t group_topk, int64_t K) {
  const int64_t G = num_groups, g = group_topk;
  MOE_KERNEL_CHECK(
      G >= 1 && G <= kMaxGroups && E % G == 0 && g >= 1 && g <= G && K % g == 0 && K / g <= E / G,
      "[group_limited_mask] num_groups=" + std::to_string(G) + " group_topk=" + std::to_string(g) +
          " topk=" + std::to_string(K) + " num_experts=" + std::to_string(E) +
          ": need num_groups in [1, 256] dividing num_experts, group_topk in [1, "
          "num_groups] dividing topk, topk / group_topk <= num_experts / num_groups");
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff,
                   "[group_limited_mask] tokens=" + std::to_string(n_tok) + " outside [0, 2^31-1]");
  if (n_tok == 0) return;
  const int64_t block = 128;
  launch("group_limited_mask", kernels::group_limited_mask,
         dim3(unsigned((n_tok + block - 1) / block)), dim3(unsigned(block)), 0, stream, key_TE,
         scratch_TE, n_tok, E, G, g, K);
}

void sinkhorn_balance(void* stream, double* cost_TE, double* d0_T, double* d1_2E,
                      const double* logits_TE, int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && E > 0, "[sinkhorn_balance] tokens=" + std::to_string(n_tok) +
                                            " (>= 0), experts=" + std::to_string(E) + " (> 0)");
  const int64_t block = std::min(kSinkhornMaxBlock, (std::max(n_tok, E) + 31) / 32 * 32);
  launch("sinkhorn_balance", kernels::sinkhorn_balance, dim3(1), dim3(unsigned(block)), 0, stream,
         cost_TE, d0_T, d1_2E, logits_TE, n_tok, E, kSinkhornTol, kSinkhornEps, kSinkhornMaxIters);
}

void topk_prefix(void* stream, int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K,
                 int64_t K1) {
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1 && K <= K1,
                   "[topk_prefix] tokens=" + std::to_string(n_tok) + " K=" + std::to_string(K) +
                       " K1=" + std::to_string(K1) + ": need tokens >= 0 and 1 <= K <= K1");
  const int64_t n = n_tok * K;
  if (n == 0) return;
  launch("topk_prefix", kernels::topk_prefix, dim3(grid_for(n)), dim3(unsigned(kBlock)), 0, stream,
         idx_TK, idx_TK1, n, K, K1);
}

void apply_capacity(void* stream, int32_t* idx_TK, double* probs_TK, int64_t* dropped,
                    int32_t* cand_N, int64_t* cand_off_2E1, const int32_t* routed_TK, int64_t n_tok,
                    int64_t K, int64_t E, int64_t capacity, bool by_probs) {
  const int64_t TK = n_tok * K;
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1 && E >= 1 && E <= 0x7fffffff && TK <= 0x7fffffff,
                   "[apply_capacity] tokens=" + std::to_string(n_tok) + " K=" + std::to_string(K) +
                       " experts=" + std::to_string(E) +
                       ": need tokens >= 0, K >= 1, experts in [1, 2^31-1], tokens * K < 2^31");
  if (TK > 0) copy_bytes(stream, idx_TK, routed_TK, sizeof(int32_t) * TK);
  if (capacity <= 0) {
    zero_bytes(stream, dropped, sizeof(int64_t));
    return;
  }
  const int64_t block = std::min(kBlock, std::max<int64_t>(32, (TK + 31) / 32 * 32));
  launch("capacity_per_expert", kernels::capacity_per_expert, dim3(unsigned(E)),
         dim3(unsigned(block)), size_t(block + block / 32 + 1) * sizeof(int64_t), stream, idx_TK,
         probs_TK, cand_N, cand_off_2E1, routed_TK, TK, E, capacity, by_probs);
  launch("capacity_dropped", kernels::capacity_dropped, dim3(1), dim3(1), 0, stream, dropped,
         static_cast<const int64_t*>(cand_off_2E1), E, capacity);
}

}  // namespace moecore::ops::cuda
