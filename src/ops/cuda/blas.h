// The CUDA backend's GEMM library calls: one cuBLASLt matmul per LtMatmulDesc
// (ops/desc/gemm_desc.h: gemm, gemm_bf16, the strided-batched GEMM of padded dispatch) and one
// cublasGemmGroupedBatchedEx per GroupedBatchedDesc (ops/desc/grouped_gemm_desc.h: dropless
// dispatch). Declarations only, no CUDA headers: the CUDA build defines them with the libraries
// (blas_cublaslt.cpp), the emulated build with the plain-loop interpreters on host memory
// (tests/emu/blas_emu.cpp). Both take the library arguments from the same plumbing
// (ops/desc/blas_args.h).
#pragma once

#include <cstddef>

#include "core/exec.h"
#include "ops/desc/gemm_desc.h"
#include "ops/desc/grouped_gemm_desc.h"

namespace moecore::ops::cuda {

// The fixed cuBLASLt / cuBLAS workspace of a stream: 32 MiB, cuBLAS's recommendation for Hopper.
// Fixed because the algorithm choice depends on it (a different size may pick another algorithm,
// hence other bits) and because graph capture forbids allocating it on demand.
inline constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

// The library state of one stream (one Exec): a cuBLASLt handle, a cuBLAS handle bound to the
// stream (for the grouped call), the fixed workspace in device memory, each matmul descriptor's
// chosen algorithm, and the grouped call's device pointer tables. Created on the stream's first
// GEMM (blas_handles), before step 0 in practice, and kept for the process: the handles are not
// destroyed at exit, where the CUDA context may already be gone. Not thread-safe: one host
// thread drives a stream.
struct BlasHandles;
BlasHandles& blas_handles(const Exec& ex);

// cublasLtMatmul of one descriptor on ex's stream: C = alpha * op(A) op(B) + beta * C in the
// project's row-major terms, A / B / C the project's operands (device addresses; the descriptor
// says which goes in which library slot). The algorithm is chosen once per descriptor and operand
// alignment by cublasLtMatmulAlgoGetHeuristic at kBlasWorkspaceBytes (deterministic: same
// descriptor, same algorithm, same bits) and cached in `blas`; that first call must come before
// graph capture (an unseen descriptor during capture is an error). d.empty makes no call.
// Failures name the shapes and the library status.
void run_matmul(const Exec& ex, const desc::LtMatmulDesc& d, const void* A, const void* B, void* C,
                BlasHandles& blas);

// cublasGemmGroupedBatchedEx of one descriptor on ex's stream, A / B / C the bases of the
// project's operands (x, w, y; or dy, x, dw). Its sizes are host arrays: the descriptor was built
// from m_G read on the host, which is the MoE layer's one documented host sync; uploading the
// pointer tables from pageable host memory may also wait for the stream (cudaMemcpyAsync's
// documented behaviour), inside that same sync point. Not capturable. group_count 0 makes no
// call. Failures name the groups' shapes and the library status.
void run_grouped_batched(const Exec& ex, const desc::GroupedBatchedDesc& d, const void* A,
                         const void* B, void* C, BlasHandles& blas);

}  // namespace moecore::ops::cuda
