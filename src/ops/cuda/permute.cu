// Token dispatch on the GPU. The permutation is a stable counting sort in O(T K + E B) without
// atomics or extra memory: B tiles of consecutive slots, one warp each, count their slots per
// expert; one block scans the [E, B] counters (expert-major) into each tile's first row of each
// expert; each tile then places its slots in (t, k) order, a slot's row being its expert's
// counter plus the lower lanes holding the same expert. The counters live in row_slot's memory
// (or counts_E's, for a single tile) until the last launch writes row_slot. So the maps and counts
// are bitwise the CPU's. Padding to capacity moves every row in parallel from its packed row. The
// row gathers have one writer per output element (16-byte vectors where the rows allow);
// unpermute sums a token's slots in k order, as the CPU does: bitwise the CPU fast path.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cast.h"
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

// The set bits of m (POPC on the device).
__device__ __forceinline__ int popcount(unsigned m) {
#ifdef __CUDA_ARCH__
  return __popc(m);
#else
  return std::popcount(m);
#endif
}

// The lanes of the warp holding the same v as this lane (this lane included), through the warp's
// 32 ints of shared memory: each lane writes its v, then reads all 32 (broadcast reads). Every
// lane of the warp calls it; the slots are free again when it returns.
__device__ __forceinline__ unsigned warp_peers(int32_t v, int32_t* warp_ids) {
  const int lane = int(threadIdx.x % 32u);
  warp_ids[lane] = v;
  __syncwarp();  // every lane's v is written before any lane reads
  unsigned peers = 0;
  for (int j = 0; j < 32; ++j) peers |= unsigned(warp_ids[j] == v) << j;
  __syncwarp();  // every lane has read before the next call writes
  return peers;
}

// build_permutation, five launches, O(T K + E B) work for B tiles of S consecutive slots, one
// warp per tile; M [E, B] (expert-major) is the tiles' per-expert counters. A tile walks its
// slots 32 at a time in (t, k) order: the lanes holding the same expert find each other
// (warp_peers), a slot's place among them is the count of lower lanes, and the lowest lane alone
// advances the expert's counter; so nothing is ever added by two threads at once and the result
// does not depend on scheduling. Ids outside [0, E) count nowhere.

// Tile w's column of M: M[e B + w] = its slots routed to e. Dynamic shared memory: blockDim.x ints
// (warp_peers').
__global__ void permutation_tile_counts(int32_t* M_EB, const int32_t* idx_TK, int32_t TK, int32_t E,
                                        int32_t B, int32_t S) {
  const int32_t w = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32u);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  if (w >= B) return;  // the whole warp
  int32_t* warp_ids = dynamic_shared<int32_t>() + (threadIdx.x / 32u) * 32u;
  for (int32_t e = lane; e < E; e += 32) M_EB[e * B + w] = 0;
  __syncwarp();  // the zeros are written before any lane adds to them
  const int32_t begin = w * S, n = S < TK - begin ? S : TK - begin;
  for (int32_t off = 0; off < n; off += 32) {
    const int32_t i = begin + off + lane;
    const int32_t id = off + lane < n ? idx_TK[i] : -1;
    const bool kept = id >= 0 && id < E;
    const unsigned peers = warp_peers(kept ? id : -1, warp_ids);
    if (kept && (peers & ((1u << lane) - 1u)) == 0) M_EB[id * B + w] += popcount(peers);
    __syncwarp();  // this round's sums are in before the next round reads them
  }
}

// One block: M (n = E B counters, expert-major) becomes its exclusive prefix, i.e. tile w's first
// row of expert e. Dynamic shared memory: blockDim.x / 32 ints.
__global__ void permutation_offsets(int32_t* M, int32_t n) {
  int* scan = dynamic_shared<int>();
  int carry = 0;
  for (uint32_t base = 0; base < uint32_t(n); base += blockDim.x) {  // uniform trip count
    const uint32_t i = base + threadIdx.x;
    const int v = i < uint32_t(n) ? M[i] : 0;
    int total = 0;
    const int at = block_exclusive_scan(v, scan, &total);
    if (i < uint32_t(n)) M[i] = carry + at;
    carry += total;
    __syncthreads();  // scan's shared memory is read above before the next round writes it
  }
}

// Tile w places its slots: the slot's row is its expert's counter plus its place among the
// round's peers; row_token and token_rows are written here, row_slot by permutation_slots (M may
// live in row_slot's memory until then). After it M[e B + w] is the row after tile w's last of e.
// Dynamic shared memory: blockDim.x ints.
__global__ void permutation_place(int32_t* row_token_N, int32_t* token_rows_TK, int32_t* M_EB,
                                  const int32_t* idx_TK, int32_t TK, int32_t K, int32_t E,
                                  int32_t B, int32_t S) {
  const int32_t w = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32u);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  if (w >= B) return;
  int32_t* warp_ids = dynamic_shared<int32_t>() + (threadIdx.x / 32u) * 32u;
  const int32_t begin = w * S, n = S < TK - begin ? S : TK - begin;
  for (int32_t off = 0; off < n; off += 32) {
    const bool in = off + lane < n;
    const int32_t i = begin + off + lane;
    const int32_t id = in ? idx_TK[i] : -1;
    const bool kept = id >= 0 && id < E;
    const unsigned peers = warp_peers(kept ? id : -1, warp_ids);
    const unsigned below = peers & ((1u << lane) - 1u);
    const int32_t first = kept ? M_EB[id * B + w] : 0;
    __syncwarp();  // every peer has read the counter before the lowest one advances it
    if (kept) {
      const int32_t r = first + popcount(below);
      row_token_N[r] = i / K;
      token_rows_TK[i] = r;
      if (below == 0) M_EB[id * B + w] = first + popcount(peers);
    } else if (in) {
      token_rows_TK[i] = -1;
    }
    __syncwarp();
  }
}

