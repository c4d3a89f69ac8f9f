// The numerics class (see numerics_class.h): the build's part from the compiler's predefined
// macros (this file is compiled with the flags of every op), the rest asked at run time.
#include "ops/numerics_class.h"

#include <fmt/format.h>
#include <gnu/libc-version.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include "ops/gemm_bf16.h"

namespace moecore::ops {

namespace {

std::string compiler() {
#if defined(__clang__)
  return fmt::format("clang{}.{}", __clang_major__, __clang_minor__);
#elif defined(__GNUC__)
  return fmt::format("gcc{}.{}", __GNUC__, __GNUC_MINOR__);
#else
  return "unknown-compiler";
#endif
}

// The x86-64 micro-architecture level the build targets, plus the AVX-512 float extensions
// beyond it that the compiler may use.
std::string target_isa() {
  std::string s;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
  s = "x86-64-v4";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__BMI2__) && defined(__F16C__)
  s = "x86-64-v3";
#elif defined(__SSE4_2__) && defined(__POPCNT__)
  s = "x86-64-v2";
#elif defined(__x86_64__)
  s = "x86-64";
#else
  s = "not-x86-64";
#endif
#if defined(__AVX512F__) && !defined(__AVX512BW__)
  s += "+avx512f";  // AVX-512 below v4 (Knights Landing): the intrinsics paths still switch
#endif
#if defined(__AVX512BF16__)
  s += "+bf16";
#endif
#if defined(__AVX512FP16__)
  s += "+fp16";
#endif
  return s;
}

// The -mtune CPU, from the macros GCC and Clang define for it (x86-64-v2/v3/v4 tune generic,
// which defines none).
const char* tune() {
#if defined(__tune_znver5__)
  return "znver5";
#elif defined(__tune_znver4__)
  return "znver4";
#elif defined(__tune_znver3__)
  return "znver3";
#elif defined(__tune_znver2__)
  return "znver2";
#elif defined(__tune_znver1__)
  return "znver1";
#elif defined(__tune_diamondrapids__)
  return "diamondrapids";
#elif defined(__tune_graniterapids_d__)
  return "graniterapids-d";
#elif defined(__tune_graniterapids__)
  return "graniterapids";
#elif defined(__tune_emeraldrapids__)
  return "emeraldrapids";
#elif defined(__tune_sapphirerapids__)
  return "sapphirerapids";
#elif defined(__tune_pantherlake__)
  return "pantherlake";
#elif defined(__tune_lunarlake__)
  return "lunarlake";
#elif defined(__tune_arrowlake_s__)
  return "arrowlake-s";
#elif defined(__tune_arrowlake__)
  return "arrowlake";
#elif defined(__tune_meteorlake__)
  return "meteorlake";
#elif defined(__tune_alderlake__)
  return "alderlake";
#elif defined(__tune_rocketlake__)
  return "rocketlake";
#elif defined(__tune_tigerlake__)
  return "tigerlake";
#elif defined(__tune_cooperlake__)
  return "cooperlake";
#elif defined(__tune_cascadelake__)
  return "cascadelake";
#elif defined(__tune_icelake_server__)
  return "icelake-server";
#elif defined(__tune_icelake_client__)
  return "icelake-client";
#elif defined(__tune_cannonlake__)
  return "cannonlake";
#elif defined(__tune_skylake_avx512__)
  return "skylake-avx512";
#elif defined(__tune_skylake__)
  return "skylake";
#elif defined(__tune_core_avx2__)
  return "haswell";
#elif defined(__tune_sierraforest__) || defined(__tune_grandridge__) || \
    defined(__tune_clearwaterforest__) || defined(__tune_tremont__) ||  \
    defined(__tune_goldmont_plus__) || defined(__tune_goldmont__)
  return "atom";
#elif defined(__tune_knm__) || defined(__tune_knl__)
  return "knl";
#elif defined(__tune_bdver4__) || defined(__tune_bdver3__) || defined(__tune_btver2__)
  return "amd-pre-zen";
#elif defined(__tune_corei7_avx__) || defined(__tune_corei7__) || defined(__tune_core2__)
  return "intel-pre-haswell";
#else
  return "generic";
#endif
}

const char* dnnl_isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_all:
      return "all";
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx512_mic:
      return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    default:
      return nullptr;
  }
}

// oneDNN as it runs: the library's own version (not the header's), the effective ISA, and the
// settings that change its kernels when they are not the defaults.
std::string onednn() {
  const dnnl_version_t* v = dnnl_version();
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  const char* name = dnnl_isa_name(isa);
  std::string s = fmt::format(
      "onednn{}.{}.{}:{}", v->major, v->minor, v->patch,
      name != nullptr ? std::string(name) : fmt::format("isa0x{:x}", static_cast<unsigned>(isa)));
  if (dnnl_get_cpu_isa_hints() != dnnl_cpu_isa_no_hints) s += "+prefer_ymm";
  dnnl_fpmath_mode_t mode = dnnl_fpmath_mode_strict;
  if (dnnl_get_default_fpmath_mode(&mode) == dnnl_success && mode != dnnl_fpmath_mode_strict) {
    s += fmt::format("+fpmath{}", static_cast<int>(mode));
  }
  return s;
}

}  // namespace

std::string numerics_class() {
  return fmt::format("{}/{}/tune={}/glibc{}/{}/bf16gemm:{}/omp{}", compiler(), target_isa(), tune(),
                     gnu_get_libc_version(), onednn(), bf16_gemm_path_name(bf16_gemm_path()),
                     omp_get_max_threads());
}

}  // namespace moecore::ops
