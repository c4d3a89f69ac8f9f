// The emulated build's GEMM library calls (ops/cuda/blas.h): the same signatures as the cuBLASLt
// backend (src/ops/cuda/blas_cublaslt.cpp), the same argument plumbing (ops/desc/blas_args.h:
// slot operands, scalars in the scale type, grouped pointer tables and scalar arrays), and the
// plain-loop interpreters of the libraries' documented semantics (common/blas_interpreter.h) in
// place of the libraries, on host memory. Defined in the test binary, these come before
// moecore_lib's at link time (tests/CMakeLists.txt).
#include "ops/cuda/blas.h"

#include "common/blas_interpreter.h"
#include "core/sync_audit.h"
#include "emu/device_memory_emu.h"
#include "emu/stream_capture_emu.h"
#include "ops/desc/blas_args.h"

namespace moecore::ops::cuda {

// No library state to hold: the interpreters need no handle, workspace or algorithm.
struct BlasHandles {};

BlasHandles& blas_handles(const Exec&) {
  static BlasHandles none;
  return none;
}

namespace {

void matmul_now(const desc::LtMatmulDesc& d, const void* A, const void* B, void* C) {
  // The operands against the collectives in flight, at their addresses as a kernel's are.
  emu::check_pending("cuBLASLt matmul (A)", A, 1, false);
  emu::check_pending("cuBLASLt matmul (B)", B, 1, false);
  emu::check_pending("cuBLASLt matmul (C)", C, 1, true);
  const emu::DeviceAccess access;
  const SyncAudit::Paused device_work;  // the library's work: not the host's (--sync-audit)
  const desc::MatmulOperands slots = desc::matmul_operands(d, A, B);
  // The library reads alpha and beta through host pointers in the scale type.
  desc::LtMatmulDesc lib = d;
  lib.alpha = desc::blas_scalar_value(d.scale_type, desc::blas_scalar(d.scale_type, d.alpha).ptr());
  lib.beta = desc::blas_scalar_value(d.scale_type, desc::blas_scalar(d.scale_type, d.beta).ptr());
  testing::lt_matmul(lib, slots.a_slot, slots.b_slot, C);
}

void grouped_batched_now(const desc::GroupedBatchedDesc& d, const void* A, const void* B, void* C) {
  emu::check_pending("cuBLAS grouped GEMM (A)", A, 1, false);
  emu::check_pending("cuBLAS grouped GEMM (B)", B, 1, false);
  emu::check_pending("cuBLAS grouped GEMM (C)", C, 1, true);
  const emu::DeviceAccess access;
  const SyncAudit::Paused device_work;  // the library's work: not the host's (--sync-audit)
  const desc::GroupedArgs args = desc::grouped_args(d, A, B, C);
  testing::gemm_grouped_batched_tables(d, args.alpha.data(), args.a.data(), args.b.data(),
                                       args.beta.data(), args.c.data());
}

}  // namespace

// While a stream capture is open (stream_capture_emu.h) a call is recorded with its descriptor
// and operand addresses, and runs when the graph is replayed.
void run_matmul(const Exec&, const desc::LtMatmulDesc& d, const void* A, const void* B, void* C,
                BlasHandles&) {
  if (d.empty) return;
  if (emu::capturing()) {
    const SyncAudit::Paused device_work;
    emu::record("cuBLASLt matmul", [d, A, B, C] { matmul_now(d, A, B, C); });
    return;
  }
  matmul_now(d, A, B, C);
}

void run_grouped_batched(const Exec&, const desc::GroupedBatchedDesc& d, const void* A,
                         const void* B, void* C, BlasHandles&) {
  if (d.group_count == 0) return;
  if (emu::capturing()) {
    const SyncAudit::Paused device_work;
    emu::record("cuBLAS grouped GEMM", [d, A, B, C] { grouped_batched_now(d, A, B, C); });
    return;
  }
  grouped_batched_now(d, A, B, C);
}

}  // namespace moecore::ops::cuda