// One block: counts_E[e] = the end of e's rows (M's last column) minus the end of e - 1's, *n_kept
// the end of the last. M may be counts_E's own memory read as E int32 (a single tile): the chunks
// go from the top down and each reads its ints (and the one below) before it writes, so a write
// (int64 e covers ints 2e and 2e + 1 >= the chunk's lowest) never lands on an int still unread.
__global__ void permutation_counts(int64_t* counts_E, int64_t* n_kept, const int32_t* M_EB,
                                   int32_t E, int32_t B) {
  for (int32_t hi = E; hi > 0; hi -= int32_t(blockDim.x)) {  // uniform trip count
    const int32_t lo = hi > int32_t(blockDim.x) ? hi - int32_t(blockDim.x) : 0;
    const int32_t e = lo + int32_t(threadIdx.x);
    int32_t end = 0, start = 0;
    if (e < hi) {
      end = M_EB[e * B + B - 1];
      start = e > 0 ? M_EB[(e - 1) * B + B - 1] : 0;
    }
    __syncthreads();
    if (e < hi) counts_E[e] = end - start;
    if (e == E - 1) *n_kept = end;
    __syncthreads();
  }
}

// row_slot of each kept slot's row, and the pad rows [N, T K) (row_token = row_slot = -1).
__global__ void permutation_slots(int32_t* row_token_N, int32_t* row_slot_N,
                                  const int32_t* token_rows_TK, const int64_t* n_kept, int32_t TK,
                                  int32_t K) {
  const int32_t N = int32_t(*n_kept);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < uint32_t(TK); u += stride) {
    const int32_t i = int32_t(u);
    const int32_t r = token_rows_TK[i];
    if (r >= 0) row_slot_N[r] = i % K;
    if (i >= N) row_token_N[i] = row_slot_N[i] = -1;
  }
}

// pad_permutation, three launches, all in parallel and without reading the packed row_token /
// row_slot: each kept slot's packed row (token_rows) gives its expert (a binary search in the
// experts' row ends) and its place in the expert's block, hence its padded row; the rows of a
// block past its count become pad rows. So the in-place move needs no order. A slot past cap rows
// of its expert (the CPU path throws there) is dropped (token_rows -1).

// One block: counts_E becomes the inclusive prefix (each expert's end row), *pads = E cap - N.
// Dynamic shared memory: blockDim.x / 32 ints.
__global__ void pad_ends(int64_t* counts_E, int64_t* pads, int32_t E, int32_t cap) {
  int* scan = dynamic_shared<int>();
  int carry = 0;
  for (uint32_t base = 0; base < uint32_t(E); base += blockDim.x) {  // uniform trip count
    const uint32_t e = base + threadIdx.x;
    const int v = e < uint32_t(E) ? int(counts_E[e]) : 0;
    int total = 0;
    const int at = block_exclusive_scan(v, scan, &total);
    if (e < uint32_t(E)) counts_E[e] = carry + at + v;
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) *pads = int64_t(E) * cap - carry;
}

// Slots [0, T K) and rows [0, E cap), one index space of max of the two.
__global__ void pad_place(int32_t* row_token_N, int32_t* row_slot_N, int32_t* token_rows_TK,
                          const int64_t* end_E, int32_t TK, int32_t K, int32_t E, int32_t cap) {
  const int32_t rows = E * cap, n = TK > rows ? TK : rows;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < uint32_t(n); u += stride) {
    const int32_t j = int32_t(u);
    if (j < TK) {
      const int32_t r = token_rows_TK[j];
      if (r >= 0) {
        int32_t lo = 0, hi = E;  // the first expert whose end is past r
        while (lo < hi) {
          const int32_t mid = lo + (hi - lo) / 2;
          if (end_E[mid] > r) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        const int32_t start = lo > 0 ? int32_t(end_E[lo - 1]) : 0;
        if (lo < E && r - start < cap) {
          const int32_t p = lo * cap + (r - start);
          row_token_N[p] = j / K;
          row_slot_N[p] = j % K;
          token_rows_TK[j] = p;
        } else {
          token_rows_TK[j] = -1;
        }
      }
    }
    if (j < rows) {
      const int32_t e = j / cap, q = j - e * cap;
      const int32_t start = e > 0 ? int32_t(end_E[e - 1]) : 0;
      if (q >= int32_t(end_E[e]) - start) row_token_N[j] = row_slot_N[j] = -1;
    }
  }
}

__global__ void pad_counts(int64_t* counts_E, int32_t E, int32_t cap) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < uint32_t(E); e += stride)
    counts_E[e] = cap;
}

// build_group_permutation: histogram -> scan -> stable scatter, O(G K + L R) work for G K slots
// (rank r's tokens [tok_off[r], tok_off[r + 1]), K slots each) and L R chunks (local expert l,
// source rank r). The chunks' counts are a histogram (integer atomics: the counts, hence
// everything after them, do not depend on the order of the adds); one thread walks them into
// rows_L, the pads and each chunk's base (its first row, less the slots of expert l before the
// chunk in slot order); then the stable scatter is build_permutation's: B tiles of S consecutive
// slots (S = max(512, 2 L) rounded to the warp), one warp each, count their slots per local
// expert into M [L, B] (expert-major), one block scans M, and each tile places its slots in slot
// order, a slot's row being its chunk's base plus its expert's counter plus the lower lanes
// holding the same expert. So a slot's row is its chunk's first row plus the slots of its chunk
// before it: the (local expert, source rank, token, slot) order of the reference, bitwise. M lives
// in group_rows' memory (S >= 2 L keeps L B <= G K when B >= 2) or, for one tile, in the second
// half of chunk_LR's (L ints of its 2 L R); group_rows is written last, from the rows. Nothing
// but rows_L is written when a chunk is over its capacity or N > max_rows. 32-bit indices: G K
// and the rows within int32 (checked on the host).

