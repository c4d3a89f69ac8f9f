// The problem tables of the device-table grouped GEMM (ops/cuda/grouped_gemm_device.h): from the
// group sizes m_G in the context's memory and the operands' base addresses, one
// GroupedGemmProblem per group, written where the GEMM reads them (device memory on CUDA, by a
// kernel on the stream: the host never reads m_G). The three grouped GEMMs of ops/gemm.h, rows
// stacked by group (group g owns rows [row0_g, row0_g + m_g), row0_g = sum_{h<g} m_h), w
// [G, N, K] (trans_w) or [G, K, N] (ops/desc/grouped_gemm_desc.h states the same problems for
// cuBLAS):
//   Forward  y_g[m_g, N] = x_g[m_g, K] op(w_g): problem g = {m_g, N, K, trans_b = trans_w,
//            lda = K, ldb = (trans_w ? K : N), ldd = N}, a = x + row0_g K, b = w + g N K,
//            d = y + row0_g N (the GEMM assigns: beta 0);
//   dgrad    dx_g[m_g, K] = dy_g[m_g, N] op'(w_g): the forward with N and K exchanged and
//            trans_w flipped (the same form, called so);
//   Wgrad    dw_g[N, K] += dy_g[m_g, N]^T x_g[m_g, K]: problem g = {N, K, m_g, trans_a,
//            lda = N, ldb = K, ldd = K}, a = dy + row0_g N, b = x + row0_g K, d = dw + g N K
//            (the GEMM accumulates: beta 1).
// Leading dimensions are at least 1 (as the descriptors'). Every group has its problem, empty
// ones too: a forward group of no rows has m = 0 (writes nothing), a wgrad one k = 0 (leaves dw_g
// as it was), so the table's length is G, known on the host, whatever the counts. A negative
// count is read as 0 (as the grouped bias reads it); the rows of all groups together must stay
// below 2^31 (the prefix sums are 32-bit, as every kernel over a step's routed rows assumes), N
// and K too (the problem's int32 sizes). Element offsets are 64-bit, scaled by the types' element
// sizes (GemmTypes: A and B in the input type, d in the output type).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/cuda/grouped_gemm_device.h"
#include "ops/desc/gemm_desc.h"

namespace moecore::ops {

enum class GroupedGemmForm : uint8_t {
  Forward,  // y = x op(w), and dgrad (N, K exchanged, trans_w flipped): a x, b w, d y
  Wgrad,    // dw += dy^T x: a dy, b x, d dw
};

// The plain loop: the table's entries as documented above (m_G and `problems` host memory; the
// operand addresses are only offset, never read).
void grouped_gemm_tables_ref(cuda::GroupedGemmProblem* problems, const int64_t* m_G, int64_t G,
                             GroupedGemmForm form, desc::GemmTypes types, int64_t N, int64_t K,
                             bool trans_w, const void* a, const void* b, void* d);

// The CUDA kernel (ops/cuda/grouped_gemm_tables.cu): one block of 256 threads, the groups 256 at
// a time; each chunk's prefix sums a warp scan (__shfl_up_sync) and the warps' totals in warp
// order, the rows of the earlier chunks carried. Integer sums: the same bits in any order.
namespace cuda {
void grouped_gemm_tables(void* stream, GroupedGemmProblem* problems, const int64_t* m_G, int64_t G,
                         GroupedGemmForm form, desc::GemmTypes types, int64_t N, int64_t K,
                         bool trans_w, const void* a, const void* b, void* d);
}  // namespace cuda

// problems [G] in the context's memory; m_G [G] there too. On the CPU the plain loop (the CPU's
// grouped GEMMs read m_G themselves and need no table; the op is there for its tests).
inline void grouped_gemm_tables(const Exec& ex, DevPtr<cuda::GroupedGemmProblem> problems,
                                DevPtr<const int64_t> m_G, int64_t G, GroupedGemmForm form,
                                desc::GemmTypes types, int64_t N, int64_t K, bool trans_w,
                                DevPtr<const void> a, DevPtr<const void> b, DevPtr<void> d) {
  if (ex.on_cpu())
    return grouped_gemm_tables_ref(raw_ptr(problems), raw_ptr(m_G), G, form, types, N, K, trans_w,
                                   raw_ptr(a), raw_ptr(b), raw_ptr(d));
  return cuda::grouped_gemm_tables(ex.stream, raw_ptr(problems), raw_ptr(m_G), G, form, types, N,
                                   K, trans_w, raw_ptr(a), raw_ptr(b), raw_ptr(d));
}

}  // namespace moecore::ops
