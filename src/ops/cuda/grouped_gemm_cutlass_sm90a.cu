// The device-table grouped GEMM of the CUDA build (ops/cuda/grouped_gemm_device.h): CUTLASS 3's
// pointer-array grouped GEMM for sm_90a (TMA loads and stores, wgmma, the cooperative
// warp-specialized persistent schedule), bf16 operands, f32 accumulation, f32 C/D (Bf16F32) or,
// for the forward alone, a bf16 D (Bf16Bf16: the epilogue rounds the f32 accumulators to nearest
// even; the same mainloop and tiles, so the same sums as the f32 D), with the
// problem sizes on the device only (CUTLASS's "host problem shapes unavailable" mode, its example
// 57_hopper_grouped_gemm): the persistent grid is one CTA per SM and each CTA walks the device's
// table to find its tiles, so the host never reads a size.
//
// One call is two kernels on the stream, no host synchronisation, no allocation:
//   1. grouped_gemm_cutlass_tables (one block per problem) converts our GroupedGemmProblem[G] into
//      CUTLASS's arrays in the caller's workspace: problem shapes, pointer arrays, strides, and
//      the call's form (below). A problem that computes nothing gets the shape (0, 0, 0), which
//      the tile scheduler gives no tile: m = 0 or n = 0 (nothing to write), and k = 0, for which
//      CUTLASS's mainloop never clears its accumulators (it would write garbage + beta D): with
//      beta 1 D is already the answer; with beta 0 this block writes D's zeros itself.
//   2. grouped_gemm_bf16_f32_sm90a runs the GEMM (grouped_gemm_bf16_bf16_sm90a with a bf16 D:
//      the forms NT and NN). The project's grouped GEMMs come in three
//      layouts, each its own CUTLASS instantiation (wgmma reads K-major and MN-major operands
//      from differently swizzled shared memory, fixed at compile time):
//        NT  A [m,k] row-major, B stored [n,k]   (trans_b: forward with w [G,N,K], dgrad with
//                                                 w [G,K,N])
//        NN  A [m,k] row-major, B stored [k,n]   (dgrad with w [G,N,K], forward with w [G,K,N])
//        TN  A stored [k,m],    B [k,n] row-major (trans_a: wgrad)
//      The form is in the table (trans_a, trans_b), which only the device reads, so the kernel
//      holds all three instantiations and branches once, uniformly, on the form the first kernel
//      wrote: one launch, and the caller's interface stays free of the form. Every problem of a
//      call must have the same form (the table kernel writes one form per call); a table that
//      mixes forms, or asks for trans_a and trans_b together, or breaks TMA's 16-byte alignment,
//      stops the stream with a trap (the error surfaces at the next synchronisation).
// CUTLASS's kernel parameters (TMA descriptor templates, built on the host by the driver) depend
// only on the workspace address, G, beta, the types and the device: they are built on a call's first use and
// kept in a cache with a slot per distinct call the plan counted
// (ops/cuda/grouped_gemm_params_cache.h), so a repeated call costs the two launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "ops/cuda/grouped_gemm_device.h"
#include "ops/cuda/grouped_gemm_params_cache.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace gg {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;
using ElementAB = cutlass::bfloat16_t;
using ElementCD = float;
using ElementCD16 = cutlass::bfloat16_t;  // Bf16Bf16's C and D
// 128x128 output tiles, 64-deep k-tiles (128 bytes of bf16: the 128-byte swizzle), no clusters:
// MoE problems are many and uneven, and a 1x1 cluster leaves every tile to one CTA (no multicast
// pairing across problems of different sizes).
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 8: TMA's 16 bytes
constexpr int kAlignCD = 128 / cutlass::sizeof_bits<ElementCD>::value;  // 4
constexpr int kAlignCD16 = 128 / cutlass::sizeof_bits<ElementCD16>::value;  // 8
using LayoutD = cutlass::layout::RowMajor;

// The epilogue is the same for every form: D [m,n] row-major, D = acc + beta C with C = D.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementCD, LayoutD*, kAlignCD,
    ElementCD, LayoutD*, kAlignCD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementCD, float>>::CollectiveOp;
// The bf16 D's: the f32 accumulators (+ beta C, beta 0 here) rounded to nearest even into bf16
// (LinearCombination's default rounding).
using Epilogue16 = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementCD16, LayoutD*,
    kAlignCD16, ElementCD16, LayoutD*, kAlignCD16,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementCD16, float>>::CollectiveOp;