// The rank whose tokens hold token t (the last r with tok_off[r] <= t: ranks without tokens hold
// none).
__device__ __forceinline__ int32_t rank_of(const int64_t* tok_off_R, int32_t R, int32_t t) {
  int32_t lo = 0, hi = R;
  while (hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (tok_off_R[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The local expert of a routed id (-1: dropped or another rank's expert).
__device__ __forceinline__ int32_t local_expert(int32_t id, int32_t first, int32_t L) {
  const int32_t l = id - first;
  return id >= 0 && l >= 0 && l < L ? l : -1;
}

// N = the sum of rows_L when every chunk fit its capacity and N <= max_rows (the walk placed the
// chunks), else -1: then nothing but rows_L is written. Every lane of the warp calls it.
__device__ __forceinline__ int32_t group_rows_placed(const int64_t* rows_L, int32_t L,
                                                     int64_t max_rows) {
  const int32_t lane = int32_t(threadIdx.x % 32u);
  int64_t n = 0;
  bool over = false;
  for (int32_t l = lane; l < L; l += 32) {
    const int64_t v = rows_L[l];
    over = over || v < 0;
    n += v < 0 ? 0 : v;
  }
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  return __any_sync(0xffffffffu, over) || n > max_rows ? -1 : int32_t(n);
}

// The slots G K (from the device's tok_off) and the tiles B of S slots (at least one).
__device__ __forceinline__ int32_t group_slots(const int64_t* tok_off_R, int32_t R, int32_t K) {
  return int32_t(tok_off_R[R] * K);
}
__device__ __forceinline__ int32_t group_tiles(int32_t GK, int32_t S) {
  return GK > S ? (GK + S - 1) / S : 1;
}
// M's memory: group_rows' for two tiles or more, else after the chunks' bases in chunk_LR's.
__device__ __forceinline__ int32_t* group_counters(int32_t* group_rows_GK, int64_t* chunk_LR,
                                                   int32_t B, int32_t L, int32_t R) {
  return B >= 2 ? group_rows_GK : reinterpret_cast<int32_t*>(chunk_LR) + L * R;
}

__global__ void group_zero(int64_t* chunk_LR, int32_t n) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < uint32_t(n); j += stride)
    chunk_LR[j] = 0;
}

// The histogram: chunk_LR[l R + r] += rank r's slots routed to local expert l, a warp's 32 slots
// at a time, the lowest lane of each (l, r) adding its peers' count. Dynamic shared memory:
// blockDim.x ints (warp_peers').
__global__ void group_counts(int64_t* chunk_LR, const int32_t* idx_GK, const int64_t* tok_off_R,
                             int32_t R, int32_t L, int32_t K, int32_t first) {
  const int32_t GK = group_slots(tok_off_R, R, K);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  const int32_t warp = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32u);
  const int32_t warps = int32_t(gridDim.x * blockDim.x / 32u);
  int32_t* warp_ids = dynamic_shared<int32_t>() + (threadIdx.x / 32u) * 32u;
  for (int64_t base = int64_t(warp) * 32; base < GK; base += int64_t(warps) * 32) {  // per warp
    const int32_t i = int32_t(base) + lane;
    const int32_t l = i < GK ? local_expert(idx_GK[i], first, L) : -1;
    const int32_t key = l >= 0 ? l * R + rank_of(tok_off_R, R, i / K) : -1;
    const unsigned peers = warp_peers(key, warp_ids);
    if (key >= 0 && (peers & ((1u << lane) - 1u)) == 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(chunk_LR + key),
                static_cast<unsigned long long>(popcount(peers)));
  }
}

// One thread, in the reference's (l, r) order: rows_L gets the rows per local expert (rank r's
// blocks padded to cap_R[r] when it is > 0). A chunk over its rank's capacity stops the walk:
// rows_L[l] = -1 - r, its count left in chunk_LR[l R + r] (the host reports it). When N <=
// max_rows: *pads = the pad rows of rank me's blocks, and chunk_LR's first L R ints become the
// chunks' bases, base(l, r) = start(l, r) - (slots of l from ranks before r) - (slots of the local
// experts before l), each int j written after the int64 j / 2 <= j under it was read.
__global__ void group_chunk_offsets(int64_t* rows_L, int64_t* pads, int64_t* chunk_LR,
                                    const int64_t* cap_R, int32_t R, int32_t L, int32_t me,
                                    int64_t max_rows) {
  if (threadIdx.x != 0) return;
  int64_t N = 0, pad = 0;
  for (int32_t l = 0; l < L; ++l) {
    int64_t rows = 0;
    for (int32_t r = 0; r < R; ++r) {
      const int64_t c = chunk_LR[int64_t(l) * R + r], cap = cap_R[r];
      if (cap > 0 && c > cap) {
        rows_L[l] = -1 - r;
        return;
      }
      const int64_t block = cap > 0 ? cap : c;
      if (r == me) pad += block - c;
      N += block;
      rows += block;
    }
    rows_L[l] = rows;
  }
  if (N > max_rows) return;
  *pads = pad;
  int32_t* base = reinterpret_cast<int32_t*>(chunk_LR);
  int64_t start = 0, earlier = 0;
  for (int32_t l = 0; l < L; ++l) {
    int64_t q = 0;
    for (int32_t r = 0; r < R; ++r) {
      const int32_t j = l * R + r;
      const int64_t c = chunk_LR[j], cap = cap_R[r];
      base[j] = int32_t(start - q - earlier);
      q += c;
      start += cap > 0 ? cap : c;
    }
    earlier += q;
  }
}

// Tile w's column of M: M[l B + w] = its slots routed to local expert l. Dynamic shared memory:
// blockDim.x ints (warp_peers').
__global__ void group_tile_counts(int32_t* group_rows_GK, int64_t* chunk_LR, const int64_t* rows_L,
                                  const int32_t* idx_GK, const int64_t* tok_off_R, int32_t R,
                                  int32_t L, int32_t K, int32_t first, int64_t max_rows,
                                  int32_t S) {
  if (group_rows_placed(rows_L, L, max_rows) < 0) return;  // uniform over the grid
  const int32_t GK = group_slots(tok_off_R, R, K), B = group_tiles(GK, S);
  int32_t* M = group_counters(group_rows_GK, chunk_LR, B, L, R);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  const int32_t warps = int32_t(gridDim.x * blockDim.x / 32u);
  int32_t* warp_ids = dynamic_shared<int32_t>() + (threadIdx.x / 32u) * 32u;
  for (int32_t w = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32u); w < B; w += warps) {
    for (int32_t l = lane; l < L; l += 32) M[l * B + w] = 0;
    __syncwarp();  // the zeros are written before any lane adds to them
    const int32_t begin = w * S, n = S < GK - begin ? S : GK - begin;
    for (int32_t off = 0; off < n; off += 32) {
      const int32_t l = off + lane < n ? local_expert(idx_GK[begin + off + lane], first, L) : -1;
      const unsigned peers = warp_peers(l, warp_ids);
      if (l >= 0 && (peers & ((1u << lane) - 1u)) == 0) M[l * B + w] += popcount(peers);
      __syncwarp();  // this round's sums are in before the next round reads them
    }
  }
}

// One block: M (L B counters, expert-major) becomes its exclusive prefix. Dynamic shared memory:
// blockDim.x / 32 ints.
__global__ void group_tile_offsets(int32_t* group_rows_GK, int64_t* chunk_LR,
                                   const int64_t* rows_L, const int64_t* tok_off_R, int32_t R,
                                   int32_t L, int32_t K, int64_t max_rows, int32_t S) {
  if (group_rows_placed(rows_L, L, max_rows) < 0) return;  // uniform over the block
  const int32_t B = group_tiles(group_slots(tok_off_R, R, K), S), n = L * B;
  int32_t* M = group_counters(group_rows_GK, chunk_LR, B, L, R);
  int* scan = dynamic_shared<int>();
  int carry = 0;
  for (uint32_t base = 0; base < uint32_t(n); base += blockDim.x) {  // uniform trip count
    const uint32_t i = base + threadIdx.x;
    const int v = i < uint32_t(n) ? M[i] : 0;
    int total = 0;
    const int at = block_exclusive_scan(v, scan, &total);
    if (i < uint32_t(n)) M[i] = carry + at;
    carry += total;
    __syncthreads();  // scan's shared memory is read above before the next round writes it
  }
}

// Rows [0, N) start as pad rows (row_token = row_slot = -1); group_tile_place overwrites the
// chunks' kept rows.
__global__ void group_pad_rows(int32_t* row_token_N, int32_t* row_slot_N, const int64_t* rows_L,
                               int32_t L, int64_t max_rows) {
  const int32_t N = group_rows_placed(rows_L, L, max_rows);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t p = blockIdx.x * blockDim.x + threadIdx.x; int64_t(p) < N; p += stride)
    row_token_N[p] = row_slot_N[p] = -1;
}

