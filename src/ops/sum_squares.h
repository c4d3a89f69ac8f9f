// Sum of squares of a tensor in f64 (the gradient norm): *out = sum_i x_i^2, written to `out` (a
// planned scalar, so a device backend can keep it on the device). Bitwise the same for any
// thread count: fixed blocks whose bounds depend on n only, fixed lanes within a block, summed
// in order.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// A list of element ranges [begin, begin + count) of one buffer (the distributed optimizer's
// owned shards of the flat gradient buffer).
struct ElemRange {
  int64_t begin = 0;
  int64_t count = 0;
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void sum_squares(double* out, const T* x, int64_t n);
template <typename T>
void sum_squares_ranges(double* out, const T* x, const ElemRange* ranges, int64_t n_ranges);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. A fixed tree in f64 per buffer or range: blocks (their count set by n) into
// partials in the stream's reduction workspace (ops/cuda/reduce_workspace.h), then one block (no
// atomics): bitwise the same run to run, within 1e-13 relative of the references (not the CPU
// fast path's bits). The ranges stay a host list, as above.
namespace cuda {
template <typename T>
void sum_squares(void* stream, double* out, const T* x, int64_t n);
template <typename T>
void sum_squares_ranges(void* stream, double* out, const T* x, const ElemRange* ranges,
                        int64_t n_ranges);
}  // namespace cuda

template <typename T>
void sum_squares(const Exec& ex, DevPtr<double> out, DevPtr<const T> x, int64_t n) {
  if (ex.on_cpu()) return cpu::sum_squares(raw_ptr(out), raw_ptr(x), n);
  return cuda::sum_squares(ex.stream, raw_ptr(out), raw_ptr(x), n);
}
// *out = the sum of squares of the elements of x in `ranges` (n_ranges of them; a planned list
// the host keeps, the same every step): each range summed as sum_squares sums a buffer, then
// the range sums added in list order (0 + r0 + r1 + ...), so one range gives sum_squares'
// bits and the result depends on the ranges only, not on the thread count.
template <typename T>
void sum_squares_ranges(const Exec& ex, DevPtr<double> out, DevPtr<const T> x,
                        const ElemRange* ranges, int64_t n_ranges) {
  if (ex.on_cpu()) return cpu::sum_squares_ranges(raw_ptr(out), raw_ptr(x), ranges, n_ranges);
  return cuda::sum_squares_ranges(ex.stream, raw_ptr(out), raw_ptr(x), ranges, n_ranges);
}

// Plain loops with a long double accumulator: the oracles.
template <typename T>
void sum_squares_ref(double* out, const T* x, int64_t n);
template <typename T>
void sum_squares_ranges_ref(double* out, const T* x, const ElemRange* ranges, int64_t n_ranges);

}  // namespace moecore::ops
