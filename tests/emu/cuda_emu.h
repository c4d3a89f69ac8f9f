// The grid emulator (test-only): lets the kernel sources of src/ops/cuda/ (.cu) compile as C++ and
// run on the CPU, so every kernel is checked in CI without a GPU (docs/testing.md, "The grid
// emulator"). The test build force-includes this header before a .cu file.
//
// One block runs at a time; its threads are fibers (ucontext) on the calling OS thread, switched
// only at __syncthreads, warp collectives (__syncwarp, shuffles, votes) and exit. __syncthreads
// waits for every live thread of the block; an exited thread drops out (as on sm_70+). A warp
// collective waits for every live lane named in its mask. A barrier that cannot complete (threads
// waiting at different barriers, or at a barrier and a warp collective) is reported as an error,
// as is a shuffle that reads an exited lane or one outside its mask. Runnable fibers (and the
// blocks) are resumed in a chosen order per launch, so a kernel whose output depends on the
// interleaving (a race) gives different results in different orders.
#pragma once

#define MOECORE_CUDA_EMU 1

// Built with AddressSanitizer (GCC's or clang's flag): fiber switches are announced to it, and the
// guards around dynamic shared memory are poisoned, so it reports an overrun where it happens.
#if defined(__SANITIZE_ADDRESS__)
#define MOECORE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOECORE_EMU_ASAN 1
#endif
#endif

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/sync_audit.h"
#include "device_memory_emu.h"
#include "stream_capture_emu.h"

// ---- keywords --------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Per-block storage: one block runs at a time on this OS thread, so thread-local static storage
// is the block's. Static shared arrays only: dynamic shared memory is
// ops::cuda::dynamic_shared<T>() (src/ops/cuda/launch.cuh), since `extern __shared__` names no
// storage a C++ compiler can place.
#define __shared__ thread_local

// ---- vector types ----------------------------------------------------------------------------
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline float2 make_float2(float x, float y) {
  return {x, y};
}
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline double2 make_double2(double x, double y) {
  return {x, y};
}

using cudaStream_t = struct CUstream_st*;
constexpr int warpSize = 32;

namespace moecore::emu {

// The order in which runnable fibers (and the blocks of a grid) are resumed.
enum class ResumeOrder : uint8_t { Forward, Reversed, Shuffled };
const char* resume_order_name(ResumeOrder o);  // "forward", "reversed", "shuffled"

// The order of this OS thread's next launches (default Forward); `seed` drives Shuffled.
void set_resume_order(ResumeOrder order, uint64_t seed = 0);
ResumeOrder resume_order();
class ScopedResumeOrder {
 public:
  explicit ScopedResumeOrder(ResumeOrder order, uint64_t seed = 0);
  ~ScopedResumeOrder();
  ScopedResumeOrder(const ScopedResumeOrder&) = delete;
  ScopedResumeOrder& operator=(const ScopedResumeOrder&) = delete;

 private:
  ResumeOrder saved_order_;
  uint64_t saved_seed_;
};

// Counters of this OS thread since the last reset (for tests and timings).
struct Stats {
  int64_t launches = 0, blocks = 0, threads = 0, switches = 0;
};
Stats stats();
void reset_stats();

// CUDA's launch limits (compute capability 9.0), asserted by every launch.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxSharedBytes = 227 * 1024;  // dynamic + static, with the opt-in attribute

namespace detail {
// The running thread and block (valid inside a kernel only).
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_shared();

void sync_threads(const std::source_location& where);
// A warp collective: every live lane of `mask` contributes `value`; returns the value of lane
// `src_of(lane)` (a shuffle) or, for votes, the ballot of the lanes' values != 0.
enum class Collective : uint8_t { SyncWarp, Shfl, ShflUp, ShflDown, ShflXor, Ballot };
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width,
                         const std::source_location& where);

// Runs `body(arg)` as every thread of every block of the grid; throws moecore::Error on a launch
// limit, a divergent barrier or a bad shuffle.
void launch(const char* name, dim3 grid, dim3 block, size_t dynamic_smem, void (*body)(void*),
            void* arg);

// A kernel's pointer arguments must point into device memory (device_memory_emu.h, strict mode);
// a pointer to const is read, any other may be written (the collectives in flight: a pointer
// into a pending send range must be const).
template <typename T>
void check_argument(const char*, int, const T&) {}
template <typename T>
void check_argument(const char* kernel, int index, T* p) {
  check_kernel_pointer(kernel, index, static_cast<const void*>(p), !std::is_const_v<T>);
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type > 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
}  // namespace detail

// Runs kernel(args...) over the grid, the arguments converted to the kernel's parameter types
// and copied once (as a launch does). While a stream capture is open (stream_capture_emu.h) the
// launch is recorded with those copies instead, and runs when the graph is replayed.
template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem,
            A&&... args) {
  struct Call {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  } call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  const auto run = [name, grid, block, dynamic_smem](Call& c) {
    std::apply(
        [name](const auto&... p) {
          int index = 0;
          (detail::check_argument(name, index++, p), ...);
        },
        c.params);
    DeviceAccess access;
    detail::launch(
        name, grid, block, dynamic_smem,
        [](void* p) {
          auto* k = static_cast<Call*>(p);
          std::apply(k->kernel, k->params);
        },
        &c);
  };
  if (capturing()) {
    // The arguments are checked now too, where the launch is written.
    std::apply(
        [name](const auto&... p) {
          int index = 0;
          (detail::check_argument(name, index++, p), ...);
        },
        call.params);
    const SyncAudit::Paused device_work;  // the recording is the device's, not the host step's
    record(name, [run, call]() mutable { run(call); });
    return;
  }
  run(call);
}

}  // namespace moecore::emu