// Outside the template below: GCC (the host compiler) cannot reparse the epilogue's type, as
// nvcc's front end spells it, inside a template.
constexpr int kEpilogueSmemBytes = static_cast<int>(sizeof(Epilogue::SharedStorage));
constexpr int kEpilogue16SmemBytes = static_cast<int>(sizeof(Epilogue16::SharedStorage));

// CUTLASS's layout tags name the logical A [M,K] and B [K,N]: RowMajor A is K-contiguous,
// ColumnMajor A M-contiguous (stored [k,m]); ColumnMajor B is K-contiguous (stored [n,k]),
// RowMajor B N-contiguous (stored [k,n]).
template <class LayoutA, class LayoutB, class Epi, int kEpiSmemBytes>
struct Form {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpiSmemBytes>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epi>;
};
using FormNT =
    Form<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Epilogue, kEpilogueSmemBytes>::Kernel;
using FormNN =
    Form<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Epilogue, kEpilogueSmemBytes>::Kernel;
using FormTN =
    Form<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Epilogue, kEpilogueSmemBytes>::Kernel;
// The bf16 D's forms: the forward and the dgrad's layouts (a weight gradient accumulates: f32).
using FormNT16 = Form<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Epilogue16,
                      kEpilogue16SmemBytes>::Kernel;
using FormNN16 = Form<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Epilogue16,
                      kEpilogue16SmemBytes>::Kernel;

// The form codes the table kernel writes: trans_a * 2 + trans_b.
enum FormCode : int32_t { kFormNN = 0, kFormNT = 1, kFormTN = 2 };

constexpr uint32_t kThreads = FormNT::MaxThreadsPerBlock;
static_assert(FormNN::MaxThreadsPerBlock == kThreads && FormTN::MaxThreadsPerBlock == kThreads &&
                  FormNT::MinBlocksPerMultiprocessor == 1 &&
                  FormNN::MinBlocksPerMultiprocessor == 1 &&
                  FormTN::MinBlocksPerMultiprocessor == 1,
              "the three forms share one kernel: one block shape and launch bound");
constexpr int kSmemBytes = cute::max(
    FormNT::SharedStorageSize, cute::max(FormNN::SharedStorageSize, FormTN::SharedStorageSize));
static_assert(FormNT16::MaxThreadsPerBlock == kThreads &&
                  FormNN16::MaxThreadsPerBlock == kThreads &&
                  FormNT16::MinBlocksPerMultiprocessor == 1 &&
                  FormNN16::MinBlocksPerMultiprocessor == 1,
              "the bf16 D's kernel has the f32 one's block shape and launch bound");
constexpr int kSmem16Bytes = cute::max(FormNT16::SharedStorageSize, FormNN16::SharedStorageSize);

// Every stride CUTLASS reads per problem holds one dynamic 64-bit leading dimension beside
// static unit and batch strides, so the table kernel writes each as one int64 (its position in
// the tuple depends on the layout: stride_of below).
template <class Stride>
constexpr bool kOneDynamicStride = sizeof(Stride) == sizeof(int64_t);
static_assert(kOneDynamicStride<FormNT::InternalStrideA> &&
                  kOneDynamicStride<FormNT::InternalStrideB> &&
                  kOneDynamicStride<FormNN::InternalStrideB> &&
                  kOneDynamicStride<FormTN::InternalStrideA> &&
                  kOneDynamicStride<FormNT::InternalStrideD>,
              "a per-problem stride is one int64 leading dimension");
static_assert(std::is_same_v<FormNT::InternalStrideC, FormNT::InternalStrideD> &&
                  std::is_same_v<FormNN::InternalStrideD, FormNT::InternalStrideD> &&
                  std::is_same_v<FormTN::InternalStrideD, FormNT::InternalStrideD>,
              "C and D share one stride array");
static_assert(std::is_same_v<FormNN::InternalStrideA, FormNT::InternalStrideA> &&
                  std::is_same_v<FormTN::InternalStrideB, FormNN::InternalStrideB>,
              "the forms share A's K-major and B's N-major stride types");