// Tile w places its slots in slot order: row = the chunk's base + the expert's counter + the lower
// peers; the lowest peer alone advances the counter. Writes row_token and row_slot (M may live in
// group_rows' memory until group_slot_rows). Dynamic shared memory: blockDim.x ints.
__global__ void group_tile_place(int32_t* row_token_N, int32_t* row_slot_N, int32_t* group_rows_GK,
                                 int64_t* chunk_LR, const int64_t* rows_L, const int32_t* idx_GK,
                                 const int64_t* tok_off_R, int32_t R, int32_t L, int32_t K,
                                 int32_t first, int64_t max_rows, int32_t S) {
  if (group_rows_placed(rows_L, L, max_rows) < 0) return;  // uniform over the grid
  const int32_t GK = group_slots(tok_off_R, R, K), B = group_tiles(GK, S);
  int32_t* M = group_counters(group_rows_GK, chunk_LR, B, L, R);
  const int32_t* base_LR = reinterpret_cast<const int32_t*>(chunk_LR);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  const int32_t warps = int32_t(gridDim.x * blockDim.x / 32u);
  int32_t* warp_ids = dynamic_shared<int32_t>() + (threadIdx.x / 32u) * 32u;
  for (int32_t w = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32u); w < B; w += warps) {
    const int32_t begin = w * S, n = S < GK - begin ? S : GK - begin;
    for (int32_t off = 0; off < n; off += 32) {
      const int32_t i = begin + off + lane;
      const int32_t l = off + lane < n ? local_expert(idx_GK[i], first, L) : -1;
      const unsigned peers = warp_peers(l, warp_ids);
      const unsigned below = peers & ((1u << lane) - 1u);
      const int32_t counter = l >= 0 ? M[l * B + w] : 0;
      __syncwarp();  // every peer has read the counter before the lowest one advances it
      if (l >= 0) {
        const int32_t t = i / K;
        const int32_t row = base_LR[l * R + rank_of(tok_off_R, R, t)] + counter + popcount(below);
        row_token_N[row] = t;
        row_slot_N[row] = i - t * K;
        if (below == 0) M[l * B + w] = counter + popcount(peers);
      }
      __syncwarp();
    }
  }
}

