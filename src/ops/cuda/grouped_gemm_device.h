// A grouped GEMM that runs from tables in device memory: the problem sizes and pointers of every
// group are written on the device (from the MoE layer's token counts, by a kernel on the
// stream), so the host never reads the sizes and the call can be captured in a CUDA graph.
// The backends: CUTLASS's pointer-array grouped GEMM for sm_90a in the CUDA build; the
// emulator's interpreter of the tables in the emulated build; none on the CPU (a build without
// one says so through device_grouped_gemm_supported, and the caller keeps its host-table path).
// Row-major, as the project's GEMMs (ops/gemm.h): per problem,
//   D[m, n] = op(A)[m, k] op(B)[k, n] + beta D
// op(A) = A stored [m, k] (row stride lda), or with trans_a A stored [k, m] read transposed;
// op(B) = B stored [k, n] (ldb), or with trans_b B stored [n, k] read transposed; D [m, n] with
// row stride ldd. A problem with m = 0 or n = 0 writes nothing; k = 0 leaves beta D (D = 0 for
// beta 0). Element types are the call's GemmTypes (A and B the inputs, D the output),
// accumulation in f32 (f64 for F64).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/exec.h"
#include "ops/desc/gemm_desc.h"

namespace moecore::ops::cuda {

struct GroupedGemmProblem {
  int32_t m = 0, n = 0, k = 0;
  int32_t trans_a = 0, trans_b = 0;  // 0 or 1
  int32_t reserved = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
};
static_assert(sizeof(GroupedGemmProblem) == 72, "the table's layout is shared with device code");

// Whether this build's current device runs grouped GEMMs from device tables for `types`, the
// grouped GEMMs of a layer whose fixed dims are N and K (ops/gemm.h: w [G, N, K] or [G, K, N];
// every problem's row strides and row offsets are multiples of them, so they decide the
// operands' alignment); if not, *why says what is missing (the build, the architecture, the
// types, the alignment).
bool device_grouped_gemm_supported(desc::GemmTypes types, int64_t N, int64_t K, std::string* why);
// The device workspace a call over G problems needs (the library's argument arrays), in bytes.
size_t device_grouped_gemm_workspace_bytes(int64_t G);
// Keeps the host-built parameters of at least `calls` distinct calls (workspace, G, beta) for the
// process (the CUTLASS backend's kernel parameters, TMA descriptors among them, built on a call's
// first use): the plan's count of the distinct calls a step makes, so that after its first step
// no call rebuilds them. Never shrinks. Allocates host memory: call it while planning, before a
// step. Nothing to keep in the other backends.
void device_grouped_gemm_reserve_calls(int64_t calls);
// Runs the G problems of `problems` (G entries in device memory, written on ex's stream before
// this call) on ex's stream. beta: 0 (D assigned) or 1 (D added to). workspace: device memory of
// at least device_grouped_gemm_workspace_bytes(G), 64-byte aligned (the arena's blocks are); calls
// on one stream may share it, calls on concurrent streams may not. No host synchronisation and no
// allocation.
// Preconditions the CUDA backend relies on (it reads the table on the device only, so it cannot
// report them on the host: a table that breaks them stops the stream with a trap):
// - one form per call: every problem has the same trans_a and trans_b, not both set (the MoE
//   layer's forward and dgrad have trans_a 0, its wgrad trans_a 1 and trans_b 0); the backend
//   picks its kernel from them;
// - for every problem that computes (m, n, k > 0): a, b, d 16-byte aligned, lda and ldb
//   multiples of 8 elements, ldd of 4, each covering its stored row (what N and K multiples of 8
//   give the MoE layer's tables: device_grouped_gemm_supported).
void device_grouped_gemm(const Exec& ex, desc::GemmTypes types, const GroupedGemmProblem* problems,
                         int64_t G, float beta, void* workspace, size_t workspace_bytes);

}  // namespace moecore::ops::cuda
