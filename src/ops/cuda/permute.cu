// Token dispatch on the GPU. The permutation is a stable counting sort in two launches without
// scratch memory or atomics: a histogram (one block per expert counts its (t, k) slots with a
// fixed-tree block sum, into counts_E), then a placement (one block per expert takes its start
// offset as the sum of the counts before it, walks the slots in (t, k) order a block-width at a
// time and places its own by an exclusive block scan). So the maps and counts are bitwise the
// CPU's. The row gathers have one writer per output element; unpermute sums a token's slots in
// k order, as the CPU does: bitwise the CPU fast path.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/memory.h"
#include "ops/permute.h"

namespace moecore::ops::cuda {

namespace kernels {

// The exclusive prefix of v over the block (blockDim.x a multiple of 32), in thread order; *total
// gets the block's sum. Every thread calls it; `shared` holds blockDim.x / 32 ints and may be
// reused only after another __syncthreads.
__device__ __forceinline__ int block_exclusive_scan(int v, int* shared, int* total) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  int x = v;  // the warp's inclusive scan
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, unsigned(o));
    if (lane >= o) x += y;
  }
  if (lane == 31) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < n_warps ? shared[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, unsigned(o));
      if (lane >= o) s += y;
    }
    if (lane < n_warps) shared[lane] = s;  // the warps' inclusive prefixes
  }
  __syncthreads();
  *total = shared[n_warps - 1];
  return (warp > 0 ? shared[warp - 1] : 0) + x - v;
}

// counts_E[e] = the slots routed to e (block e). Ids outside [0, E) count nowhere.
__global__ void permutation_counts(int64_t* counts_E, const int32_t* idx_TK, int64_t TK) {
  const int32_t e = int32_t(blockIdx.x);
  int64_t c = 0;
  for (int64_t i = threadIdx.x; i < TK; i += blockDim.x) c += idx_TK[i] == e ? 1 : 0;
  c = block_sum(c, dynamic_shared<int64_t>());
  if (threadIdx.x == 0) counts_E[e] = c;
}

// Block e places expert e's slots at rows [sum of counts before e, ...) in (t, k) order. Block 0
// also marks the slots no expert takes (token_rows -1); the last block writes N and the pad rows
// [N, T K). Dynamic shared memory: blockDim.x / 32 + 1 int64 (the block sums, reused by the scan).
__global__ void permutation_place(int64_t* n_kept, int32_t* row_token_N, int32_t* row_slot_N,
                                  int32_t* token_rows_TK, const int64_t* counts_E,
                                  const int32_t* idx_TK, int64_t TK, int64_t K, int64_t E) {
  const int32_t e = int32_t(blockIdx.x);
  int64_t* sums = dynamic_shared<int64_t>();
  int64_t before = 0;
  for (int64_t j = threadIdx.x; j < e; j += blockDim.x) before += counts_E[j];
  int64_t row = block_sum(before, sums);
  __syncthreads();  // sums reused by the scans below
  int* scan = reinterpret_cast<int*>(sums);
  for (int64_t base = 0; base < TK; base += blockDim.x) {  // uniform trip count: every thread
    const int64_t i = base + threadIdx.x;
    const int32_t id = i < TK ? idx_TK[i] : -1;
    const bool mine = i < TK && id == e;
    int total = 0;
    const int at = block_exclusive_scan(mine ? 1 : 0, scan, &total);
    if (mine) {
      const int64_t r = row + at;
      row_token_N[r] = int32_t(i / K);
      row_slot_N[r] = int32_t(i % K);
      token_rows_TK[i] = int32_t(r);
    } else if (e == 0 && i < TK && (id < 0 || id >= E)) {
      token_rows_TK[i] = -1;
    }
    row += total;
    __syncthreads();  // scan's shared memory is read above before the next round writes it
  }
  if (e != E - 1) return;
  // row is now N: the kept rows end here.
  for (int64_t r = row + threadIdx.x; r < TK; r += blockDim.x) row_token_N[r] = row_slot_N[r] = -1;
  if (threadIdx.x == 0) *n_kept = row;
}

