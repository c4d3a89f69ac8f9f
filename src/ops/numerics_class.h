// The numerics class of this process on the CPU backend: one string naming everything that
// decides which floating-point results the CPU ops produce, so that bitwise expectations (the
// golden weights digests, tests/train/golden_digests.sh; docs/numerics.md "Golden digests") are
// kept per class. Two processes of one class compute bitwise-identical training runs; the
// classes of two CPU kinds or builds differ where their results may.
#pragma once

#include <string>

namespace moecore::ops {

// "<compiler>/<target ISA>/tune=<cpu>/glibc<v>/onednn<v>:<effective ISA>/bf16gemm:<path>/omp<n>",
// e.g. "gcc12.2/x86-64-v3/tune=generic/glibc2.36/onednn2.6.3:avx2/bf16gemm:widen/omp1". Its
// parts, each a thing our results depend on:
//   compiler and version: code generation (vectorised loops, `omp simd` reductions);
//   target ISA: the x86-64 level of the build (-march) plus AVX512-BF16 / -FP16 where enabled;
//     our intrinsics branch on __AVX512F__ (attention, fast_exp) and __SSE__ (AdamW);
//   tune: the -mtune CPU (from the compiler's __tune_*__ macros; none: generic), which sets the
//     vector width the vectoriser prefers, hence the association of `omp simd` reductions;
//   glibc: exp / log / sin / cos of the f64 router and RoPE math (not correctly rounded);
//   oneDNN's version and effective ISA (dnnl_get_effective_cpu_isa: the CPU's, capped by
//     DNNL_MAX_CPU_ISA), with its ISA hints and default fpmath mode where they are not the
//     defaults: which sgemm / matmul kernels run;
//   the bf16 GEMM path (native or widen, ops/gemm_bf16.h);
//   the OpenMP thread count: oneDNN's AVX2 sgemm splits work, and rounds, by thread count.
// Computed on each call (the thread count and the bf16 path may change).
std::string numerics_class();

}  // namespace moecore::ops
