// Megatron-Core's load-balanced context-parallel split (_get_batch_on_this_cp_rank): a sequence
// of S positions is cut into 2 cp chunks of C = S / (2 cp) and CP rank r keeps chunks r and
// 2 cp - 1 - r, so every rank gets the same causal work (an early chunk and its mirror). Pure
// arithmetic, shared by the batch split, the attention across ranks, RoPE's global positions and
// the planner.
#pragma once

#include <algorithm>
#include <cstdint>

namespace moecore::parallel {

struct ContextSplit {
  int64_t S = 0;   // global sequence length
  int cp = 1;      // context-parallel size
  int rank = 0;    // this rank's position in the cp group

  int64_t chunk() const { return S / (2 * cp); }  // C, positions per chunk
  int64_t local_length() const { return S / cp; }  // 2 C positions on this rank
  // The global chunk index of this rank's local chunk h (0: the early one, 1: its mirror).
  int64_t chunk_index(int h) const { return h == 0 ? rank : 2 * cp - 1 - rank; }
  // Global position of local position s (0 <= s < 2 C).
  int64_t global_position(int64_t s) const {
    if (cp == 1) return s;
    const int64_t c = chunk();
    return chunk_index(static_cast<int>(s / c)) * c + s % c;
  }
  // The CP rank that holds global position p, and its local position there.
  int owner(int64_t p) const;
  int64_t local_position(int64_t p) const;
};

// The local rows [s_begin, s_begin + n) as runs of consecutive global positions, in order: one
// run, or two when the range crosses from the early chunk into its mirror. f(local_row0, rows,
// global_position0) per run: what position-keyed ops (dropout, learned positions) that take one
// offset per call are called with.
template <typename F>
void for_each_position_run(const ContextSplit& s, int64_t s_begin, int64_t n, F&& f) {
  if (s.cp == 1) {
    if (n > 0) f(s_begin, n, s_begin);
    return;
  }
  const int64_t c = s.chunk();
  for (int64_t r = s_begin; r < s_begin + n;) {
    const int64_t end = std::min(s_begin + n, (r / c + 1) * c);
    f(r, end - r, s.global_position(r));
    r = end;
  }
}

// Throws moecore::Error naming --seq-length and --context-parallel-size unless S > 0, cp >= 1,
// 0 <= rank < cp and S divides by 2 cp (cp == 1 accepts any S).
void check_context_split(const ContextSplit& s);

// The rows of this rank from a sequence-major tensor x [S, row] (row values per position):
// out [2 C, row], chunk r then chunk 2 cp - 1 - r. With cp == 1 a copy.
template <typename T>
void context_split_rows(const ContextSplit& s, const T* x, int64_t row, T* out);
// The inverse for all ranks at once: parts[q] [2 C, row] of CP rank q -> x [S, row].
template <typename T>
void context_unsplit_rows(int64_t S, int cp, const T* const* parts, int64_t row, T* x);

}  // namespace moecore::parallel