// One block: moves expert blocks from their packed offsets to e * cap, last expert first (blocks
// only move up); within a block, highest rows first, each round read before it is written, so the
// overlapping in-place move reads nothing already overwritten. Then token_rows follows.
__global__ void pad_permutation(int64_t* pads, int64_t* counts_E, int32_t* row_token_N,
                                int32_t* row_slot_N, int32_t* token_rows_TK, const int64_t* n_kept,
                                int64_t K, int64_t E, int64_t cap) {
  int64_t end = *n_kept, pad = 0;
  for (int64_t e = E - 1; e >= 0; --e) {
    const int64_t cnt = counts_E[e];
    const int64_t from = end - cnt;
    end = from;
    pad += cap - cnt;
    const int64_t moved = cnt < cap ? cnt : cap;  // cnt <= cap is the caller's precondition
    const int64_t to = e * cap;
    for (int64_t hi = moved; hi > 0; hi -= blockDim.x) {  // rows [hi - blockDim.x, hi)
      const int64_t j = hi - 1 - int64_t(threadIdx.x);
      int32_t tok = -1, slot = -1;
      if (j >= 0) {
        tok = row_token_N[from + j];
        slot = row_slot_N[from + j];
      }
      __syncthreads();
      if (j >= 0) {
        row_token_N[to + j] = tok;
        row_slot_N[to + j] = slot;
      }
      __syncthreads();
    }
    for (int64_t r = to + moved + threadIdx.x; r < to + cap; r += blockDim.x)
      row_token_N[r] = row_slot_N[r] = -1;
    __syncthreads();  // every thread read counts_E[e] above; the next expert's rows are below
  }
  for (int64_t r = threadIdx.x; r < E * cap; r += blockDim.x) {
    if (row_token_N[r] >= 0)
      token_rows_TK[int64_t(row_token_N[r]) * K + row_slot_N[r]] = int32_t(r);
  }
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) counts_E[e] = cap;
  if (threadIdx.x == 0) *pads = pad;
}

// build_group_permutation, three launches. Block (l, r) counts rank r's slots routed to local
// expert l into chunk_LR[l R + r]. Dynamic shared memory: blockDim.x / 32 + 1 int64.
__global__ void group_chunk_counts(int64_t* chunk_LR, const int32_t* idx_GK,
                                   const int64_t* tok_off_R, int64_t R, int64_t K, int64_t first) {
  const int64_t l = blockIdx.x, r = blockIdx.y, want = first + l;
  const int64_t end = tok_off_R[r + 1] * K;
  int64_t c = 0;
  for (int64_t i = tok_off_R[r] * K + threadIdx.x; i < end; i += blockDim.x) {
    const int64_t id = idx_GK[i];
    c += id >= 0 && id == want ? 1 : 0;
  }
  c = block_sum(c, dynamic_shared<int64_t>());
  if (threadIdx.x == 0) chunk_LR[l * R + r] = c;
}

// One thread, in the CPU's (l, r) order: chunk_LR's counts become the chunks' first rows, rank
// r's blocks padded to cap_R[r] when it is > 0; rows_L gets the rows per local expert and *pads
// the pad rows of rank me's blocks (only when N <= max_rows). A chunk over its rank's capacity
// stops the walk: rows_L[l] = -1 - r, its count left in chunk_LR[l R + r] (the host reports it).
__global__ void group_chunk_offsets(int64_t* rows_L, int64_t* pads, int64_t* chunk_LR,
                                    const int64_t* cap_R, int64_t R, int64_t L, int64_t me,
                                    int64_t max_rows) {
  if (threadIdx.x != 0) return;
  int64_t N = 0, pad = 0;
  for (int64_t l = 0; l < L; ++l) {
    int64_t rows = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t c = chunk_LR[l * R + r], cap = cap_R[r];
      if (cap > 0 && c > cap) {
        rows_L[l] = -1 - r;
        return;
      }
      const int64_t block = cap > 0 ? cap : c;
      if (r == me) pad += block - c;
      chunk_LR[l * R + r] = N;
      N += block;
      rows += block;
    }
    rows_L[l] = rows;
  }
  if (N <= max_rows) *pads = pad;
}

