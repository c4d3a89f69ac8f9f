// Rotary position embedding, Megatron's non-interleaved form: with x = [x1 | x2] (halves of the
// head dim D), y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1], angle for pair i
// at position p = p * base^(-2i/D).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// cos/sin tables [max_pos, D/2] in f64, in the backend's memory (the model's arena, or
// RopeTables'): computed once on the host before step 0 and copied there (ops::copy), so the CPU
// path and the CUDA kernel read the same values and agree bitwise. A view: it owns nothing.
struct RopeCache {
  int64_t max_pos = 0, D = 0;
  double base = 0;
  DevPtr<const double> cos_PD = nullptr, sin_PD = nullptr;
};
// Elements of each table (max_pos * D / 2); checks the arguments.
int64_t rope_table_elems(int64_t max_pos, int64_t D, double base);
// Fills cos_PD and sin_PD (rope_table_elems each, memory of ex) and returns the view of them;
// waits for the copies (the host staging is freed on return). Not inside a step.
RopeCache make_rope_cache(const Exec& ex, DevPtr<double> cos_PD, DevPtr<double> sin_PD,
                          int64_t max_pos, int64_t D, double base);
// A cos and a sin table of n elements each in an allocation of their own (exec_alloc on ex),
// freed with it: what RopeTables and RopeMlaTables (ops/rope_mla.h) fill.
class RopeTableBlock {
 public:
  RopeTableBlock(const RopeTableBlock&) = delete;
  RopeTableBlock& operator=(const RopeTableBlock&) = delete;

 protected:
  RopeTableBlock(int64_t n, const Exec& ex);
  ~RopeTableBlock();
  DevPtr<double> cos_table() const { return DevPtr<double>(static_cast<double*>(block_)); }
  DevPtr<double> sin_table() const { return cos_table() + n_; }

 private:
  Exec ex_;
  int64_t n_;
  void* block_ = nullptr;
};

// Tables in an allocation of their own, for whoever has no arena to put them in (tests,
// benchmarks); converts to the RopeCache the ops take. Setup, not an op: ex (whose memory holds
// the tables) comes last.
class RopeTables : RopeTableBlock {
 public:
  RopeTables(int64_t max_pos, int64_t D, double base, const Exec& ex = cpu_exec());
  const RopeCache& cache() const { return cache_; }
  operator const RopeCache&() const { return cache_; }  // NOLINT: a view of the tables

 private:
  RopeCache cache_;
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void rope_forward(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                  const RopeCache& cache);
template <typename T>
void rope_backward(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                   const RopeCache& cache);
}  // namespace cpu
// The CUDA kernels (ops/cuda/rope.cu): they read the cache's tables (device memory), bitwise the
// CPU fast path; a position outside [0, cache.max_pos) gives NaN (the CPU path throws). `stream`
// is the context's.
namespace cuda {
template <typename T>
void rope_forward(void* stream, T* y, const T* x, const int32_t* pos_T, int64_t n_tok,
                  int64_t n_heads, const RopeCache& cache);
template <typename T>
void rope_backward(void* stream, T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok,
                   int64_t n_heads, const RopeCache& cache);
}  // namespace cuda

// x, y [n_tok, n_heads, D]; token t is at position pos_T[t]. y may alias x.
template <typename T>
void rope_forward(const Exec& ex, DevPtr<T> y, DevPtr<const T> x, DevPtr<const int32_t> pos_T,
                  int64_t n_tok, int64_t n_heads, const RopeCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_forward(raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads, cache);
  return cuda::rope_forward(ex.stream, raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads,
                            cache);
}
template <typename T>
void rope_forward_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                      int64_t D, double base);
// The inverse rotation (the transpose): dx may alias dy.
template <typename T>
void rope_backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const int32_t> pos_T,
                   int64_t n_tok, int64_t n_heads, const RopeCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_backward(raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok, n_heads, cache);
  return cuda::rope_backward(ex.stream, raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok, n_heads,
                             cache);
}
template <typename T>
void rope_backward_ref(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                       int64_t D, double base);

}  // namespace moecore::ops