static_assert(std::is_same_v<FormNT16::InternalStrideA, FormNT::InternalStrideA> &&
                  std::is_same_v<FormNT16::InternalStrideB, FormNT::InternalStrideB> &&
                  std::is_same_v<FormNN16::InternalStrideB, FormNN::InternalStrideB> &&
                  std::is_same_v<FormNT16::InternalStrideD, FormNT::InternalStrideD> &&
                  std::is_same_v<FormNN16::InternalStrideD, FormNT::InternalStrideD> &&
                  std::is_same_v<FormNT16::InternalStrideC, FormNT::InternalStrideD>,
              "the bf16 D's forms read the same stride arrays");
static_assert(sizeof(Shape3) == 3 * sizeof(int), "a problem shape is three ints");

// The kernel parameters of one call: the form word and each form's CUTLASS parameters (TMA
// descriptors live in them: the kernel takes them as a __grid_constant__).
struct FusedParams {
  const int32_t* form = nullptr;
  FormNT::Params nt;
  FormNN::Params nn;
  FormTN::Params tn;
};
struct FusedParams16 {
  const int32_t* form = nullptr;
  FormNT16::Params nt;
  FormNN16::Params nn;
};

// The workspace: our arrays, then CUTLASS's own (per-SM TMA descriptor copies).
struct Layout {
  size_t form = 0, shapes = 0, a = 0, b = 0, d = 0, stride_a = 0, stride_b = 0, stride_d = 0;
  size_t cutlass = 0, total = 0;
};

}  // namespace gg