// Block (l, r) places rank r's slots of local expert l at its chunk's rows in (token, slot) order
// (an exclusive block scan per block-width of slots) and fills the chunk's pad rows; the blocks
// of l = 0 also mark the slots no local expert takes (group_rows -1). Nothing when N (the sum of
// rows_L) > max_rows or a chunk was over its capacity. With L = 0 the one block column only
// marks. Dynamic shared memory: blockDim.x / 32 ints.
__global__ void group_place(int32_t* row_token_N, int32_t* row_slot_N, int32_t* group_rows_GK,
                            const int64_t* rows_L, const int64_t* chunk_LR, const int32_t* idx_GK,
                            const int64_t* tok_off_R, const int64_t* cap_R, int64_t R, int64_t L,
                            int64_t K, int64_t first, int64_t max_rows) {
  int64_t N = 0;
  bool over_cap = false;
  for (int64_t j = 0; j < L; ++j) {
    const int64_t v = rows_L[j];
    over_cap = over_cap || v < 0;
    N += v;
  }
  if (over_cap || N > max_rows) return;  // uniform over the grid
  const int64_t l = blockIdx.x, r = blockIdx.y;
  const bool local = l < L;
  const int64_t start = local ? chunk_LR[l * R + r] : 0, want = first + l;
  int64_t row = start;
  int* scan = dynamic_shared<int>();
  const int64_t begin = tok_off_R[r] * K, end = tok_off_R[r + 1] * K;
  for (int64_t base = begin; base < end; base += blockDim.x) {  // uniform trip count
    const int64_t i = base + threadIdx.x;
    const int64_t id = i < end ? idx_GK[i] : -1;
    const bool mine = local && i < end && id >= 0 && id == want;
    int total = 0;
    const int at = block_exclusive_scan(mine ? 1 : 0, scan, &total);
    if (mine) {
      const int64_t row_i = row + at;
      row_token_N[row_i] = int32_t(i / K);
      row_slot_N[row_i] = int32_t(i % K);
      group_rows_GK[i] = int32_t(row_i);
    } else if (l == 0 && i < end && (id < 0 || id < first || id >= first + L)) {
      group_rows_GK[i] = -1;
    }
    row += total;
    __syncthreads();  // scan's shared memory is read above before the next round writes it
  }
  if (!local) return;
  const int64_t cap = cap_R[r], stop = cap > 0 ? start + cap : row;
  for (int64_t p = row + threadIdx.x; p < stop; p += blockDim.x)
    row_token_N[p] = row_slot_N[p] = -1;
}

template <typename T>
__global__ void gather_row_probs(T* p_N, const T* probs_TK, const int32_t* row_token_N,
                                 const int32_t* row_slot_N, int64_t N, int64_t K) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < N; r += stride) {
    const int32_t t = row_token_N[r];
    p_N[r] = t >= 0 ? probs_TK[int64_t(t) * K + row_slot_N[r]] : T(0);
  }
}

template <typename T>
__global__ void scatter_row_probs(T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK,
                                  int64_t TK) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < TK; i += stride) {
    const int32_t r = token_rows_TK[i];
    dprobs_TK[i] = r >= 0 ? dp_N[r] : T(0);
  }
}

// Block r copies row r (zeros for a pad row).
template <typename T>
__global__ void permute_rows(T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t H) {
  const int64_t r = blockIdx.x;
  const int32_t t = row_token_N[r];
  T* y = y_NH + r * H;
  if (t < 0) {
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) y[h] = T(0);
    return;
  }
  const T* x = x_TH + int64_t(t) * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) y[h] = x[h];
}