// group_rows: -1 for every slot (dropped, another rank's expert), then each kept row's slot gets
// the row (one writer per slot).
__global__ void group_slot_rows_clear(int32_t* group_rows_GK, const int64_t* rows_L,
                                      const int64_t* tok_off_R, int32_t R, int32_t L, int32_t K,
                                      int64_t max_rows) {
  if (group_rows_placed(rows_L, L, max_rows) < 0) return;
  const int32_t GK = group_slots(tok_off_R, R, K);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < uint32_t(GK); i += stride)
    group_rows_GK[i] = -1;
}
__global__ void group_slot_rows(int32_t* group_rows_GK, const int32_t* row_token_N,
                                const int32_t* row_slot_N, const int64_t* rows_L, int32_t L,
                                int32_t K, int64_t max_rows) {
  const int32_t N = group_rows_placed(rows_L, L, max_rows);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t p = blockIdx.x * blockDim.x + threadIdx.x; int64_t(p) < N; p += stride) {
    const int32_t t = row_token_N[p];
    if (t >= 0) group_rows_GK[t * K + row_slot_N[p]] = int32_t(p);
  }
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

// The row gathers: one block per row (or chunk), 32-bit index math inside a row. Where every row
// starts 16-byte aligned (the buffers aligned and a row's bytes a multiple of 16) the _vec kernels
// move 16 bytes per load and store; the others move one element at a time.

// Block r copies row r (zeros for a pad row).
template <typename T>
__global__ void permute_rows(T* y_NH, const T* x_TH, const int32_t* row_token_N, int32_t H) {
  const int32_t t = row_token_N[blockIdx.x];
  T* y = y_NH + int64_t(blockIdx.x) * H;
  if (t < 0) {
    for (int32_t h = int32_t(threadIdx.x); h < H; h += int32_t(blockDim.x)) y[h] = T{};
    return;
  }
  const T* x = x_TH + int64_t(t) * H;
  for (int32_t h = int32_t(threadIdx.x); h < H; h += int32_t(blockDim.x)) y[h] = x[h];
}
// The same on rows of H4 16-byte vectors (the bits move unchanged).
__global__ void permute_rows_vec(int4* y_NH4, const int4* x_TH4, const int32_t* row_token_N,
                                 int32_t H4) {
  const int32_t t = row_token_N[blockIdx.x];
  int4* y = y_NH4 + int64_t(blockIdx.x) * H4;
  if (t < 0) {
    const int4 zero = {0, 0, 0, 0};
    for (int32_t h = int32_t(threadIdx.x); h < H4; h += int32_t(blockDim.x)) y[h] = zero;
    return;
  }
  const int4* x = x_TH4 + int64_t(t) * H4;
  for (int32_t h = int32_t(threadIdx.x); h < H4; h += int32_t(blockDim.x)) y[h] = x[h];
}

// Block t sums its kept rows in k order from 0 (the CPU's order: the same bits).
template <typename T>
__global__ void unpermute_rows(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int32_t K,
                               int32_t H) {
  const int32_t* rows = token_rows_TK + int64_t(blockIdx.x) * K;
  T* y = y_TH + int64_t(blockIdx.x) * H;
  for (int32_t h = int32_t(threadIdx.x); h < H; h += int32_t(blockDim.x)) {
    T s = T(0);
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) s += x_NH[int64_t(r) * H + h];
    }
    y[h] = s;
  }
}
// 16 bytes of T: float4 or double2, added lane by lane.
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  using type = float4;
  __device__ __forceinline__ static float4 zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ static void add(float4& s, const float4& v) {
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
};
template <>
struct Vec16<double> {
  using type = double2;
  __device__ __forceinline__ static double2 zero() { return make_double2(0.0, 0.0); }
  __device__ __forceinline__ static void add(double2& s, const double2& v) {
    s.x += v.x;
    s.y += v.y;
  }
};
// unpermute_rows on rows of H4 vectors: each element's sum is the scalar kernel's, in k order.
template <typename T>
__global__ void unpermute_rows_vec(typename Vec16<T>::type* y_TH4,
                                   const typename Vec16<T>::type* x_NH4,
                                   const int32_t* token_rows_TK, int32_t K, int32_t H4) {
  using V = typename Vec16<T>::type;
  const int32_t* rows = token_rows_TK + int64_t(blockIdx.x) * K;
  V* y = y_TH4 + int64_t(blockIdx.x) * H4;
  for (int32_t h = int32_t(threadIdx.x); h < H4; h += int32_t(blockDim.x)) {
    V s = Vec16<T>::zero();
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) Vec16<T>::add(s, x_NH4[int64_t(r) * H4 + h]);
    }
    y[h] = s;
  }
}

// bf16 rows into f32 tokens: the scalar kernel's loop on widened bf16, summed in f32 in k order.
__global__ void unpermute_rows_bf16(float* y_TH, const uint16_t* x_NH,
                                    const int32_t* token_rows_TK, int32_t K, int32_t H) {
  const int32_t* rows = token_rows_TK + int64_t(blockIdx.x) * K;
  float* y = y_TH + int64_t(blockIdx.x) * H;
  for (int32_t h = int32_t(threadIdx.x); h < H; h += int32_t(blockDim.x)) {
    float s = 0.f;
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) s += bf16_bits_to_f32(x_NH[int64_t(r) * H + h]);
    }
    y[h] = s;
  }
}
// The same on rows of H8 groups of 8: a 16-byte load of 8 bf16 per row, two float4 stores; each
// element's sum is the scalar kernel's, in k order.
__global__ void unpermute_rows_bf16_vec(float4* y_TH4, const int4* x_NH8,
                                        const int32_t* token_rows_TK, int32_t K, int32_t H8) {
  const int32_t* rows = token_rows_TK + int64_t(blockIdx.x) * K;
  float4* y = y_TH4 + int64_t(blockIdx.x) * 2 * H8;
  const auto lo = [](int w) { return bf16_bits_to_f32(uint16_t(uint32_t(w) & 0xffffu)); };
  const auto hi = [](int w) { return bf16_bits_to_f32(uint16_t(uint32_t(w) >> 16)); };
  for (int32_t h = int32_t(threadIdx.x); h < H8; h += int32_t(blockDim.x)) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
    for (int32_t k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r < 0) continue;
      const int4 v = x_NH8[int64_t(r) * H8 + h];
      a.x += lo(v.x);
      a.y += hi(v.x);
      a.z += lo(v.y);
      a.w += hi(v.y);
      b.x += lo(v.z);
      b.y += hi(v.z);
      b.z += lo(v.w);
      b.w += hi(v.w);
    }
    y[2 * h] = a;
    y[2 * h + 1] = b;
  }
}