namespace kernels {

// The table kernel writes stride s's one dynamic component (see gg::kOneDynamicStride).
template <class Stride>
__device__ __forceinline__ Stride stride_of(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::tuple_element_t<0, Stride>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// One block per problem: thread 0 checks the problem and writes its CUTLASS entries; with k = 0
// and beta 0 the whole block zeroes its D (a rare case: the wgrad of an expert without tokens
// when the caller assigns; the block walks D's rows, so a large D takes one SM's time).
// d16: D is bf16 (8 elements to TMA's 16 bytes, no trans_a form), else f32.
__global__ void grouped_gemm_cutlass_tables(const GroupedGemmProblem* problems, float beta,
                                            bool d16, int32_t* form_out, gg::Shape3* shapes,
                                            const gg::ElementAB** a, const gg::ElementAB** b,
                                            void** d, void* stride_a, void* stride_b,
                                            void* stride_d) {
  const int64_t g = blockIdx.x;
  const GroupedGemmProblem p = problems[g];
  const bool writes = p.m > 0 && p.n > 0;
  const bool runs = writes && p.k > 0;
  if (threadIdx.x == 0) {
    const int32_t form = p.trans_a * 2 + p.trans_b;
    const GroupedGemmProblem& first = problems[0];
    bool ok = (p.trans_a == 0 || p.trans_a == 1) && (p.trans_b == 0 || p.trans_b == 1) &&
              form != 3 && !(d16 && p.trans_a) && p.trans_a == first.trans_a &&
              p.trans_b == first.trans_b && p.m >= 0 && p.n >= 0 && p.k >= 0;
    if (runs) {
      // TMA: 16-byte aligned bases and row strides; the strides cover a stored row.
      ok = ok && aligned16(p.a) && aligned16(p.b) && aligned16(p.d) && p.lda % gg::kAlignAB == 0 &&
           p.ldb % gg::kAlignAB == 0 && p.ldd % (d16 ? gg::kAlignCD16 : gg::kAlignCD) == 0 &&
           p.lda >= (p.trans_a ? p.m : p.k) && p.ldb >= (p.trans_b ? p.k : p.n) && p.ldd >= p.n;
    }
    if (!ok) __trap();
    if (g == 0) *form_out = form;
    shapes[g] = runs ? gg::Shape3{p.m, p.n, p.k} : gg::Shape3{0, 0, 0};
    a[g] = static_cast<const gg::ElementAB*>(p.a);
    b[g] = static_cast<const gg::ElementAB*>(p.b);
    d[g] = p.d;
    using SA_K = gg::FormNT::InternalStrideA;  // A [m,k] row-major
    using SA_M = gg::FormTN::InternalStrideA;  // A stored [k,m]
    using SB_K = gg::FormNT::InternalStrideB;  // B stored [n,k]
    using SB_N = gg::FormNN::InternalStrideB;  // B stored [k,n]
    using SD = gg::FormNT::InternalStrideD;
    if (p.trans_a) {
      static_cast<SA_M*>(stride_a)[g] = stride_of<SA_M>(p.lda);
    } else {
      static_cast<SA_K*>(stride_a)[g] = stride_of<SA_K>(p.lda);
    }
    if (p.trans_b) {
      static_cast<SB_K*>(stride_b)[g] = stride_of<SB_K>(p.ldb);
    } else {
      static_cast<SB_N*>(stride_b)[g] = stride_of<SB_N>(p.ldb);
    }
    static_cast<SD*>(stride_d)[g] = stride_of<SD>(p.ldd);
  }
  if (writes && p.k == 0 && beta == 0.f) {
    for (int32_t i = 0; i < p.m; ++i) {
      for (int32_t j = threadIdx.x; j < p.n; j += blockDim.x) {
        const int64_t at = int64_t(i) * p.ldd + j;
        if (d16)
          static_cast<uint16_t*>(p.d)[at] = 0;  // bf16 +0
        else
          static_cast<float*>(p.d)[at] = 0.f;
      }
    }
  }
}

// The GEMM: the form the table kernel wrote picks the instantiation (uniform over the grid).
// Declared as CUTLASS's own device_kernel is: the parameters a __grid_constant__, the shared
// storage the dynamic shared memory from its base.
__global__ void __launch_bounds__(gg::kThreads, 1)
    grouped_gemm_bf16_f32_sm90a(const __grid_constant__ gg::FusedParams params) {
  extern __shared__ char smem[];
  const int32_t form = *params.form;
  if (form == gg::kFormNT) {
    gg::FormNT op;
    op(params.nt, smem);
  } else if (form == gg::kFormNN) {
    gg::FormNN op;
    op(params.nn, smem);
  } else {
    gg::FormTN op;
    op(params.tn, smem);
  }
}

// The same with a bf16 D (the forward: NT or NN; the table kernel refuses a trans_a form).
__global__ void __launch_bounds__(gg::kThreads, 1)
    grouped_gemm_bf16_bf16_sm90a(const __grid_constant__ gg::FusedParams16 params) {
  extern __shared__ char smem[];
  if (*params.form == gg::kFormNT) {
    gg::FormNT16 op;
    op(params.nt, smem);
  } else {
    gg::FormNN16 op;
    op(params.nn, smem);
  }
}

}  // namespace kernels

namespace {

// The workspace's arrays start at multiples of 64 bytes from its 64-byte aligned base (TMA
// descriptors need 64).
constexpr size_t kAlign = 64;
size_t round_up(size_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}
// Without a device to ask, the workspace is sized for this many SMs (an H100 has 132).
constexpr int kSmCountBound = 256;

// The current device, asked once: whether it is sm_90 and how many SMs it has.
struct DeviceFacts {
  int device = -1;
  int sm_count = 0;
  bool sm90 = false;
  std::string why;
};
const DeviceFacts& device_facts() {
  static const DeviceFacts facts = [] {
    DeviceFacts f;
    int major = 0, minor = 0;
    cudaError_t err = cudaGetDevice(&f.device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, f.device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, f.device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, f.device);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      f.why = std::string("no CUDA device to run it on (") + cudaGetErrorString(err) + ")";
      f.device = -1;
      f.sm_count = 0;
      return f;
    }
    f.sm90 = major == 9 && minor == 0;
    if (!f.sm90) {
      f.why = "its kernel is built for sm_90a (H100/H200) and this device is compute capability " +
              std::to_string(major) + "." + std::to_string(minor);
    }
    return f;
  }();
  return facts;
}

int sm_count_for_sizing() {
  const DeviceFacts& f = device_facts();
  return f.sm_count > 0 ? f.sm_count : kSmCountBound;
}

// CUTLASS's arguments of one form over the workspace's arrays.
template <class K>
typename K::Arguments arguments_of(const gg::Layout& l, char* ws, int G, float beta, int device,
                                   int sm_count) {
  typename K::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {G, reinterpret_cast<gg::Shape3*>(ws + l.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const gg::ElementAB**>(ws + l.a);
  args.mainloop.dA = reinterpret_cast<typename K::InternalStrideA*>(ws + l.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const gg::ElementAB**>(ws + l.b);
  args.mainloop.dB = reinterpret_cast<typename K::InternalStrideB*>(ws + l.stride_b);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.f;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  // C is D (beta 1 adds D), in K's element type.
  args.epilogue.ptr_C = reinterpret_cast<decltype(args.epilogue.ptr_C)>(ws + l.d);
  args.epilogue.dC = reinterpret_cast<typename K::InternalStrideC*>(ws + l.stride_d);
  args.epilogue.ptr_D = reinterpret_cast<decltype(args.epilogue.ptr_D)>(ws + l.d);
  args.epilogue.dD = reinterpret_cast<typename K::InternalStrideD*>(ws + l.stride_d);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class K>
size_t cutlass_workspace_bytes(int G, int sm_count) {
  gg::Layout none;
  return K::get_workspace_size(arguments_of<K>(none, nullptr, G, 0.f, 0, sm_count));
}

gg::Layout layout_of(int64_t G, int sm_count) {
  const int g = static_cast<int>(G);
  const size_t n = static_cast<size_t>(G);
  gg::Layout l;
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = round_up(at + bytes);
    return here;
  };
  l.form = take(sizeof(int32_t));
  l.shapes = take(n * sizeof(gg::Shape3));
  l.a = take(n * sizeof(void*));
  l.b = take(n * sizeof(void*));
  l.d = take(n * sizeof(void*));
  l.stride_a = take(n * sizeof(int64_t));
  l.stride_b = take(n * sizeof(int64_t));
  l.stride_d = take(n * sizeof(int64_t));
  // One form runs per call, so the forms share CUTLASS's workspace: the largest of the five.
  const size_t cutlass_bytes =
      std::max({cutlass_workspace_bytes<gg::FormNT>(g, sm_count),
                cutlass_workspace_bytes<gg::FormNN>(g, sm_count),
                cutlass_workspace_bytes<gg::FormTN>(g, sm_count),
                cutlass_workspace_bytes<gg::FormNT16>(g, sm_count),
                cutlass_workspace_bytes<gg::FormNN16>(g, sm_count)});
  l.cutlass = take(cutlass_bytes);
  l.total = at;
  return l;
}

template <class K>
typename K::Params params_of(const gg::Layout& l, char* ws, int G, float beta, int device,
                             int sm_count) {
  const typename K::Arguments args = arguments_of<K>(l, ws, G, beta, device, sm_count);
  MOE_KERNEL_CHECK(K::can_implement(args),
                   "[gemm] the device grouped GEMM's CUTLASS kernel refuses its arguments (G=" +
                       std::to_string(G) + ")");
  return K::to_underlying_arguments(args, ws + l.cutlass);
}

template <class K>
void initialize_cutlass_workspace(const gg::Layout& l, char* ws, int64_t G, float beta,
                                  const DeviceFacts& facts, void* stream) {
  const cutlass::Status st = K::initialize_workspace(
      arguments_of<K>(l, ws, static_cast<int>(G), beta, facts.device, facts.sm_count),
      ws + l.cutlass, static_cast<cudaStream_t>(stream));
  MOE_KERNEL_CHECK(
      st == cutlass::Status::kSuccess,
      std::string("[gemm] the device grouped GEMM's workspace: ") + cutlassGetStatusString(st));
}

// The parameters of the calls, by (workspace, G, beta, types, device): built once each (the TMA
// descriptor templates come from the driver), in fixed storage (a call allocates nothing), as
// many as the plan's distinct calls (ops/cuda/grouped_gemm_params_cache.h). A call's kernel is
// the f32 D's (params) or the bf16 D's (params16).
struct CallParams {
  gg::FusedParams params;
  gg::FusedParams16 params16;
  dim3 grid;
};

struct ParamsCache {
  std::mutex mutex;
  GroupedGemmParamsCache<CallParams> calls;
  // bit d: the kernel's shared-memory size is set on device d (the f32 D's, the bf16 D's)
  uint64_t smem_attribute_set = 0, smem16_attribute_set = 0;
};

// Asks for the kernel's dynamic shared memory once per device (bits: the devices done).
template <class Kernel>
void set_smem_once(Kernel kernel, int bytes, uint64_t* bits, int device) {
  const uint64_t bit = device >= 0 && device < 64 ? (uint64_t{1} << device) : 0;
  if ((*bits & bit) != 0 && bit != 0) return;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  MOE_KERNEL_CHECK(err == cudaSuccess, "[gemm] the device grouped GEMM's " +
                                           std::to_string(bytes) +
                                           " bytes of shared memory: " + cudaGetErrorString(err));
  *bits |= bit;
}
// The grid of a call's kernel: one kernel holds the forms and branches on the form word, so every
// form's parameters must ask for the same grid.
template <class... Forms>
dim3 common_grid(const char* which, const typename Forms::Params&... params) {
  const dim3 grids[] = {Forms::get_grid_shape(params)...};
  for (const dim3& g : grids) {
    MOE_KERNEL_CHECK(g.x == grids[0].x && g.y == grids[0].y && g.z == grids[0].z,
                     std::string("[gemm] the device grouped GEMM's ") + which +
                         " forms want different grids");
  }
  return grids[0];
}

ParamsCache& params_cache() {
  static ParamsCache cache;
  return cache;
}

}  // namespace

bool device_grouped_gemm_supported(desc::GemmTypes types, int64_t N, int64_t K, std::string* why) {
  std::string reason;
  if (types == desc::GemmTypes::F32Tf32) {
    // wgmma reads TF32 operands K-major only, and CUTLASS's sm90 pointer-array builders
    // transpose no 4-byte operand (their register-sourced mainloop, which would, is built for
    // mixed input types only): the MoE layer's dgrad or forward (B stored [k,n]) and its wgrad
    // (A and B stored [k, ...]) have no TF32 kernel here (docs/gpu.md).
    reason =
        "TF32 (--fp32-matmul-precision high) has no kernel: CUTLASS's sm90a pointer-array "
        "grouped GEMM takes TF32 operands K-major only, and the MoE layer's dgrad and wgrad "
        "read N- or M-major operands";
  } else if (types != desc::GemmTypes::Bf16F32 && types != desc::GemmTypes::Bf16Bf16) {
    reason = "its CUTLASS kernels take bf16 operands with an f32 or bf16 output only (--bf16)";
  } else if (N % 8 != 0 || K % 8 != 0) {
    reason = "TMA needs 16-byte aligned rows: N=" + std::to_string(N) +
             " and K=" + std::to_string(K) + " must be multiples of 8";
  } else if (!device_facts().sm90) {
    reason = device_facts().why;
  }
  if (reason.empty()) return true;
  if (why != nullptr) *why = "the device grouped GEMM cannot run: " + reason;
  return false;
}

size_t device_grouped_gemm_workspace_bytes(int64_t G) {
  MOE_KERNEL_CHECK(G >= 0 && G <= INT32_MAX,
                   "[gemm] device grouped GEMM over G=" + std::to_string(G) + " problems");
  return layout_of(G, sm_count_for_sizing()).total;
}

void device_grouped_gemm_reserve_calls(int64_t calls) {
  ParamsCache& cache = params_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.calls.reserve(static_cast<size_t>(std::max<int64_t>(calls, 0)));
}

void device_grouped_gemm(const Exec& ex, desc::GemmTypes types, const GroupedGemmProblem* problems,
                         int64_t G, float beta, void* workspace, size_t workspace_bytes) {
  const bool d16 = types == desc::GemmTypes::Bf16Bf16;
  MOE_KERNEL_CHECK(types == desc::GemmTypes::Bf16F32 || d16,
                   "[gemm] the device grouped GEMM runs bf16 operands with an f32 or bf16 output "
                   "only: ask device_grouped_gemm_supported first");
  MOE_KERNEL_CHECK(!d16 || beta == 0.f,
                   "[gemm] device grouped GEMM: a bf16 output is assigned only (beta 0)");
  MOE_KERNEL_CHECK(G >= 0 && G <= INT32_MAX,
                   "[gemm] device grouped GEMM over G=" + std::to_string(G) + " problems");
  MOE_KERNEL_CHECK(beta == 0.f || beta == 1.f,
                   "[gemm] device grouped GEMM: beta=" + std::to_string(beta) + " (0 or 1)");
  if (G == 0) return;
  const DeviceFacts& facts = device_facts();
  MOE_KERNEL_CHECK(facts.sm90, "[gemm] the device grouped GEMM cannot run: " + facts.why);
  MOE_KERNEL_CHECK(problems != nullptr && workspace != nullptr &&
                       reinterpret_cast<uintptr_t>(workspace) % kAlign == 0,
                   "[gemm] device grouped GEMM: the table and a 64-byte aligned workspace are "
                   "needed");
  const gg::Layout l = layout_of(G, facts.sm_count);
  MOE_KERNEL_CHECK(workspace_bytes >= l.total,
                   "[gemm] device grouped GEMM over G=" + std::to_string(G) + " needs " +
                       std::to_string(l.total) + " bytes of workspace, given " +
                       std::to_string(workspace_bytes) + " (device_grouped_gemm_workspace_bytes)");
  char* ws = static_cast<char*>(workspace);

  launch("grouped_gemm_cutlass_tables", kernels::grouped_gemm_cutlass_tables,
         dim3(static_cast<unsigned>(G)), dim3(256), 0, ex.stream, problems, beta, d16,
         reinterpret_cast<int32_t*>(ws + l.form), reinterpret_cast<gg::Shape3*>(ws + l.shapes),
         reinterpret_cast<const gg::ElementAB**>(ws + l.a),
         reinterpret_cast<const gg::ElementAB**>(ws + l.b), reinterpret_cast<void**>(ws + l.d),
         static_cast<void*>(ws + l.stride_a), static_cast<void*>(ws + l.stride_b),
         static_cast<void*>(ws + l.stride_d));

  ParamsCache& cache = params_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  const GroupedGemmParamsKey key{workspace, G, beta, facts.device, static_cast<uint8_t>(types)};
  const CallParams* hit = cache.calls.find(key);
  if (hit == nullptr && d16) {
    hit = &cache.calls.keep(key, [&](CallParams& c) {
      const int g = static_cast<int>(G);
      c.params16.form = reinterpret_cast<const int32_t*>(ws + l.form);
      c.params16.nt = params_of<gg::FormNT16>(l, ws, g, beta, facts.device, facts.sm_count);
      c.params16.nn = params_of<gg::FormNN16>(l, ws, g, beta, facts.device, facts.sm_count);
      c.grid = common_grid<gg::FormNT16, gg::FormNN16>("bf16-output", c.params16.nt,
                                                        c.params16.nn);
    });
  } else if (hit == nullptr) {
    hit = &cache.calls.keep(key, [&](CallParams& c) {
      const int g = static_cast<int>(G);
      c.params.form = reinterpret_cast<const int32_t*>(ws + l.form);
      c.params.nt = params_of<gg::FormNT>(l, ws, g, beta, facts.device, facts.sm_count);
      c.params.nn = params_of<gg::FormNN>(l, ws, g, beta, facts.device, facts.sm_count);
      c.params.tn = params_of<gg::FormTN>(l, ws, g, beta, facts.device, facts.sm_count);
      c.grid = common_grid<gg::FormNT, gg::FormNN, gg::FormTN>("three", c.params.nt, c.params.nn,
                                                               c.params.tn);
    });
  }
  // The CUTLASS workspace's own preparation, in stream order: nothing for these kernels (the
  // kernel writes its per-SM TMA descriptor copies itself), asked all the same.
  if (d16) {
    initialize_cutlass_workspace<gg::FormNT16>(l, ws, G, beta, facts, ex.stream);
    initialize_cutlass_workspace<gg::FormNN16>(l, ws, G, beta, facts, ex.stream);
    set_smem_once(kernels::grouped_gemm_bf16_bf16_sm90a, gg::kSmem16Bytes,
                  &cache.smem16_attribute_set, facts.device);
    launch("grouped_gemm_bf16_bf16_sm90a", kernels::grouped_gemm_bf16_bf16_sm90a, hit->grid,
           dim3(gg::kThreads), static_cast<size_t>(gg::kSmem16Bytes), ex.stream, hit->params16);
    return;
  }
  initialize_cutlass_workspace<gg::FormNT>(l, ws, G, beta, facts, ex.stream);
  initialize_cutlass_workspace<gg::FormNN>(l, ws, G, beta, facts, ex.stream);
  initialize_cutlass_workspace<gg::FormTN>(l, ws, G, beta, facts, ex.stream);
  set_smem_once(kernels::grouped_gemm_bf16_f32_sm90a, gg::kSmemBytes, &cache.smem_attribute_set,
                facts.device);
  launch("grouped_gemm_bf16_f32_sm90a", kernels::grouped_gemm_bf16_f32_sm90a, hit->grid,
         dim3(gg::kThreads), static_cast<size_t>(gg::kSmemBytes), ex.stream, hit->params);
}

}  // namespace moecore::ops::cuda