// Block t sums its kept rows in k order from 0 (the CPU's order: the same bits).
template <typename T>
__global__ void unpermute_rows(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int64_t K,
                               int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t* rows = token_rows_TK + t * K;
  T* y = y_TH + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    T s = T(0);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) s += x_NH[int64_t(r) * H + h];
    }
    y[h] = s;
  }
}

// Block c copies chunk c (its offsets and row count are in device memory; a negative one moves
// nothing: the CPU path checks them).
template <typename T>
__global__ void copy_row_chunks(T* dst_NW, const T* src_NW, const int64_t* dst_off,
                                const int64_t* src_off, const int64_t* rows, int64_t W) {
  const int64_t c = blockIdx.x;
  const int64_t n = rows[c] * W;
  if (rows[c] <= 0 || dst_off[c] < 0 || src_off[c] < 0) return;
  T* dst = dst_NW + dst_off[c] * W;
  const T* src = src_NW + src_off[c] * W;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxGrid = 0x7fffffff;

// Threads for a row of n elements: whole warps, at most kBlock.
unsigned row_block(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + 31) / 32 * 32, 32, kBlock));
}

// Blocks of kBlock threads for n elements (grid-stride beyond the grid limit).
unsigned flat_grid(int64_t n) {
  return unsigned(std::min(kMaxGrid, (n + kBlock - 1) / kBlock));
}

std::string rows_msg(const char* op, int64_t n_tok, int64_t K, int64_t E) {
  return std::string("[") + op + "] T=" + std::to_string(n_tok) + " K=" + std::to_string(K) +
         " E=" + std::to_string(E) +
         ": needs T >= 0, K >= 1, 1 <= E <= 2^31-1 and T*K rows within int32 (use smaller "
         "micro-batches)";
}
}  // namespace

void build_permutation(void* stream, int64_t* n_kept, int64_t* counts_E, int32_t* row_token_N,
                       int32_t* row_slot_N, int32_t* token_rows_TK, const int32_t* idx_TK,
                       int64_t n_tok, int64_t K, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1 && E >= 1 && E <= kMaxGrid && n_tok <= 0x7fffffff / K,
                   rows_msg("build_permutation", n_tok, K, E));
  const int64_t TK = n_tok * K;
  const unsigned block = row_block(TK);
  const size_t smem = size_t(block / 32 + 1) * sizeof(int64_t);
  launch("permutation_counts", kernels::permutation_counts, dim3(unsigned(E)), dim3(block), smem,
         stream, counts_E, idx_TK, TK);
  launch("permutation_place", kernels::permutation_place, dim3(unsigned(E)), dim3(block), smem,
         stream, n_kept, row_token_N, row_slot_N, token_rows_TK, counts_E, idx_TK, TK, K, E);
}

void pad_permutation(void* stream, int64_t* pads, int64_t* counts_E, int32_t* row_token_N,
                     int32_t* row_slot_N, int32_t* token_rows_TK, const int64_t* n_kept,
                     int64_t n_tok, int64_t K, int64_t E, int64_t cap) {
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1 && E >= 1 && cap >= 0 && E * cap <= 0x7fffffff,
                   "[pad_permutation] T=" + std::to_string(n_tok) + " K=" + std::to_string(K) +
                       " E=" + std::to_string(E) + " capacity=" + std::to_string(cap) +
                       ": needs K >= 1, E >= 1, capacity >= 0 and E * capacity rows within int32");
  launch("pad_permutation", kernels::pad_permutation, dim3(1), dim3(unsigned(kBlock)), 0, stream,
         pads, counts_E, row_token_N, row_slot_N, token_rows_TK, n_kept, K, E, cap);
}

