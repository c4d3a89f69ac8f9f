// The emulated build's device-table grouped GEMM (ops/cuda/grouped_gemm_device.h): in place of
// the CUTLASS backend of the CUDA build, an interpreter of the problem table read from emulated
// device memory, on the context's stream as the other emulated library calls run
// (tests/emu/blas_emu.cpp: the emulated device has one stream, and a call completes as it is
// made). Each problem runs through the plain-loop interpreter the cuBLAS stand-in uses
// (common/blas_interpreter.h, the row-major problem swapped to column-major as
// desc::column_major_gemm swaps it), so a table describing the host-table path's problems gives
// its results bitwise.
//
// What it takes: the project's type combinations (f32, f32 with TF32 products under
// --fp32-matmul-precision high, f64, bf16 in / f32 out), N and K multiples of 16 bytes' worth of
// elements (bf16 8, f32 and TF32 4, f64 2: TMA's 16-byte rule for the operands' row strides and
// row offsets, which the CUDA build's CUTLASS backend has; that backend runs bf16 alone,
// docs/gpu.md). With
// MOECORE_EMU_GROUPED_GEMM=unsupported (read at every query) it answers "unsupported" instead,
// as a build or a device without the backend does, so the callers' host-table path runs in the
// emulated build too.
//
// Strict, as a GPU is (an illegal address there is an error here): the table and the workspace
// each lie inside one device allocation (tests/emu/device_memory_emu.h, check_device_range) and
// do not overlap; every problem's fields are valid (sizes >= 0, trans 0 or 1, reserved 0, leading
// dimensions covering their rows); each non-empty operand range (A, B, D) lies inside one device
// allocation, starts 16-byte aligned with row strides of whole 16 bytes (TMA's rule); D overlaps
// neither its A and B nor another problem's D; and no range is a pending collective's (a missing
// wait). The table is read as the library reads it: copied into the workspace's argument arrays
// (as CUTLASS's pointer-array arguments), then run from there.
#include "ops/cuda/grouped_gemm_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/blas_interpreter.h"
#include "core/check.h"
#include "core/sync_audit.h"
#include "emu/device_memory_emu.h"
#include "emu/grouped_gemm_device_emu.h"
#include "emu/stream_capture_emu.h"
#include "ops/cuda/grouped_gemm_params_cache.h"