// Block c copies chunk c (its offsets and row count are in device memory; a negative one moves
// nothing: the CPU path checks them), W elements of V a row. V is the element type, or int4 when
// every row starts 16-byte aligned: then W counts 16-byte vectors and the bits move unchanged
// (copy_row_chunks<int4>, SASS-gated for its 16-byte loads).
template <typename V>
__global__ void copy_row_chunks(V* dst_NW, const V* src_NW, const int64_t* dst_off,
                                const int64_t* src_off, const int64_t* rows, int64_t W) {
  const int64_t c = blockIdx.x;
  if (rows[c] <= 0 || dst_off[c] < 0 || src_off[c] < 0) return;
  V* dst = dst_NW + dst_off[c] * W;
  const V* src = src_NW + src_off[c] * W;
  const int64_t n = rows[c] * W;
  if (n <= 0x7fffffff) {  // the common case: 32-bit indices
    for (int32_t i = int32_t(threadIdx.x); i < int32_t(n); i += int32_t(blockDim.x))
      dst[i] = src[i];
    return;
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxGrid = 0x7fffffff;
// The permutation's smallest tile (slots per warp) and its one-block scans' width.
constexpr int64_t kTileSlots = 512;
constexpr int64_t kScanBlock = 1024;
// The group permutation's grid-stride launches: at most one wave of an H100 (132 SMs x 8 blocks).
constexpr int64_t kGroupGrid = 1056;

// Threads for a row of n elements: whole warps, at most kBlock.
unsigned row_block(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + 31) / 32 * 32, 32, kBlock));
}

// Blocks of kBlock threads for n elements (grid-stride beyond the grid limit).
unsigned flat_grid(int64_t n) {
  return unsigned(std::min(kMaxGrid, (n + kBlock - 1) / kBlock));
}

// Every row of W elements of both buffers starts 16-byte aligned: the _vec kernels apply.
template <typename T>
bool rows_vectorize(const void* a, const void* b, int64_t W) {
  return reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0 &&
         (W * int64_t(sizeof(T))) % 16 == 0;
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
  // Tiles of S >= 2 E slots (a multiple of the warp): then E B <= T K whenever there are two
  // tiles or more, and M lives in row_slot's memory until permutation_slots; a single tile with
  // T K < E keeps its E counters in counts_E's memory (E int64 hold 2 E int32).
  const int64_t S = std::max<int64_t>(kTileSlots, (2 * E + 31) / 32 * 32);
  const int64_t B = std::max<int64_t>(1, (TK + S - 1) / S);
  int32_t* M = row_slot_N;
  if (E * B > TK) {
    MOE_KERNEL_CHECK(B == 1, "[build_permutation] " + std::to_string(B) + " tiles of " +
                                 std::to_string(S) + " slots need " + std::to_string(E * B) +
                                 " counters > T*K=" + std::to_string(TK));
    M = reinterpret_cast<int32_t*>(counts_E);
  }
  const int32_t S32 = int32_t(std::min<int64_t>(S, 0x7fffffff));
  const unsigned warps_per_block = unsigned(kBlock / 32);
  const dim3 tiles(unsigned((B + warps_per_block - 1) / warps_per_block));
  launch("permutation_tile_counts", kernels::permutation_tile_counts, tiles, dim3(unsigned(kBlock)),
         size_t(kBlock) * sizeof(int32_t), stream, M, idx_TK, int32_t(TK), int32_t(E), int32_t(B),
         S32);
  launch("permutation_offsets", kernels::permutation_offsets, dim3(1), dim3(unsigned(kScanBlock)),
         size_t(kScanBlock / 32) * sizeof(int), stream, M, int32_t(E * B));
  launch("permutation_place", kernels::permutation_place, tiles, dim3(unsigned(kBlock)),
         size_t(kBlock) * sizeof(int32_t), stream, row_token_N, token_rows_TK, M, idx_TK,
         int32_t(TK), int32_t(K), int32_t(E), int32_t(B), S32);
  launch("permutation_counts", kernels::permutation_counts, dim3(1), dim3(unsigned(kScanBlock)), 0,
         stream, counts_E, n_kept, static_cast<const int32_t*>(M), int32_t(E), int32_t(B));
  if (TK == 0) return;
  launch("permutation_slots", kernels::permutation_slots, dim3(flat_grid(TK)),
         dim3(unsigned(kBlock)), 0, stream, row_token_N, row_slot_N,
         static_cast<const int32_t*>(token_rows_TK), static_cast<const int64_t*>(n_kept),
         int32_t(TK), int32_t(K));
}