int64_t build_group_permutation(void* stream, int64_t* rows_L, int32_t* row_token_N,
                                int32_t* row_slot_N, int32_t* group_rows_GK, int64_t* chunk_LR,
                                int64_t* pads, const GroupRouting& g) {
  MOE_KERNEL_CHECK(g.R >= 1 && g.R <= 65535 && g.me >= 0 && g.me < g.R && g.L >= 0 &&
                       g.L <= kMaxGrid && g.first >= 0 && g.first + g.L <= 0x7fffffff && g.K >= 1 &&
                       g.max_rows >= 0 && g.max_rows <= 0x7fffffff,
                   "[build_group_permutation] R=" + std::to_string(g.R) +
                       " me=" + std::to_string(g.me) + " L=" + std::to_string(g.L) +
                       " first=" + std::to_string(g.first) + " K=" + std::to_string(g.K) +
                       " max_rows=" + std::to_string(g.max_rows) +
                       ": needs 1 <= R <= 65535 (a block column per rank), 0 <= me < R, L >= 0, "
                       "expert ids first..first+L within int32, K >= 1 and 0 <= max_rows <= "
                       "2^31-1 (int32 rows)");
  const int32_t* idx = raw_ptr(g.idx_GK);
  const int64_t* tok_off = raw_ptr(g.tok_off_R);
  const int64_t* cap = raw_ptr(g.cap_R);
  const unsigned block = unsigned(kBlock);
  if (g.L > 0) {
    launch("group_chunk_counts", kernels::group_chunk_counts, dim3(unsigned(g.L), unsigned(g.R)),
           dim3(block), size_t(block / 32 + 1) * sizeof(int64_t), stream, chunk_LR, idx, tok_off,
           g.R, g.K, g.first);
  }
  launch("group_chunk_offsets", kernels::group_chunk_offsets, dim3(1), dim3(32), 0, stream, rows_L,
         pads, chunk_LR, cap, g.R, g.L, g.me, g.max_rows);
  launch("group_place", kernels::group_place,
         dim3(unsigned(std::max<int64_t>(g.L, 1)), unsigned(g.R)), dim3(block),
         size_t(block / 32) * sizeof(int), stream, row_token_N, row_slot_N, group_rows_GK, rows_L,
         chunk_LR, idx, tok_off, cap, g.R, g.L, g.K, g.first, g.max_rows);
  // N back to the host: the all-gather dispatcher's documented sync (its token-count exchange
  // point). rows_L in pieces of a fixed host buffer: nothing allocates.
  // (ops::read_back's audit and copy, called directly: this is the kernel side of its switch.)
  const auto read = [stream](int64_t* dst, const int64_t* src, int64_t n) {
    SyncAudit::instance().host_sync("ops::read_back: the host reads device data");
    read_back_bytes(stream, dst, src, size_t(n) * sizeof(int64_t));
  };
  int64_t N = 0;
  int64_t piece[64];
  for (int64_t l0 = 0; l0 < g.L; l0 += 64) {
    const int64_t n = std::min<int64_t>(64, g.L - l0);
    read(piece, rows_L + l0, n);
    for (int64_t j = 0; j < n; ++j) {
      if (piece[j] < 0) {  // a chunk over its capacity (group_chunk_offsets): the CPU's error
        const int64_t l = l0 + j, r = -1 - piece[j];
        int64_t c = 0, cap_r = 0;
        read(&c, chunk_LR + l * g.R + r, 1);
        read(&cap_r, cap + r, 1);
        fail(nullptr, __FILE__, __LINE__,
             "[dispatcher] expert " + std::to_string(g.first + l) + " has " + std::to_string(c) +
                 " rows from EP rank " + std::to_string(r) + " > capacity " +
                 std::to_string(cap_r) + ": the router must drop to capacity before padding");
      }
      N += piece[j];
    }
  }
  return N;
}