// ---- built-in variables ----------------------------------------------------------------------
#define threadIdx (::moecore::emu::detail::thread_idx())
#define blockIdx (::moecore::emu::detail::block_idx())
#define blockDim (::moecore::emu::detail::block_dim())
#define gridDim (::moecore::emu::detail::grid_dim())

// ---- barriers and warp collectives -----------------------------------------------------------
inline void __syncthreads(std::source_location w = std::source_location::current()) {
  ::moecore::emu::detail::sync_threads(w);
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  warp_collective(Collective::SyncWarp, mask, 0, 0, warpSize, w);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = warpSize,
              std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  return from_bits<T>(warp_collective(Collective::Shfl, mask, to_bits(v), src, width, w));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize,
                 std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  return from_bits<T>(warp_collective(Collective::ShflUp, mask, to_bits(v), int(delta), width, w));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize,
                   std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  return from_bits<T>(
      warp_collective(Collective::ShflDown, mask, to_bits(v), int(delta), width, w));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize,
                  std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  return from_bits<T>(warp_collective(Collective::ShflXor, mask, to_bits(v), lane_mask, width, w));
}
inline unsigned __ballot_sync(unsigned mask, int pred,
                              std::source_location w = std::source_location::current()) {
  using namespace ::moecore::emu::detail;
  return unsigned(warp_collective(Collective::Ballot, mask, pred != 0, 0, warpSize, w));
}
inline int __any_sync(unsigned mask, int pred,
                      std::source_location w = std::source_location::current()) {
  return __ballot_sync(mask, pred, w) != 0;
}
inline int __all_sync(unsigned mask, int pred,
                      std::source_location w = std::source_location::current()) {
  return __ballot_sync(mask, !pred, w) == 0;
}

// ---- atomics: fibers switch only at barriers, so a read-modify-write is atomic ----------------
template <typename T>
T atomicAdd(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
T atomicSub(T* p, T v) {
  T old = *p;
  *p = old - v;
  return old;
}
template <typename T>
T atomicMax(T* p, T v) {
  T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <typename T>
T atomicExch(T* p, T v) {
  T old = *p;
  *p = v;
  return old;
}
template <typename T>
T atomicCAS(T* p, T compare, T v) {
  T old = *p;
  if (old == compare) *p = v;
  return old;
}

// ---- loads and math intrinsics (host math: not the device's ulps) -----------------------------
template <typename T>
T __ldg(const T* p) {
  return *p;
}
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline double rsqrt(double x) {
  return 1.0 / std::sqrt(x);
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float __fdividef(float a, float b) {
  return a / b;
}
inline float __frcp_rn(float x) {
  return 1.0f / x;
}
inline float __fsqrt_rn(float x) {
  return std::sqrt(x);
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
inline double __fma_rn(double a, double b, double c) {
  return std::fma(a, b, c);
}
inline float __saturatef(float x) {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}
inline int __float_as_int(float x) {
  return std::bit_cast<int>(x);
}
inline unsigned __float_as_uint(float x) {
  return std::bit_cast<unsigned>(x);
}
inline float __int_as_float(int x) {
  return std::bit_cast<float>(x);
}
inline float __uint_as_float(unsigned x) {
  return std::bit_cast<float>(x);
}
inline long long __double_as_longlong(double x) {
  return std::bit_cast<long long>(x);
}
inline double __longlong_as_double(long long x) {
  return std::bit_cast<double>(x);
}

// ---- the runtime API's memory calls on host memory ---------------------------------------------
// The emulated CUDA build's memory is the host's and a launch runs to completion before it
// returns, so the asynchronous copies are plain ones and a stream has nothing left to wait for.
enum cudaError_t : int { cudaSuccess = 0, cudaErrorNotReady = 600 };
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
inline const char* cudaGetErrorString(cudaError_t) {
  return "no error";
}
// Both check their byte ranges against the collectives in flight (device_memory_emu.h). While a
// stream capture is open they are recorded (stream_capture_emu.h), their ranges in device or
// pinned memory, and run when the graph is replayed.
namespace moecore::emu::detail {
inline void memset_now(void* p, int value, size_t bytes) {
  check_pending("cudaMemsetAsync (a set of device memory)", p, bytes, true);
  const DeviceAccess access;
  std::memset(p, value, bytes);
}
inline void memcpy_now(void* dst, const void* src, size_t bytes) {
  check_pending("cudaMemcpyAsync (a copy's source)", src, bytes, false);
  check_pending("cudaMemcpyAsync (a copy's destination)", dst, bytes, true);
  const DeviceAccess access;
  std::memcpy(dst, src, bytes);
}
}  // namespace moecore::emu::detail
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  if (::moecore::emu::capturing()) {
    ::moecore::emu::check_capturable_range("cudaMemsetAsync (a set)", p, bytes);
    const ::moecore::SyncAudit::Paused device_work;
    ::moecore::emu::record("cudaMemsetAsync",
                           [p, value, bytes] { ::moecore::emu::detail::memset_now(p, value, bytes); });
    return cudaSuccess;
  }
  ::moecore::emu::detail::memset_now(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  if (::moecore::emu::capturing()) {
    ::moecore::emu::check_capturable_range("cudaMemcpyAsync (a copy's source)", src, bytes);
    ::moecore::emu::check_capturable_range("cudaMemcpyAsync (a copy's destination)", dst, bytes);
    const ::moecore::SyncAudit::Paused device_work;
    ::moecore::emu::record("cudaMemcpyAsync",
                           [dst, src, bytes] { ::moecore::emu::detail::memcpy_now(dst, src, bytes); });
    return cudaSuccess;
  }
  ::moecore::emu::detail::memcpy_now(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  ::moecore::emu::stream_synchronize();
  return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t) {
  return cudaSuccess;
}
