// Token permutation for dispatch: rows ordered expert-major, token index ascending within an
// expert (stable). Both directions are gathers over precomputed maps, so they are
// deterministic without atomics; permute's backward is unpermute and vice versa.
// The row moves (permute_rows, copy_row_chunks) also take bf16 rows (--bf16: the tokens and the
// output gradient the experts' GEMMs read in bf16 anyway are cast once before the permutation,
// which then moves half the bytes; a copy of the bits, so bitwise the cast of the f32 rows).
// unpermute_rows also sums bf16 rows into f32 tokens (--bf16: the experts' outputs and input
// gradients come back as bf16 rows, rounded once where the GEMMs wrote them, and each token sums
// its rows widened, in f32, in k order: bitwise the f32 form on the widened rows).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"

namespace moecore::ops {

// The shape of build_group_permutation's input: G = tok_off[R] gathered tokens of R ranks, rank
// r's at [tok_off[r], tok_off[r + 1]); the local experts [first, first + L) of EP rank `me`.
struct GroupRouting {
  DevPtr<const int32_t> idx_GK = nullptr;     // [G, K] expert per (token, slot); < 0: dropped
  DevPtr<const int64_t> tok_off_R = nullptr;  // [R + 1]
  DevPtr<const int64_t> cap_R = nullptr;      // [R] rank r pads each expert's block to cap_R[r]
  int64_t R = 1, me = 0, L = 0, first = 0, K = 1;
  int64_t max_rows = 0;  // the planned worst case of N
  // tok_off_R[R] as the host knows it: sizes the CUDA path's grid-stride launches only (its
  // kernels read the slots from tok_off_R; a smaller G is slower, never wrong). The CPU ignores it.
  int64_t G = 0;
  // > 0: N as the host already knows it (padded: every rank pads each local expert to its
  // capacity, N = L x the sum of cap_R): the CUDA path returns it without reading rows_L back,
  // so a padded plan has no host sync (the router has dropped to capacity, so no chunk can
  // overflow; the CPU path still checks). 0: N is read back (dropless).
  int64_t known_rows = 0;
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
int64_t build_permutation(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                          int32_t* token_rows_TK, const int32_t* idx_TK, int64_t n_tok, int64_t K,
                          int64_t E);
int64_t pad_permutation(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                        int32_t* token_rows_TK, int64_t n_real, int64_t n_tok, int64_t K, int64_t E,
                        int64_t cap);
int64_t build_group_permutation(int64_t* rows_L, int32_t* row_token_N, int32_t* row_slot_N,
                                int32_t* group_rows_GK, int64_t* chunk_LR, int64_t* pads,
                                const GroupRouting& g);
template <typename T>
void gather_row_probs(T* p_N, const T* probs_TK, const int32_t* row_token_N,
                      const int32_t* row_slot_N, int64_t N, int64_t K);
template <typename T>
void scatter_row_probs(T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK, int64_t TK);
template <typename T>
void permute_rows(T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N, int64_t H);
template <typename T>
void copy_row_chunks(T* dst_NW, const T* src_NW, const int64_t* dst_off, const int64_t* src_off,
                     const int64_t* rows, int64_t n_chunks, int64_t W);
template <typename T>
void unpermute_rows(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int64_t n_tok, int64_t K,
                    int64_t H);
void unpermute_rows(float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                    int64_t K, int64_t H);
}  // namespace cpu

// The CUDA kernels (ops/cuda/permute.cu); `stream` is the context's. The maps and counts are
// bitwise the CPU's (per-tile histograms, one scan, a stable placement; no float atomics, and
// integer ones only for build_group_permutation's chunk counts), the gathers
// copies, unpermute's sum in k order: bitwise the CPU fast path. The device cannot throw: an
// expert id outside [0, E) is dropped (token_rows -1), pad_permutation keeps the first cap rows
// of an expert and drops the rest (token_rows -1), copy_row_chunks skips a chunk with a negative
// offset or count (the CPU path checks all three). build_group_permutation writes its maps, rows_L
// and *pads on the device, then reads rows_L back for N: a host sync, the all-gather dispatcher's
// documented one (inside its token-count exchange point, SyncAudit::kEpTokenCounts); a chunk over
// its capacity throws the CPU path's error after that read.
namespace cuda {
void build_permutation(void* stream, int64_t* n_kept, int64_t* counts_E, int32_t* row_token_N,
                       int32_t* row_slot_N, int32_t* token_rows_TK, const int32_t* idx_TK,
                       int64_t n_tok, int64_t K, int64_t E);
void pad_permutation(void* stream, int64_t* pads, int64_t* counts_E, int32_t* row_token_N,
                     int32_t* row_slot_N, int32_t* token_rows_TK, const int64_t* n_kept,
                     int64_t n_tok, int64_t K, int64_t E, int64_t cap);
int64_t build_group_permutation(void* stream, int64_t* rows_L, int32_t* row_token_N,
                                int32_t* row_slot_N, int32_t* group_rows_GK, int64_t* chunk_LR,
                                int64_t* pads, const GroupRouting& g);
template <typename T>
void gather_row_probs(void* stream, T* p_N, const T* probs_TK, const int32_t* row_token_N,
                      const int32_t* row_slot_N, int64_t N, int64_t K);
template <typename T>
void scatter_row_probs(void* stream, T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK,
                       int64_t TK);
template <typename T>
void permute_rows(void* stream, T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N,
                  int64_t H);
template <typename T>
void unpermute_rows(void* stream, T* y_TH, const T* x_NH, const int32_t* token_rows_TK,
                    int64_t n_tok, int64_t K, int64_t H);
void unpermute_rows(void* stream, float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK,
                    int64_t n_tok, int64_t K, int64_t H);
template <typename T>
void copy_row_chunks(void* stream, T* dst_NW, const T* src_NW, const int64_t* dst_off,
                     const int64_t* src_off, const int64_t* rows, int64_t n_chunks, int64_t W);
}  // namespace cuda

// From idx [T, K] (expert per (token, slot); negative = dropped) build:
//   counts_E [E]         rows per expert;
//   row_token_N [T*K]    source token of permuted row r, for the N kept (t, k) pairs; the rows
//                        [N, T*K) are pad rows (-1), so T*K rows (the planned launch size, known
//                        on the host) can always be dispatched: the dropped slots' rows are zero;
//   row_slot_N [T*K]     the slot k of that row (to fetch its prob), -1 for a pad row;
//   token_rows_TK [T,K]  the permuted row of (t, k), or -1 if dropped.
// The fast path and the reference return N; the op writes it into *n_kept (memory: nothing of
// the plan returns to the host).
inline void build_permutation(const Exec& ex, DevPtr<int64_t> n_kept, DevPtr<int64_t> counts_E,
                              DevPtr<int32_t> row_token_N, DevPtr<int32_t> row_slot_N,
                              DevPtr<int32_t> token_rows_TK, DevPtr<const int32_t> idx_TK,
                              int64_t n_tok, int64_t K, int64_t E) {
  if (ex.on_cpu()) {
    *raw_ptr(n_kept) =
        cpu::build_permutation(raw_ptr(counts_E), raw_ptr(row_token_N), raw_ptr(row_slot_N),
                               raw_ptr(token_rows_TK), raw_ptr(idx_TK), n_tok, K, E);
    return;
  }
  return cuda::build_permutation(ex.stream, raw_ptr(n_kept), raw_ptr(counts_E),
                                 raw_ptr(row_token_N), raw_ptr(row_slot_N),
                                 raw_ptr(token_rows_TK), raw_ptr(idx_TK), n_tok, K, E);
}
int64_t build_permutation_ref(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                              int32_t* token_rows_TK, const int32_t* idx_TK, int64_t n_tok,
                              int64_t K, int64_t E);

// Padding to capacity (--moe-pad-expert-input-to-capacity): moves each expert's block of a
// packed map (build_permutation's, *n_kept rows, read from memory) to rows
// [e * cap, e * cap + count_e) and fills the rest of the block with pad rows (row_token =
// row_slot = -1); token_rows follows, counts become cap. Throws when an expert has more than
// cap rows. Writes the number of pad rows into *pads (the fast path and reference return it).
inline void pad_permutation(const Exec& ex, DevPtr<int64_t> pads, DevPtr<int64_t> counts_E,
                            DevPtr<int32_t> row_token_N, DevPtr<int32_t> row_slot_N,
                            DevPtr<int32_t> token_rows_TK, DevPtr<const int64_t> n_kept,
                            int64_t n_tok, int64_t K, int64_t E, int64_t cap) {
  if (ex.on_cpu()) {
    *raw_ptr(pads) =
        cpu::pad_permutation(raw_ptr(counts_E), raw_ptr(row_token_N), raw_ptr(row_slot_N),
                             raw_ptr(token_rows_TK), *raw_ptr(n_kept), n_tok, K, E, cap);
    return;
  }
  return cuda::pad_permutation(ex.stream, raw_ptr(pads), raw_ptr(counts_E), raw_ptr(row_token_N),
                               raw_ptr(row_slot_N), raw_ptr(token_rows_TK), raw_ptr(n_kept),
                               n_tok, K, E, cap);
}
int64_t pad_permutation_ref(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                            int32_t* token_rows_TK, int64_t n_real, int64_t n_tok, int64_t K,
                            int64_t E, int64_t cap);

// The all-gather dispatcher's permutation: the gathered routing map restricted to the local
// experts, rows ordered (local expert, source rank, token, slot), so the experts see exactly
// the rows the all-to-all dispatcher gives them. Rank r's block of each local expert is padded
// to cap_R[r] rows when cap_R[r] > 0 (pad rows: row_token = row_slot = -1; more rows than the
// cap throws). Writes rows_L [L] (rows per local expert, pads included), row_token_N (the token
// within the gathered G) and row_slot_N [N], group_rows_GK [G, K] (the row of each slot, -1
// when dropped or not local) and *pads (pad rows in rank me's blocks); chunk_LR [L, R] is
// workspace. Returns N. N > g.max_rows writes only rows_L (and the workspace) and returns N: the
// caller, which knows what bounds its rows, fails with that. On a device N comes back to the host
// (ops::read_back: a host sync, the all-gather dispatcher's documented one, kEpTokenCounts).
inline int64_t build_group_permutation(const Exec& ex, DevPtr<int64_t> rows_L,
                                       DevPtr<int32_t> row_token_N, DevPtr<int32_t> row_slot_N,
                                       DevPtr<int32_t> group_rows_GK, DevPtr<int64_t> chunk_LR,
                                       DevPtr<int64_t> pads, const GroupRouting& g) {
  if (ex.on_cpu())
    return cpu::build_group_permutation(raw_ptr(rows_L), raw_ptr(row_token_N), raw_ptr(row_slot_N),
                                        raw_ptr(group_rows_GK), raw_ptr(chunk_LR), raw_ptr(pads),
                                        g);
  return cuda::build_group_permutation(ex.stream, raw_ptr(rows_L), raw_ptr(row_token_N),
                                       raw_ptr(row_slot_N), raw_ptr(group_rows_GK),
                                       raw_ptr(chunk_LR), raw_ptr(pads), g);
}
int64_t build_group_permutation_ref(int64_t* rows_L, int32_t* row_token_N, int32_t* row_slot_N,
                                    int32_t* group_rows_GK, int64_t* pads, const GroupRouting& g);

// Each row's routing prob: p[r] = probs[row_token[r], row_slot[r]] (0 for a pad row).
template <typename T>
void gather_row_probs(const Exec& ex, DevPtr<T> p_N, DevPtr<const T> probs_TK,
                      DevPtr<const int32_t> row_token_N, DevPtr<const int32_t> row_slot_N,
                      int64_t N, int64_t K) {
  if (ex.on_cpu())
    return cpu::gather_row_probs(raw_ptr(p_N), raw_ptr(probs_TK), raw_ptr(row_token_N),
                                 raw_ptr(row_slot_N), N, K);
  return cuda::gather_row_probs(ex.stream, raw_ptr(p_N), raw_ptr(probs_TK), raw_ptr(row_token_N),
                                raw_ptr(row_slot_N), N, K);
}
template <typename T>
void gather_row_probs_ref(T* p_N, const T* probs_TK, const int32_t* row_token_N,
                          const int32_t* row_slot_N, int64_t N, int64_t K);
// Its backward: dprobs[t, k] = dp[token_rows[t, k]] (0 for a dropped slot), assigned.
template <typename T>
void scatter_row_probs(const Exec& ex, DevPtr<T> dprobs_TK, DevPtr<const T> dp_N,
                       DevPtr<const int32_t> token_rows_TK, int64_t TK) {
  if (ex.on_cpu())
    return cpu::scatter_row_probs(raw_ptr(dprobs_TK), raw_ptr(dp_N), raw_ptr(token_rows_TK), TK);
  return cuda::scatter_row_probs(ex.stream, raw_ptr(dprobs_TK), raw_ptr(dp_N),
                                 raw_ptr(token_rows_TK), TK);
}
template <typename T>
void scatter_row_probs_ref(T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK, int64_t TK);

// y[r] = x[row_token[r]]  (y [N, H], x [T, H]); a pad row (row_token[r] < 0) becomes zeros.
// T: float, double or bf16.
template <typename T>
void permute_rows(const Exec& ex, DevPtr<T> y_NH, DevPtr<const T> x_TH,
                  DevPtr<const int32_t> row_token_N, int64_t N, int64_t H) {
  if (ex.on_cpu())
    return cpu::permute_rows(raw_ptr(y_NH), raw_ptr(x_TH), raw_ptr(row_token_N), N, H);
  return cuda::permute_rows(ex.stream, raw_ptr(y_NH), raw_ptr(x_TH), raw_ptr(row_token_N), N, H);
}
template <typename T>
void permute_rows_ref(T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N, int64_t H);
// y[t] = sum_k x[token_rows[t, k]] over kept slots, in k order  (y [T, H] assigned).
template <typename T>
void unpermute_rows(const Exec& ex, DevPtr<T> y_TH, DevPtr<const T> x_NH,
                    DevPtr<const int32_t> token_rows_TK, int64_t n_tok, int64_t K, int64_t H) {
  if (ex.on_cpu())
    return cpu::unpermute_rows(raw_ptr(y_TH), raw_ptr(x_NH), raw_ptr(token_rows_TK), n_tok, K, H);
  return cuda::unpermute_rows(ex.stream, raw_ptr(y_TH), raw_ptr(x_NH), raw_ptr(token_rows_TK),
                              n_tok, K, H);
}
template <typename T>
void unpermute_rows_ref(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                        int64_t K, int64_t H);
// bf16 rows into f32 tokens: y[t] = sum_k f32(x[token_rows[t, k]]) over kept slots, summed in f32
// from 0 in k order (the fast paths' order, so the reference is bitwise, not within a tolerance).
inline void unpermute_rows(const Exec& ex, DevPtr<float> y_TH, DevPtr<const bf16> x_NH,
                           DevPtr<const int32_t> token_rows_TK, int64_t n_tok, int64_t K,
                           int64_t H) {
  if (ex.on_cpu())
    return cpu::unpermute_rows(raw_ptr(y_TH), raw_ptr(x_NH), raw_ptr(token_rows_TK), n_tok, K, H);
  return cuda::unpermute_rows(ex.stream, raw_ptr(y_TH), raw_ptr(x_NH), raw_ptr(token_rows_TK),
                              n_tok, K, H);
}
void unpermute_rows_ref(float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                        int64_t K, int64_t H);

// Chunk c of rows[c] rows of W elements moves from row src_off[c] of src to row dst_off[c] of
// dst (the all-to-all dispatcher's reorder between (source rank, expert) and (expert, source
// rank) order). Chunks must not overlap in dst; src and dst are distinct buffers. T: float,
// double or bf16.
template <typename T>
void copy_row_chunks(const Exec& ex, DevPtr<T> dst_NW, DevPtr<const T> src_NW,
                     DevPtr<const int64_t> dst_off, DevPtr<const int64_t> src_off,
                     DevPtr<const int64_t> rows, int64_t n_chunks, int64_t W) {
  if (ex.on_cpu())
    return cpu::copy_row_chunks(raw_ptr(dst_NW), raw_ptr(src_NW), raw_ptr(dst_off),
                                raw_ptr(src_off), raw_ptr(rows), n_chunks, W);
  return cuda::copy_row_chunks(ex.stream, raw_ptr(dst_NW), raw_ptr(src_NW), raw_ptr(dst_off),
                               raw_ptr(src_off), raw_ptr(rows), n_chunks, W);
}
template <typename T>
void copy_row_chunks_ref(T* dst_NW, const T* src_NW, const int64_t* dst_off, const int64_t* src_off,
                         const int64_t* rows, int64_t n_chunks, int64_t W);

}  // namespace moecore::ops