void pad_permutation(void* stream, int64_t* pads, int64_t* counts_E, int32_t* row_token_N,
                     int32_t* row_slot_N, int32_t* token_rows_TK, const int64_t* n_kept,
                     int64_t n_tok, int64_t K, int64_t E, int64_t cap) {
  MOE_KERNEL_CHECK(n_tok >= 0 && K >= 1 && E >= 1 && cap >= 0 && n_tok <= 0x7fffffff / K &&
                       E * cap <= 0x7fffffff && E <= 0x7fffffff,
                   "[pad_permutation] T=" + std::to_string(n_tok) + " K=" + std::to_string(K) +
                       " E=" + std::to_string(E) + " capacity=" + std::to_string(cap) +
                       ": needs K >= 1, E >= 1, capacity >= 0, T*K and E * capacity rows within "
                       "int32");
  (void)n_kept;  // the experts' row ends come from counts_E; their sum is N
  const int64_t TK = n_tok * K, n = std::max(TK, E * cap);
  launch("pad_ends", kernels::pad_ends, dim3(1), dim3(unsigned(kScanBlock)),
         size_t(kScanBlock / 32) * sizeof(int), stream, counts_E, pads, int32_t(E), int32_t(cap));
  if (n > 0) {
    launch("pad_place", kernels::pad_place, dim3(flat_grid(n)), dim3(unsigned(kBlock)), 0, stream,
           row_token_N, row_slot_N, token_rows_TK, static_cast<const int64_t*>(counts_E),
           int32_t(TK), int32_t(K), int32_t(E), int32_t(cap));
  }
  launch("pad_counts", kernels::pad_counts, dim3(flat_grid(E)), dim3(unsigned(kBlock)), 0, stream,
         counts_E, int32_t(E), int32_t(cap));
}

int64_t build_group_permutation(void* stream, int64_t* rows_L, int32_t* row_token_N,
                                int32_t* row_slot_N, int32_t* group_rows_GK, int64_t* chunk_LR,
                                int64_t* pads, const GroupRouting& g) {
  MOE_KERNEL_CHECK(g.R >= 1 && g.R <= 65535 && g.me >= 0 && g.me < g.R && g.L >= 0 &&
                       g.L * g.R <= 0x3fffffff && g.first >= 0 && g.first + g.L <= 0x7fffffff &&
                       g.K >= 1 && g.G >= 0 && g.G <= 0x7fffffff / g.K && g.max_rows >= 0 &&
                       g.max_rows <= 0x7fffffff,
                   "[build_group_permutation] R=" + std::to_string(g.R) +
                       " me=" + std::to_string(g.me) + " L=" + std::to_string(g.L) +
                       " first=" + std::to_string(g.first) + " K=" + std::to_string(g.K) +
                       " G=" + std::to_string(g.G) + " max_rows=" + std::to_string(g.max_rows) +
                       ": needs 1 <= R <= 65535, 0 <= me < R, L R < 2^30 chunks, expert ids "
                       "first..first+L within int32, K >= 1, G K slots and 0 <= max_rows rows "
                       "within int32");
  const int32_t* idx = raw_ptr(g.idx_GK);
  const int64_t* tok_off = raw_ptr(g.tok_off_R);
  const int64_t* cap = raw_ptr(g.cap_R);
  const int32_t R = int32_t(g.R), L = int32_t(g.L), K = int32_t(g.K), first = int32_t(g.first);
  // Tiles of S >= 2 L slots (a multiple of the warp): L B <= G K whenever there are two tiles or
  // more, so M fits group_rows' memory (kernels above). The host's G sizes the grids only: the
  // kernels read the slots from tok_off_R.
  const int32_t S = int32_t(std::max<int64_t>(kTileSlots, (2 * g.L + 31) / 32 * 32));
  const int64_t GK = g.G * g.K, B = std::max<int64_t>(1, (GK + S - 1) / S);
  const auto blocks = [](int64_t threads) {  // grid-stride launches: at most one H100 wave
    return dim3(unsigned(std::clamp<int64_t>((threads + kBlock - 1) / kBlock, 1, kGroupGrid)));
  };
  const dim3 block = dim3(unsigned(kBlock));
  const size_t warp_ids = size_t(kBlock) * sizeof(int32_t);
  if (L > 0) {
    launch("group_zero", kernels::group_zero, blocks(g.L * g.R), block, 0, stream, chunk_LR,
           int32_t(g.L * g.R));
    launch("group_counts", kernels::group_counts, blocks(GK), block, warp_ids, stream, chunk_LR,
           idx, tok_off, R, L, K, first);
  }
  launch("group_chunk_offsets", kernels::group_chunk_offsets, dim3(1), dim3(32), 0, stream, rows_L,
         pads, chunk_LR, cap, R, L, int32_t(g.me), g.max_rows);
  launch("group_pad_rows", kernels::group_pad_rows, blocks(g.max_rows), block, 0, stream,
         row_token_N, row_slot_N, static_cast<const int64_t*>(rows_L), L, g.max_rows);
  if (L > 0) {
    launch("group_tile_counts", kernels::group_tile_counts, blocks(B * 32), block, warp_ids, stream,
           group_rows_GK, chunk_LR, static_cast<const int64_t*>(rows_L), idx, tok_off, R, L, K,
           first, g.max_rows, S);
    launch("group_tile_offsets", kernels::group_tile_offsets, dim3(1), dim3(unsigned(kScanBlock)),
           size_t(kScanBlock / 32) * sizeof(int), stream, group_rows_GK, chunk_LR,
           static_cast<const int64_t*>(rows_L), tok_off, R, L, K, g.max_rows, S);
    launch("group_tile_place", kernels::group_tile_place, blocks(B * 32), block, warp_ids, stream,
           row_token_N, row_slot_N, group_rows_GK, chunk_LR, static_cast<const int64_t*>(rows_L),
           idx, tok_off, R, L, K, first, g.max_rows, S);
  }
  launch("group_slot_rows_clear", kernels::group_slot_rows_clear, blocks(GK), block, 0, stream,
         group_rows_GK, static_cast<const int64_t*>(rows_L), tok_off, R, L, K, g.max_rows);
  launch("group_slot_rows", kernels::group_slot_rows, blocks(g.max_rows), block, 0, stream,
         group_rows_GK, static_cast<const int32_t*>(row_token_N),
         static_cast<const int32_t*>(row_slot_N), static_cast<const int64_t*>(rows_L), L, K,
         g.max_rows);
  if (g.known_rows > 0) return g.known_rows;  // padded: no read back, no host sync
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
  MOE_KERNEL_CHECK(N >= 0 && N <= kMaxGrid && H >= 0 && H <= 0x7fffffff,
                   "[permute_rows] rows=" + std::to_string(N) +
                       " (0 to 2^31-1, one block each), H=" + std::to_string(H) + " (0 to 2^31-1)");
  if (N == 0 || H == 0) return;
  if (rows_vectorize<T>(y_NH, x_TH, H)) {
    const int64_t H4 = H * int64_t(sizeof(T)) / 16;
    launch("permute_rows_vec", kernels::permute_rows_vec, dim3(unsigned(N)), dim3(row_block(H4)), 0,
           stream, reinterpret_cast<int4*>(y_NH), reinterpret_cast<const int4*>(x_TH), row_token_N,
           int32_t(H4));
    return;
  }
  launch("permute_rows", kernels::permute_rows<T>, dim3(unsigned(N)), dim3(row_block(H)), 0, stream,
         y_NH, x_TH, row_token_N, int32_t(H));
}

