// The GEMM library calls of the CUDA backend (blas.h): cuBLASLt matmuls from LtMatmulDesc,
// cublasGemmGroupedBatchedEx from GroupedBatchedDesc, on the Exec's stream. The descriptor
// functions did the row-major -> column-major algebra and the checks (tested on the CPU through
// the interpreters); this file only turns their fields into library objects, so an error here is
// a library refusal, reported with the shapes.
#include "ops/cuda/blas.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/check.h"
#include "ops/desc/blas_args.h"

namespace moecore::ops::cuda {

using desc::BlasDataType;
using desc::GroupedBatchedDesc;
using desc::LtMatmulDesc;
using desc::LtMatrixLayout;

namespace {

std::string layout_str(const char* name, const LtMatrixLayout& l) {
  return fmt::format("{} {} {}x{} ld {} batch {} stride {}", name, blas_data_type_name(l.type),
                     l.rows, l.cols, l.ld, l.batch_count, l.batch_stride);
}

// The shapes of a matmul, for errors.
std::string shapes(const LtMatmulDesc& d) {
  return fmt::format("m={} n={} k={} op_a={} op_b={} compute={}; {}; {}; {}", d.m, d.n, d.k,
                     blas_op_name(d.trans_a), blas_op_name(d.trans_b),
                     blas_compute_type_name(d.compute), layout_str("A", d.a), layout_str("B", d.b),
                     layout_str("C", d.c));
}

#define MOE_CHECK_LT(expr, what)                                                            \
  do {                                                                                      \
    const cublasStatus_t moe_status_ = (expr);                                              \
    MOE_CHECK(moe_status_ == CUBLAS_STATUS_SUCCESS, "[gemm] {} failed: {} ({}): {}", #expr, \
              cublasLtGetStatusString(moe_status_), static_cast<int>(moe_status_), what);   \
  } while (0)

#define MOE_CHECK_CUDART(expr, what)                                      \
  do {                                                                    \
    const cudaError_t moe_err_ = (expr);                                  \
    MOE_CHECK(moe_err_ == cudaSuccess, "[gemm] {} failed: {}: {}", #expr, \
              cudaGetErrorString(moe_err_), what);                        \
  } while (0)

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing an address: the
// heuristic may pick an algorithm needing more alignment than the operand has otherwise.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// A matmul descriptor's cuBLASLt objects and chosen algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // D uses c
  cublasLtMatmulAlgo_t algo{};
};

// What the algorithm choice depends on: every descriptor field but alpha and beta (the heuristic
// does not see their values), and the operands' alignments.
using PlanKey = std::array<int64_t, 27>;

PlanKey plan_key(const LtMatmulDesc& d, const std::array<uint32_t, 3>& align) {
  auto l = [](const LtMatrixLayout& x, int64_t* k) {
    k[0] = static_cast<int64_t>(x.type);
    k[1] = x.rows;
    k[2] = x.cols;
    k[3] = x.ld;
    k[4] = x.batch_count;
    k[5] = x.batch_stride;
  };
  PlanKey k{};
  k[0] = static_cast<int64_t>(d.compute);
  k[1] = static_cast<int64_t>(d.scale_type);
  k[2] = static_cast<int64_t>(d.trans_a);
  k[3] = static_cast<int64_t>(d.trans_b);
  k[4] = d.m;
  k[5] = d.n;
  k[6] = d.k;
  l(d.a, &k[7]);
  l(d.b, &k[13]);
  l(d.c, &k[19]);
  k[25] = align[0] | (int64_t{align[1]} << 16);
  k[26] = align[2];
  return k;
}

cublasLtMatrixLayout_t make_layout(const LtMatrixLayout& l, const std::string& what) {
  cublasLtMatrixLayout_t h = nullptr;
  MOE_CHECK_LT(cublasLtMatrixLayoutCreate(&h, static_cast<cudaDataType_t>(l.type),
                                          static_cast<uint64_t>(l.rows),
                                          static_cast<uint64_t>(l.cols), l.ld),
               what);
  // Column-major is the default order (CUBLASLT_ORDER_COL), as the descriptors assume.
  const int32_t count = l.batch_count;
  const int64_t stride = l.batch_stride;
  MOE_CHECK_LT(
      cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
      what);
  MOE_CHECK_LT(cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                &stride, sizeof stride),
               what);
  return h;
}

}  // namespace

