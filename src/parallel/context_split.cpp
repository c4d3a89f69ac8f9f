// The load-balanced context-parallel split (context_split.h).
#include "parallel/context_split.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::parallel {

int ContextSplit::owner(int64_t p) const {
  if (cp == 1) return 0;
  const int64_t k = p / chunk();  // global chunk index
  return static_cast<int>(k < cp ? k : 2 * cp - 1 - k);
}

int64_t ContextSplit::local_position(int64_t p) const {
  if (cp == 1) return p;
  const int64_t c = chunk(), k = p / c;
  return (k < cp ? 0 : c) + p % c;
}

void check_context_split(const ContextSplit& s) {
  MOE_CHECK(s.cp >= 1 && s.rank >= 0 && s.rank < s.cp,
            "[context parallel] rank {} outside a group of --context-parallel-size {}", s.rank,
            s.cp);
  MOE_CHECK(s.S > 0, "[context parallel] --seq-length {} must be positive", s.S);
  MOE_CHECK(s.cp == 1 || s.S % (2 * s.cp) == 0,
            "[context parallel] --seq-length {} must divide by 2 x --context-parallel-size = {} "
            "(each rank keeps two chunks of the sequence, an early one and its mirror, so that "
            "causal attention costs every rank the same): use --seq-length {} or a "
            "--context-parallel-size whose double divides {}",
            s.S, 2 * s.cp, (s.S + 2 * s.cp - 1) / (2 * s.cp) * (2 * s.cp), s.S);
}

template <typename T>
void context_split_rows(const ContextSplit& s, const T* x, int64_t row, T* out) {
  if (s.cp == 1) {
    std::copy(x, x + s.S * row, out);
    return;
  }
  const int64_t c = s.chunk();
  for (int h = 0; h < 2; ++h) {
    const T* from = x + s.chunk_index(h) * c * row;
    std::copy(from, from + c * row, out + h * c * row);
  }
}

template <typename T>
void context_unsplit_rows(int64_t S, int cp, const T* const* parts, int64_t row, T* x) {
  for (int q = 0; q < cp; ++q) {
    const ContextSplit s{S, cp, q};
    const int64_t c = cp == 1 ? S : s.chunk();
    for (int h = 0; h < (cp == 1 ? 1 : 2); ++h) {
      const T* from = parts[q] + h * c * row;
      std::copy(from, from + c * row, x + (cp == 1 ? 0 : s.chunk_index(h)) * c * row);
    }
  }
}

#define MOECORE_CONTEXT_SPLIT(T)                                                           \
  template void context_split_rows<T>(const ContextSplit&, const T*, int64_t, T*);         \
  template void context_unsplit_rows<T>(int64_t, int, const T* const*, int64_t, T*);
MOECORE_CONTEXT_SPLIT(float)
MOECORE_CONTEXT_SPLIT(double)
MOECORE_CONTEXT_SPLIT(int32_t)
MOECORE_CONTEXT_SPLIT(int64_t)
MOECORE_CONTEXT_SPLIT(uint8_t)
#undef MOECORE_CONTEXT_SPLIT

}  // namespace moecore::parallel