template <typename T>
void unpermute_rows(void* stream, T* y_TH, const T* x_NH, const int32_t* token_rows_TK,
                    int64_t n_tok, int64_t K, int64_t H) {
  MOE_KERNEL_CHECK(
      n_tok >= 0 && n_tok <= kMaxGrid && K >= 0 && K <= 0x7fffffff && H >= 0 && H <= 0x7fffffff,
      "[unpermute_rows] T=" + std::to_string(n_tok) + " (0 to 2^31-1, one block each), K=" +
          std::to_string(K) + " H=" + std::to_string(H) + " (0 to 2^31-1)");
  if (n_tok == 0 || H == 0) return;
  if (rows_vectorize<T>(y_TH, x_NH, H)) {
    using V = typename kernels::Vec16<T>::type;
    const int64_t H4 = H * int64_t(sizeof(T)) / 16;
    launch("unpermute_rows_vec", kernels::unpermute_rows_vec<T>, dim3(unsigned(n_tok)),
           dim3(row_block(H4)), 0, stream, reinterpret_cast<V*>(y_TH),
           reinterpret_cast<const V*>(x_NH), token_rows_TK, int32_t(K), int32_t(H4));
    return;
  }
  launch("unpermute_rows", kernels::unpermute_rows<T>, dim3(unsigned(n_tok)), dim3(row_block(H)), 0,
         stream, y_TH, x_NH, token_rows_TK, int32_t(K), int32_t(H));
}

void unpermute_rows(void* stream, float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK,
                    int64_t n_tok, int64_t K, int64_t H) {
  MOE_KERNEL_CHECK(
      n_tok >= 0 && n_tok <= kMaxGrid && K >= 0 && K <= 0x7fffffff && H >= 0 && H <= 0x7fffffff,
      "[unpermute_rows] bf16 rows: T=" + std::to_string(n_tok) +
          " (0 to 2^31-1, one block each), K=" + std::to_string(K) + " H=" + std::to_string(H) +
          " (0 to 2^31-1)");
  if (n_tok == 0 || H == 0) return;
  const auto* x = reinterpret_cast<const uint16_t*>(x_NH);
  // 8 bf16 (16 bytes) in, 8 f32 (two 16-byte vectors) out: H a multiple of 8, both aligned.
  if (rows_vectorize<bf16>(y_TH, x_NH, H)) {
    const int64_t H8 = H / 8;
    launch("unpermute_rows_bf16_vec", kernels::unpermute_rows_bf16_vec, dim3(unsigned(n_tok)),
           dim3(row_block(H8)), 0, stream, reinterpret_cast<float4*>(y_TH),
           reinterpret_cast<const int4*>(x), token_rows_TK, int32_t(K), int32_t(H8));
    return;
  }
  launch("unpermute_rows_bf16", kernels::unpermute_rows_bf16, dim3(unsigned(n_tok)),
         dim3(row_block(H)), 0, stream, y_TH, x, token_rows_TK, int32_t(K), int32_t(H));
}

template <typename T>
void copy_row_chunks(void* stream, T* dst_NW, const T* src_NW, const int64_t* dst_off,
                     const int64_t* src_off, const int64_t* rows, int64_t n_chunks, int64_t W) {
  MOE_KERNEL_CHECK(n_chunks >= 0 && n_chunks <= kMaxGrid && W >= 0,
                   "[copy_row_chunks] chunks=" + std::to_string(n_chunks) +
                       " (0 to 2^31-1, one block each), W=" + std::to_string(W) + " (>= 0)");
  if (n_chunks == 0 || W == 0) return;
  if (rows_vectorize<T>(dst_NW, src_NW, W)) {  // the same kernel on 16-byte vectors
    launch("copy_row_chunks<int4>", kernels::copy_row_chunks<int4>, dim3(unsigned(n_chunks)),
           dim3(unsigned(kBlock)), 0, stream, reinterpret_cast<int4*>(dst_NW),
           reinterpret_cast<const int4*>(src_NW), dst_off, src_off, rows,
           W * int64_t(sizeof(T)) / 16);
    return;
  }
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
// bf16 rows (--bf16: the tokens and output gradients the experts' GEMMs read in bf16) only move:
// the gathers and the chunk copies, 16-byte vectors where the rows allow (H a multiple of 8).
template void permute_rows<bf16>(void*, bf16*, const bf16*, const int32_t*, int64_t, int64_t);
template void copy_row_chunks<bf16>(void*, bf16*, const bf16*, const int64_t*, const int64_t*,
                                    const int64_t*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