struct BlasHandles {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;  // kBlasWorkspaceBytes of device memory
  std::map<PlanKey, LtPlan> plans;
  // cublasGemmGroupedBatchedEx's device pointer tables (A, B, C: 3 x capacity), grown outside
  // capture when a call has more problems.
  void** tables = nullptr;
  size_t table_capacity = 0;
  std::vector<const void*> host_tables;
};

namespace {

std::unique_ptr<BlasHandles> make_handles(cudaStream_t stream) {
  auto h = std::make_unique<BlasHandles>();
  h->stream = stream;
  const char* what = "creating the GEMM library handles of a stream";
  MOE_CHECK_LT(cublasLtCreate(&h->lt), what);
  MOE_CHECK_LT(cublasCreate(&h->blas), what);
  MOE_CHECK_CUDART(cudaMalloc(&h->workspace, kBlasWorkspaceBytes),
                   fmt::format("the {} bytes of cuBLAS workspace", kBlasWorkspaceBytes));
  MOE_CHECK_LT(cublasSetStream(h->blas, stream), what);
  MOE_CHECK_LT(cublasSetWorkspace(h->blas, h->workspace, kBlasWorkspaceBytes), what);
  // Pedantic math: f32 GEMMs in full f32 (no TF32 tensor cores, no BF16x9 emulation, whatever the
  // environment asks), f64 without fixed-point emulation: the tolerances of docs/numerics.md
  // assume the compute type's own arithmetic.
  MOE_CHECK_LT(cublasSetMathMode(h->blas, CUBLAS_PEDANTIC_MATH), what);
  return h;
}

}  // namespace

BlasHandles& blas_handles(const Exec& ex) {
  MOE_CHECK(ex.device == Device::CUDA, "[gemm] blas_handles needs a CUDA context, got --device {}",
            device_name(ex.device));
  static std::mutex mutex;
  // Deliberately leaked (blas.h): destroying handles after the CUDA context at exit can crash.
  static auto* by_stream = new std::map<void*, std::unique_ptr<BlasHandles>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& h = (*by_stream)[ex.stream];
  if (!h) h = make_handles(static_cast<cudaStream_t>(ex.stream));
  return *h;
}

void run_matmul(const Exec& ex, const LtMatmulDesc& d, const void* A, const void* B, void* C,
                BlasHandles& blas) {
  if (d.empty) return;
  cudaStream_t stream = static_cast<cudaStream_t>(ex.stream);
  MOE_CHECK(stream == blas.stream, "[gemm] run_matmul: the handles belong to another stream");
  const desc::MatmulOperands slots = desc::matmul_operands(d, A, B);
  const std::array<uint32_t, 3> align = {alignment_of(slots.a_slot), alignment_of(slots.b_slot),
                                         alignment_of(C)};
  const PlanKey key = plan_key(d, align);
  auto it = blas.plans.find(key);
  if (it == blas.plans.end()) {
    // The choice: cublasLtMatmulAlgoGetHeuristic's first algorithm at the fixed workspace, the
    // same for the same descriptor in every run. It must happen before graph capture (the first,
    // eager step): a capture cannot choose, and a choice at another moment could differ.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CHECK_CUDART(cudaStreamIsCapturing(stream, &capture), shapes(d));
    MOE_CHECK(capture == cudaStreamCaptureStatusNone,
              "[gemm] a GEMM first seen during graph capture ({}): run the step once eagerly "
              "before capturing it, so every GEMM's algorithm is chosen",
              shapes(d));
    LtPlan p;
    const std::string what = shapes(d);
    MOE_CHECK_LT(cublasLtMatmulDescCreate(&p.op, static_cast<cublasComputeType_t>(d.compute),
                                          static_cast<cudaDataType_t>(d.scale_type)),
                 what);
    const int32_t ta = static_cast<int32_t>(d.trans_a), tb = static_cast<int32_t>(d.trans_b);
    MOE_CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                 what);
    MOE_CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                 what);
    p.a = make_layout(d.a, what);
    p.b = make_layout(d.b, what);
    p.c = make_layout(d.c, what);
    cublasLtMatmulPreference_t pref = nullptr;
    MOE_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref), what);
    const uint64_t ws = kBlasWorkspaceBytes;
    MOE_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                 what);
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    const uint32_t align_val[4] = {align[0], align[1], align[2], align[2]};
    for (int i = 0; i < 4; ++i)
      MOE_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align_val[i],
                                                        sizeof align_val[i]),
                   what);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(blas.lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    MOE_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
              "[gemm] cuBLASLt has no algorithm for {} (status {}, {} found) within {} bytes of "
              "workspace",
              what, cublasLtGetStatusString(st), found, kBlasWorkspaceBytes);
    p.algo = result.algo;
    it = blas.plans.emplace(key, p).first;
  }
  const LtPlan& p = it->second;
  const desc::BlasScalar alpha = desc::blas_scalar(d.scale_type, d.alpha);
  const desc::BlasScalar beta = desc::blas_scalar(d.scale_type, d.beta);
  // D == C: in place, same layout (gemm_desc.h).
  MOE_CHECK_LT(
      cublasLtMatmul(blas.lt, p.op, alpha.ptr(), slots.a_slot, p.a, slots.b_slot, p.b, beta.ptr(),
                     C, p.c, C, p.c, &p.algo, blas.workspace, kBlasWorkspaceBytes, stream),
      shapes(d));
}