template <typename T>
void gather_row_probs(void* stream, T* p_N, const T* probs_TK, const int32_t* row_token_N,
                      const int32_t* row_slot_N, int64_t N, int64_t K) {
  MOE_KERNEL_CHECK(N >= 0 && K >= 1, "[gather_row_probs] rows=" + std::to_string(N) +
                                         " K=" + std::to_string(K) + ": needs rows >= 0, K >= 1");
  if (N == 0) return;
  launch("gather_row_probs", kernels::gather_row_probs<T>, dim3(flat_grid(N)),
         dim3(unsigned(kBlock)), 0, stream, p_N, probs_TK, row_token_N, row_slot_N, N, K);
}

template <typename T>
void scatter_row_probs(void* stream, T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK,
                       int64_t TK) {
  MOE_KERNEL_CHECK(TK >= 0, "[scatter_row_probs] T*K=" + std::to_string(TK) + " < 0");
  if (TK == 0) return;
  launch("scatter_row_probs", kernels::scatter_row_probs<T>, dim3(flat_grid(TK)),
         dim3(unsigned(kBlock)), 0, stream, dprobs_TK, dp_N, token_rows_TK, TK);
}

template <typename T>
void permute_rows(void* stream, T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N,
                  int64_t H) {
  MOE_KERNEL_CHECK(N >= 0 && N <= kMaxGrid && H >= 0,
                   "[permute_rows] rows=" + std::to_string(N) +
                       " (0 to 2^31-1, one block each), H=" + std::to_string(H) + " (>= 0)");
  if (N == 0 || H == 0) return;
  launch("permute_rows", kernels::permute_rows<T>, dim3(unsigned(N)), dim3(row_block(H)), 0, stream,
         y_NH, x_TH, row_token_N, H);
}

template <typename T>
void unpermute_rows(void* stream, T* y_TH, const T* x_NH, const int32_t* token_rows_TK,
                    int64_t n_tok, int64_t K, int64_t H) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= kMaxGrid && K >= 0 && H >= 0,
                   "[unpermute_rows] T=" + std::to_string(n_tok) +
                       " (0 to 2^31-1, one block each), K=" + std::to_string(K) +
                       " H=" + std::to_string(H) + " (>= 0)");
  if (n_tok == 0 || H == 0) return;
  launch("unpermute_rows", kernels::unpermute_rows<T>, dim3(unsigned(n_tok)), dim3(row_block(H)), 0,
         stream, y_TH, x_NH, token_rows_TK, K, H);
}

template <typename T>
void copy_row_chunks(void* stream, T* dst_NW, const T* src_NW, const int64_t* dst_off,
                     const int64_t* src_off, const int64_t* rows, int64_t n_chunks, int64_t W) {
  MOE_KERNEL_CHECK(n_chunks >= 0 && n_chunks <= kMaxGrid && W >= 0,
                   "[copy_row_chunks] chunks=" + std::to_string(n_chunks) +
                       " (0 to 2^31-1, one block each), W=" + std::to_string(W) + " (>= 0)");
  if (n_chunks == 0 || W == 0) return;
  launch("copy_row_chunks", kernels::copy_row_chunks<T>, dim3(unsigned(n_chunks)),
         dim3(unsigned(kBlock)), 0, stream, dst_NW, src_NW, dst_off, src_off, rows, W);
}

#define MOECORE_PERMUTE_INSTANTIATE(T)                                                             \
  template void gather_row_probs<T>(void*, T*, const T*, const int32_t*, const int32_t*, int64_t,  \
                                    int64_t);                                                      \
  template void scatter_row_probs<T>(void*, T*, const T*, const int32_t*, int64_t);                \
  template void permute_rows<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t);            \
  template void unpermute_rows<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t); \
  template void copy_row_chunks<T>(void*, T*, const T*, const int64_t*, const int64_t*,            \
                                   const int64_t*, int64_t, int64_t);
MOECORE_PERMUTE_INSTANTIATE(float)
MOECORE_PERMUTE_INSTANTIATE(double)
#undef MOECORE_PERMUTE_INSTANTIATE

}  // namespace moecore::ops::cuda
