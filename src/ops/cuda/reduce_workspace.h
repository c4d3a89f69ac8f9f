// The scratch of the multi-block reductions (reduce_cols.cuh's partials, sum_squares.cu's): one
// fixed block of device memory per stream, made on the stream's first reduction and kept for the
// process, as the cuBLAS workspace is (blas.h). Fixed, so that the reductions' splits (and so
// their bits) follow from the shapes alone and graph capture never meets an allocation; per
// stream, because the ops of one stream run in order (a reduction's partials are consumed before
// the next op's are written) while two streams would race on one block. The op signatures take no
// workspace: their callers (norm layers, attention, the optimizer's gradient norm, the numeric
// guard) plan none for them.
#pragma once

#include <cstddef>

namespace moecore::ops::cuda {

// 8 MiB: the partials of a column reduction at the planned split count need at most
// splits x columns x outputs x sizeof(T); reduce_cols.cuh caps the splits so they fit (a DeepSeek-
// V3 LayerNorm's dw and db, 7168 f32 columns each, fit 146 splits; a dense norm uses about 19).
inline constexpr size_t kReduceWorkspaceBytes = size_t{8} << 20;

// The stream's block (16-byte aligned, kReduceWorkspaceBytes), created on first use. In the grid
// emulator's builds the first `used_bytes` are NaN-poisoned (all bits set) on every call, so a
// stage that reads a partial no stage wrote shows in the result.
void* reduce_workspace(void* stream, size_t used_bytes);

}  // namespace moecore::ops::cuda