void run_grouped_batched(const Exec& ex, const GroupedBatchedDesc& d, const void* A, const void* B,
                         void* C, BlasHandles& blas) {
  if (d.group_count == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(ex.stream);
  MOE_CHECK(stream == blas.stream,
            "[gemm] run_grouped_batched: the handles belong to another stream");
  std::string what =
      fmt::format("grouped GEMM of {} groups, {} x {} -> {}, compute {}:", d.group_count,
                  blas_data_type_name(d.a_type), blas_data_type_name(d.b_type),
                  blas_data_type_name(d.c_type), blas_compute_type_name(d.compute));
  for (int32_t g = 0; g < d.group_count; ++g)
    what += fmt::format(" [expert {}: {}{} m={} n={} k={} ld {} {} {}]", d.expert[g],
                        blas_op_name(d.transa[g]), blas_op_name(d.transb[g]), d.m[g], d.n[g],
                        d.k[g], d.lda[g], d.ldb[g], d.ldc[g]);
  const desc::GroupedArgs args = desc::grouped_args(d, A, B, C);
  const size_t problems = args.a.size();
  if (problems > blas.table_capacity) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CHECK_CUDART(cudaStreamIsCapturing(stream, &capture), what);
    MOE_CHECK(capture == cudaStreamCaptureStatusNone,
              "[gemm] the grouped GEMM cannot be captured in a graph (host-side sizes): {}", what);
    // The old tables may still be read by an enqueued call.
    MOE_CHECK_CUDART(cudaStreamSynchronize(stream), what);
    if (blas.tables) MOE_CHECK_CUDART(cudaFree(blas.tables), what);
    blas.tables = nullptr;
    MOE_CHECK_CUDART(
        cudaMalloc(reinterpret_cast<void**>(&blas.tables), 3 * problems * sizeof(void*)), what);
    blas.table_capacity = problems;
  }
  blas.host_tables.assign(args.a.begin(), args.a.end());
  blas.host_tables.insert(blas.host_tables.end(), args.b.begin(), args.b.end());
  blas.host_tables.insert(blas.host_tables.end(), args.c.begin(), args.c.end());
  void** dev_a = blas.tables;
  void** dev_b = blas.tables + problems;
  void** dev_c = blas.tables + 2 * problems;
  // From pageable memory: staged before the call returns (blas.h: inside the documented sync).
  MOE_CHECK_CUDART(cudaMemcpyAsync(blas.tables, blas.host_tables.data(),
                                   3 * problems * sizeof(void*), cudaMemcpyHostToDevice, stream),
                   what);
  static_assert(sizeof(cublasOperation_t) == sizeof(desc::BlasOp));
  MOE_CHECK_LT(cublasGemmGroupedBatchedEx(
                   blas.blas, reinterpret_cast<const cublasOperation_t*>(d.transa.data()),
                   reinterpret_cast<const cublasOperation_t*>(d.transb.data()), d.m.data(),
                   d.n.data(), d.k.data(), args.alpha.data(), const_cast<const void* const*>(dev_a),
                   static_cast<cudaDataType_t>(d.a_type), d.lda.data(),
                   const_cast<const void* const*>(dev_b), static_cast<cudaDataType_t>(d.b_type),
                   d.ldb.data(), args.beta.data(), dev_c, static_cast<cudaDataType_t>(d.c_type),
                   d.ldc.data(), d.group_count, d.group_size.data(),
                   static_cast<cublasComputeType_t>(d.compute)),
               what);
}

}  // namespace moecore::ops::cuda
