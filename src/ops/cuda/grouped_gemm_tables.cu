// The device-table grouped GEMM's problem tables on the GPU (ops/grouped_gemm_tables.h): the
// group sizes read on the device, so the host never waits for them. One block of kBlock threads
// walks the groups kBlock at a time: each thread reads its group's count (negative as 0), the
// warp's inclusive scan by __shfl_up_sync gives the rows before it in its warp, the warps'
// totals (in shared memory, summed in warp order) those of the warps before, and the rows of the
// earlier chunks are carried in a register every thread holds alike. 32-bit row sums (a step's
// routed rows stay below 2^31); element offsets in 64 bits. Integer sums: the same bits
// whatever the order the threads run in.
#include <climits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/grouped_gemm_tables.h"

namespace moecore::ops::cuda {

namespace {
constexpr int kBlock = 256;  // a multiple of the warp
constexpr int kWarps = kBlock / 32;
}  // namespace

namespace kernels {

template <typename C>
__device__ __forceinline__ C* offset_or_null(C* base, int64_t bytes) {
  return base == nullptr ? nullptr : base + bytes;
}

// form: 0 forward (and dgrad), 1 wgrad; ab / db: element bytes of A and B / of D.
__global__ void grouped_gemm_tables(GroupedGemmProblem* problems, const int64_t* m_G, int G,
                                    int form, int N, int K, int trans_w, const void* a,
                                    const void* b, void* d, int ab, int db) {
  __shared__ int warp_rows[kWarps];
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  char* pd = static_cast<char*>(d);
  int carry = 0;  // the rows of the groups of the earlier chunks
  for (int base = 0; base < G; base += kBlock) {
    const int g = base + int(threadIdx.x);
    int rows = 0;
    if (g < G) {
      const int64_t m = m_G[g];
      rows = m > 0 ? int(m) : 0;
    }
    int incl = rows;  // the warp's inclusive scan
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, unsigned(o));
      if (lane >= o) incl += y;
    }
    if (lane == 31) warp_rows[warp] = incl;
    __syncthreads();
    int before = 0, chunk = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_rows[w];
      chunk += warp_rows[w];
    }
    __syncthreads();  // every thread has read warp_rows before the next chunk writes it
    if (g < G) {
      const int64_t row0 = int64_t(carry) + before + incl - rows;
      GroupedGemmProblem p;
      if (form == 0) {
        p.m = rows;
        p.n = N;
        p.k = K;
        p.trans_a = 0;
        p.trans_b = trans_w;
        p.lda = K > 1 ? K : 1;
        p.ldb = (trans_w ? K : N) > 1 ? (trans_w ? K : N) : 1;
        p.ldd = N > 1 ? N : 1;
        p.a = offset_or_null(pa, row0 * K * ab);
        p.b = offset_or_null(pb, int64_t(g) * N * K * ab);
        p.d = offset_or_null(pd, row0 * N * db);
      } else {
        p.m = N;
        p.n = K;
        p.k = rows;
        p.trans_a = 1;
        p.trans_b = 0;
        p.lda = N > 1 ? N : 1;
        p.ldb = K > 1 ? K : 1;
        p.ldd = K > 1 ? K : 1;
        p.a = offset_or_null(pa, row0 * N * ab);
        p.b = offset_or_null(pb, row0 * K * ab);
        p.d = offset_or_null(pd, int64_t(g) * N * K * db);
      }
      problems[g] = p;
    }
    carry += chunk;
  }
}

}  // namespace kernels

void grouped_gemm_tables(void* stream, GroupedGemmProblem* problems, const int64_t* m_G, int64_t G,
                         GroupedGemmForm form, desc::GemmTypes types, int64_t N, int64_t K,
                         bool trans_w, const void* a, const void* b, void* d) {
  MOE_KERNEL_CHECK(G >= 0 && G <= INT_MAX && N >= 0 && N <= INT_MAX && K >= 0 && K <= INT_MAX &&
                       (G == 0 || (m_G != nullptr && problems != nullptr)),
                   "[grouped_gemm_tables] G=" + std::to_string(G) + " N=" + std::to_string(N) +
                       " K=" + std::to_string(K) + ", m_G " + (m_G ? "set" : "null") +
                       ", problems " + (problems ? "set" : "null") +
                       ": sizes in [0, 2^31), m_G and problems set when G > 0");
  if (G == 0) return;
  launch("grouped_gemm_tables", kernels::grouped_gemm_tables, dim3(1), dim3(unsigned(kBlock)), 0,
         stream, problems, m_G, int(G), form == GroupedGemmForm::Wgrad ? 1 : 0, int(N), int(K),
         trans_w ? 1 : 0, a, b, d, int(desc::gemm_input_bytes(types)),
         int(desc::gemm_output_bytes(types)));
}

}  // namespace moecore::ops::cuda