namespace moecore::ops::cuda {

namespace {

// The per-problem argument record the emulated library keeps in its workspace (as CUTLASS's
// pointer arrays, problem shapes and strides).
struct EmuArgs {
  const void* a;
  const void* b;
  void* d;
  int64_t lda, ldb, ldd;
  int32_t m, n, k;
  int32_t trans;  // bit 0 trans_a, bit 1 trans_b
};
static_assert(sizeof(EmuArgs) == 64);


bool forced_unsupported() {
  const char* env = std::getenv("MOECORE_EMU_GROUPED_GEMM");
  if (env == nullptr || *env == '\0') return false;
  const std::string_view v(env);
  MOE_CHECK(v == "unsupported" || v == "supported",
            "[emu] MOECORE_EMU_GROUPED_GEMM={}: expected 'unsupported' (the emulated device-table "
            "grouped GEMM answers unsupported, as a build without one) or 'supported'",
            v);
  return v == "unsupported";
}

// [lo, hi) bytes of a row-major matrix of `rows` rows of `cols` elements, row stride ld.
struct Range {
  uintptr_t lo = 0, hi = 0;
  bool empty() const { return hi == lo; }
};
Range matrix_range(const void* p, int64_t rows, int64_t cols, int64_t ld, int64_t elem) {
  if (rows == 0 || cols == 0) return {};
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  return {lo, lo + static_cast<uintptr_t>(((rows - 1) * ld + cols) * elem)};
}
bool overlap(Range x, Range y) {
  return !x.empty() && !y.empty() && x.lo < y.hi && y.lo < x.hi;
}

// The CUDA backend's cache of host-built kernel parameters (ops/cuda/grouped_gemm_params_cache.h),
// modelled with the same keys and slots (nothing in them: the interpreter needs no parameters),
// so that what a step of the emulated build would rebuild on a GPU is counted here
// (grouped_gemm_device_emu.h).
struct EmuParamsCache {
  std::mutex mu;
  GroupedGemmParamsCache<char> cache;
};
EmuParamsCache& params_cache() {
  static EmuParamsCache c;
  return c;
}

}  // namespace

bool device_grouped_gemm_supported(desc::GemmTypes types, int64_t N, int64_t K, std::string* why) {
  if (forced_unsupported()) {
    if (why != nullptr)
      *why =
          "the emulated device-table grouped GEMM is turned off (MOECORE_EMU_GROUPED_GEMM="
          "unsupported)";
    return false;
  }
  const int64_t multiple = 16 / desc::gemm_input_bytes(types);  // the output's is no larger
  if (N < 0 || K < 0 || N % multiple != 0 || K % multiple != 0) {
    if (why != nullptr)
      *why = fmt::format(
          "{} grouped GEMMs from device tables need N and K multiples of {} (16-byte rows and "
          "row offsets, TMA's rule); this one has N={} K={}",
          desc::gemm_types_name(types), multiple, N, K);
    return false;
  }
  return true;
}

size_t device_grouped_gemm_workspace_bytes(int64_t G) {
  return G > 0 ? static_cast<size_t>(G) * sizeof(EmuArgs) : 0;
}

void device_grouped_gemm_reserve_calls(int64_t calls) {
  EmuParamsCache& c = params_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.cache.reserve(static_cast<size_t>(std::max<int64_t>(calls, 0)));
}

void device_grouped_gemm(const Exec& ex, desc::GemmTypes types, const GroupedGemmProblem* problems,
                         int64_t G, float beta, void* workspace, size_t workspace_bytes) {
  // The library's own work is the device's, not the host's (--sync-audit), its host staging too.
  const SyncAudit::Paused device_work;
  // While a stream capture is open (stream_capture_emu.h) the call is recorded with its
  // arguments and runs, checks included, when the graph is replayed: the table it reads is
  // written by a kernel recorded before it.
  if (emu::capturing()) {
    const Exec ex_copy = ex;
    emu::record(
        "device grouped GEMM", [ex_copy, types, problems, G, beta, workspace, workspace_bytes] {
          device_grouped_gemm(ex_copy, types, problems, G, beta, workspace, workspace_bytes);
        });
    return;
  }
  MOE_CHECK(G >= 0 && (beta == 0.f || beta == 1.f),
            "[emu] device grouped GEMM: G={} problems, beta={}: G >= 0, beta 0 or 1", G, beta);
  MOE_CHECK(!forced_unsupported(),
            "[emu] device grouped GEMM called while MOECORE_EMU_GROUPED_GEMM=unsupported: the "
            "caller must ask device_grouped_gemm_supported first and keep its host-table path");
  // The CUDA backend's bf16 D: the forward's forms only (no trans_a), assigned (beta 0).
  MOE_CHECK(types != desc::GemmTypes::Bf16Bf16 || beta == 0.f,
            "[emu] device grouped GEMM: a bf16 output is assigned only (beta={})", beta);
  if (G == 0) return;
  {
    EmuParamsCache& c = params_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    const GroupedGemmParamsKey key{workspace, G, beta, 0, static_cast<uint8_t>(types)};
    if (c.cache.find(key) == nullptr) c.cache.keep(key, [](char&) {});
  }
  const size_t table_bytes = static_cast<size_t>(G) * sizeof(GroupedGemmProblem);
  const size_t need = device_grouped_gemm_workspace_bytes(G);
  emu::check_device_range("device grouped GEMM: the problem table", problems, table_bytes);
  MOE_CHECK(reinterpret_cast<uintptr_t>(problems) % alignof(GroupedGemmProblem) == 0,
            "[emu] device grouped GEMM: the problem table at {} is not {}-byte aligned",
            static_cast<const void*>(problems), alignof(GroupedGemmProblem));
  MOE_CHECK(workspace != nullptr && workspace_bytes >= need,
            "[emu] device grouped GEMM: workspace of {} bytes at {}, {} needed for {} problems "
            "(device_grouped_gemm_workspace_bytes)",
            workspace_bytes, workspace, need, G);
  emu::check_device_range("device grouped GEMM: the workspace", workspace, need);
  MOE_CHECK(reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
            "[emu] device grouped GEMM: the workspace at {} is not 16-byte aligned", workspace);
  const Range table{reinterpret_cast<uintptr_t>(problems),
                    reinterpret_cast<uintptr_t>(problems) + table_bytes};
  const Range ws{reinterpret_cast<uintptr_t>(workspace),
                 reinterpret_cast<uintptr_t>(workspace) + need};
  MOE_CHECK(!overlap(table, ws),
            "[emu] device grouped GEMM: the workspace [{:#x}, {:#x}) overlaps the problem table "
            "[{:#x}, {:#x}): the library writes its arguments there while it reads the table",
            ws.lo, ws.hi, table.lo, table.hi);
  emu::check_pending("device grouped GEMM (problem table)", problems, table_bytes, false);
  emu::check_pending("device grouped GEMM (workspace)", workspace, need, true);

  const emu::DeviceAccess access;
  // The library's argument arrays, written from the table on the device.
  auto* args = static_cast<EmuArgs*>(workspace);
  for (int64_t g = 0; g < G; ++g) {
    GroupedGemmProblem p;
    std::memcpy(&p, problems + g, sizeof p);
    MOE_CHECK(p.m >= 0 && p.n >= 0 && p.k >= 0 && (p.trans_a == 0 || p.trans_a == 1) &&
                  (p.trans_b == 0 || p.trans_b == 1) && p.reserved == 0,
              "[emu] device grouped GEMM: problem {} of {}: m={} n={} k={} trans_a={} trans_b={} "
              "reserved={}: sizes >= 0, trans 0 or 1, reserved 0",
              g, G, p.m, p.n, p.k, p.trans_a, p.trans_b, p.reserved);
    const int64_t a_cols = p.trans_a ? p.m : p.k, b_cols = p.trans_b ? p.k : p.n;
    MOE_CHECK(p.lda >= std::max<int64_t>(1, a_cols) && p.ldb >= std::max<int64_t>(1, b_cols) &&
                  p.ldd >= std::max<int64_t>(1, p.n),
              "[emu] device grouped GEMM: problem {}: lda={} ldb={} ldd={} do not cover the "
              "stored rows ({}, {}, {} elements)",
              g, p.lda, p.ldb, p.ldd, a_cols, b_cols, p.n);
    EmuArgs e;
    e.a = p.a;
    e.b = p.b;
    e.d = p.d;
    e.lda = p.lda;
    e.ldb = p.ldb;
    e.ldd = p.ldd;
    e.m = p.m;
    e.n = p.n;
    e.k = p.k;
    e.trans = p.trans_a | (p.trans_b << 1);
    std::memcpy(args + g, &e, sizeof e);
  }

  const int64_t ab = desc::gemm_input_bytes(types), db = desc::gemm_output_bytes(types);
  const desc::BlasDataType in_type = desc::gemm_input_type(types);
  const desc::BlasDataType out_type = desc::gemm_output_type(types);
  // F32Tf32: the TF32 model of the emulated cuBLASLt (common/blas_interpreter.h: each f32 input
  // rounded to TF32, exact products, f32 sums in k order), so a table of the host-table path's
  // problems gives its TF32 results bitwise, as for the other types.
  const desc::BlasComputeType compute = desc::gemm_compute_type(types);
  // Every operand range first (nothing is written before the whole call is known valid).
  std::vector<std::pair<Range, int64_t>> d_ranges;  // D of each problem that writes one
  for (int64_t g = 0; g < G; ++g) {
    EmuArgs e;
    std::memcpy(&e, args + g, sizeof e);
    const bool ta = e.trans & 1, tb = e.trans & 2;
    MOE_CHECK(!(ta && types == desc::GemmTypes::Bf16Bf16),
              "[emu] device grouped GEMM: problem {} reads A transposed with a bf16 output (the "
              "CUDA backend's bf16-output kernel has the forward's forms only)",
              g);
    // A problem with m = 0 or n = 0 writes nothing and reads nothing; k = 0 reads no A, B.
    const bool writes = e.m > 0 && e.n > 0;
    const Range a =
        writes && e.k > 0 ? matrix_range(e.a, ta ? e.k : e.m, ta ? e.m : e.k, e.lda, ab) : Range{};
    const Range b =
        writes && e.k > 0 ? matrix_range(e.b, tb ? e.n : e.k, tb ? e.k : e.n, e.ldb, ab) : Range{};
    const Range d = writes ? matrix_range(e.d, e.m, e.n, e.ldd, db) : Range{};
    const struct {
      const char* name;
      Range r;
      const void* p;
      int64_t ld, elem;
      bool writes;
    } ops[] = {{"A", a, e.a, e.lda, ab, false},
               {"B", b, e.b, e.ldb, ab, false},
               {"D", d, e.d, e.ldd, db, true}};
    for (const auto& o : ops) {
      if (o.r.empty()) continue;
      const std::string who = fmt::format("device grouped GEMM: problem {}'s {}", g, o.name);
      emu::check_device_range(who, o.p, o.r.hi - o.r.lo);
      MOE_CHECK(o.r.lo % 16 == 0 && (o.ld * o.elem) % 16 == 0,
                "[emu] {} at {} with row stride {} elements of {} bytes: operands start 16-byte "
                "aligned with row strides of whole 16 bytes (TMA's rule: the CUTLASS backend "
                "needs it)",
                who, o.p, o.ld, o.elem);
      emu::check_pending(who.c_str(), o.p, o.r.hi - o.r.lo, o.writes);
    }
    MOE_CHECK(!overlap(d, a) && !overlap(d, b) && !overlap(d, table) && !overlap(d, ws),
              "[emu] device grouped GEMM: problem {}'s D [{:#x}, {:#x}) overlaps its A, its B, "
              "the problem table or the workspace",
              g, d.lo, d.hi);
    if (!d.empty()) d_ranges.emplace_back(d, g);
  }
  std::sort(d_ranges.begin(), d_ranges.end(),
            [](const auto& x, const auto& y) { return x.first.lo < y.first.lo; });
  for (size_t i = 1; i < d_ranges.size(); ++i) {
    MOE_CHECK(!overlap(d_ranges[i - 1].first, d_ranges[i].first),
              "[emu] device grouped GEMM: the outputs of problems {} and {} overlap ([{:#x}, "
              "{:#x}) and [{:#x}, {:#x})): the library writes them at once",
              d_ranges[i - 1].second, d_ranges[i].second, d_ranges[i - 1].first.lo,
              d_ranges[i - 1].first.hi, d_ranges[i].first.lo, d_ranges[i].first.hi);
  }
  // Each problem as the cuBLAS stand-in runs one (row-major D = op(A) op(B) + beta D is the
  // column-major D^T = op(B)^T op(A)^T: B in the A slot), in problem order.
  for (int64_t g = 0; g < G; ++g) {
    EmuArgs e;
    std::memcpy(&e, args + g, sizeof e);
    if (e.m == 0 || e.n == 0) continue;
    const bool ta = e.trans & 1, tb = e.trans & 2;
    testing::blas_gemm_colmajor(tb ? desc::BlasOp::T : desc::BlasOp::N,
                                ta ? desc::BlasOp::T : desc::BlasOp::N, e.n, e.m, e.k, 1.0, in_type,
                                e.b, e.ldb, in_type, e.a, e.lda, double(beta), out_type, e.d, e.ldd,
                                compute);
  }
}

}  // namespace moecore::ops::cuda

namespace moecore::emu {

GroupedGemmParamsCounts grouped_gemm_params_counts() {
  ops::cuda::EmuParamsCache& c = ops::cuda::params_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return {c.cache.slots(), c.cache.misses()};
}

}  // namespace moecore::emu
