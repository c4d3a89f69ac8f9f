// The grid emulator's own tests: barriers, shared memory, shuffles, votes, atomics and launch
// limits behave as on sm_70+, and planted bugs are caught: a missing barrier (outputs differ
// between resume orders), a divergent barrier, a shuffle from an exited lane or from outside
// its mask, out-of-bounds writes to global and dynamic shared memory.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/cuda_emu.h"
#include "emu/emu_testing.h"
#include "ops/cuda/launch.cuh"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using ops::cuda::dynamic_shared;
using ops::cuda::launch;

// Every thread writes its linear id into shared memory, waits, and reads its neighbour's.
__global__ void neighbours(int* out) {
  __shared__ int s[256];
  const int n = int(blockDim.x * blockDim.y * blockDim.z);
  const int tid = int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  const int block = int(blockIdx.x + gridDim.x * blockIdx.y);
  s[tid] = 1000 * block + tid;
  __syncthreads();
  out[block * n + tid] = s[(tid + 1) % n];
}

TEST(Emu, BarrierAndSharedMemoryInEveryOrder) {
  const dim3 grid(3, 2), block(16, 4, 2);
  const int n = 128, blocks = 6;
  std::vector<int> out(size_t(n * blocks), -1);
  const std::string diff = order_dependence([&] {
    std::fill(out.begin(), out.end(), -1);
    launch("neighbours", neighbours, grid, block, 0, nullptr, out.data());
    for (int b = 0; b < blocks; ++b) {
      for (int t = 0; t < n; ++t) EXPECT_EQ(out[size_t(b * n + t)], 1000 * b + (t + 1) % n);
    }
    return bytes_of(out.data(), out.size());
  });
  EXPECT_EQ(diff, "");
}

// Dynamic shared memory: placed per launch, poisoned (NaN) before each block.
__global__ void reverse_through_shared(const float* x, float* y, int n) {
  float* s = dynamic_shared<float>();
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) s[i] = x[i];
  __syncthreads();
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) y[i] = s[n - 1 - i];
}

TEST(Emu, DynamicSharedMemory) {
  const int n = 1000;
  std::vector<float> x(n), y(n, 0.0f);
  std::iota(x.begin(), x.end(), 1.0f);
  launch("reverse_through_shared", reverse_through_shared, dim3(1), dim3(96), n * sizeof(float),
         nullptr, x.data(), y.data(), n);
  for (int i = 0; i < n; ++i) ASSERT_EQ(y[size_t(i)], x[size_t(n - 1 - i)]) << i;
}

// Warp collectives: a butterfly sum, up/down/indexed shuffles within segments, votes.
__global__ void warp_ops(const int* x, int* out) {
  const int tid = int(threadIdx.x), lane = tid % 32;
  const int v = x[tid];
  int sum = v;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  int* o = out + 7 * tid;
  o[0] = sum;
  o[1] = __shfl_up_sync(0xffffffffu, v, 3, 8);
  o[2] = __shfl_down_sync(0xffffffffu, v, 5, 16);
  o[3] = __shfl_sync(0xffffffffu, v, 3, 8);
  o[4] = int(__ballot_sync(0xffffffffu, v % 3 == 0));
  o[5] = __any_sync(0xffffffffu, lane == 7) + 2 * __all_sync(0xffffffffu, lane < 31);
  __syncwarp();
  o[6] = __shfl_sync(0xffffffffu, double(v) + 0.5, 31 - lane) ==
         double(x[tid - lane + 31 - lane]) + 0.5;
}

TEST(Emu, WarpShufflesAndVotes) {
  const int n = 64;
  std::vector<int> x(n), out(size_t(7 * n), -1);
  for (int i = 0; i < n; ++i) x[size_t(i)] = (i * 37) % 101;
  const std::string diff = order_dependence([&] {
    launch("warp_ops", warp_ops, dim3(1), dim3(n), 0, nullptr, x.data(), out.data());
    return bytes_of(out.data(), out.size());
  });
  EXPECT_EQ(diff, "");
  for (int t = 0; t < n; ++t) {
    const int w0 = t / 32 * 32, lane = t % 32;
    const int* o = out.data() + 7 * t;
    int sum = 0;
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l) {
      sum += x[size_t(w0 + l)];
      if (x[size_t(w0 + l)] % 3 == 0) ballot |= 1u << l;
    }
    EXPECT_EQ(o[0], sum) << t;
    EXPECT_EQ(o[1], lane % 8 >= 3 ? x[size_t(t - 3)] : x[size_t(t)]) << t;
    EXPECT_EQ(o[2], lane % 16 + 5 < 16 ? x[size_t(t + 5)] : x[size_t(t)]) << t;
    EXPECT_EQ(o[3], x[size_t(t / 8 * 8 + 3)]) << t;
    EXPECT_EQ(unsigned(o[4]), ballot) << t;
    EXPECT_EQ(o[5], 1) << t;  // some lane is 7; not every lane is < 31
    EXPECT_EQ(o[6], 1) << t;
  }
}

// Atomics from every thread of every block.
__global__ void atomics(int* count, int* max, unsigned* cas_count) {
  const int id = int(blockIdx.x * blockDim.x + threadIdx.x);
  atomicAdd(count, 1);
  atomicMax(max, (id * 7919) % 1000);
  unsigned seen = *cas_count;
  for (;;) {
    const unsigned prev = atomicCAS(cas_count, seen, seen + 2);
    if (prev == seen) break;
    seen = prev;
  }
}

TEST(Emu, Atomics) {
  int count = 0, max = -1;
  unsigned cas = 0;
  launch("atomics", atomics, dim3(5), dim3(100), 0, nullptr, &count, &max, &cas);
  int want_max = -1;
  for (int id = 0; id < 500; ++id) want_max = std::max(want_max, (id * 7919) % 1000);
  EXPECT_EQ(count, 500);
  EXPECT_EQ(max, want_max);
  EXPECT_EQ(cas, 1000u);
}

// A shared-memory tree reduction; `planted_race` leaves out the barrier between levels.
__global__ void tree_sum(const float* x, float* out, bool planted_race) {
  __shared__ float s[128];
  const int tid = int(threadIdx.x);
  s[tid] = x[blockIdx.x * blockDim.x + tid];
  __syncthreads();
  for (int stride = int(blockDim.x) / 2; stride > 0; stride /= 2) {
    if (tid < stride) s[tid] += s[tid + stride];
    if (!planted_race) __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = s[0];
}

TEST(Emu, PlantedRaceGivesDifferentOutputsInDifferentOrders) {
  const int blocks = 4, n = 128;
  const std::vector<float> x = testing::random_vec<float>(blocks * n, 7);
  std::vector<float> out(blocks);
  for (bool race : {false, true}) {
    const std::string diff = order_dependence([&] {
      std::fill(out.begin(), out.end(), NAN);
      launch("tree_sum", tree_sum, dim3(blocks), dim3(n), 0, nullptr, x.data(), out.data(), race);
      return bytes_of(out.data(), out.size());
    });
    if (race)
      EXPECT_NE(diff, "") << "the missing barrier went unnoticed";
    else
      EXPECT_EQ(diff, "");
  }
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Half the threads wait at one barrier, half at another.
__global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = 1;
    __syncthreads();
  }
}
// Threads that exit drop out of later barriers (sm_70+): not an error.
__global__ void early_exit_then_barrier(int* out) {
  if (threadIdx.x >= 40) return;
  out[threadIdx.x] = 1;
  __syncthreads();
  const int next = out[(threadIdx.x + 1) % 40];
  __syncthreads();
  out[threadIdx.x] += next;
}
// A warp's lanes split between a barrier and a shuffle.
__global__ void barrier_against_shuffle(int* out) {
  if (threadIdx.x % 2 == 0)
    __syncthreads();
  else
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}

TEST(Emu, DivergentBarrierIsAnError) {
  std::vector<int> out(64, 0);
  expect_error(
      [&] {
        launch("divergent_barrier", divergent_barrier, dim3(2), dim3(32), 0, nullptr, out.data());
      },
      "divergent barrier");
  expect_error(
      [&] {
        launch("barrier_against_shuffle", barrier_against_shuffle, dim3(1), dim3(64), 0, nullptr,
               out.data());
      },
      "deadlock");
  launch("early_exit_then_barrier", early_exit_then_barrier, dim3(1), dim3(64), 0, nullptr,
         out.data());
  for (int t = 0; t < 40; ++t) EXPECT_EQ(out[size_t(t)], 2) << t;
}

// Lanes 16..31 exit; lanes 0..15 shuffle down by 8, so lanes 8..15 read exited lanes.
__global__ void shuffle_from_exited_lane(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, int(threadIdx.x), 8);
}
// Lanes 0..15 shuffle among themselves but read lane ^ 16, outside their mask.
__global__ void shuffle_outside_mask(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, int(threadIdx.x), 16);
}
// Shuffles within the live lanes are fine after others exited.
__global__ void shuffle_among_live_lanes(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, int(threadIdx.x), 4, 8);
}

TEST(Emu, ShuffleFromAnExitedLaneOrOutsideTheMaskIsAnError) {
  std::vector<int> out(32, -1);
  expect_error(
      [&] {
        launch("shuffle_from_exited_lane", shuffle_from_exited_lane, dim3(1), dim3(32), 0, nullptr,
               out.data());
      },
      "an exited thread");
  expect_error(
      [&] {
        launch("shuffle_outside_mask", shuffle_outside_mask, dim3(1), dim3(32), 0, nullptr,
               out.data());
      },
      "outside the mask");
  launch("shuffle_among_live_lanes", shuffle_among_live_lanes, dim3(1), dim3(32), 0, nullptr,
         out.data());
  for (int t = 0; t < 16; ++t) EXPECT_EQ(out[size_t(t)], t % 8 < 4 ? t + 4 : t) << t;
}

// A tail bug: the bound check lets one element past n through.
__global__ void copy_off_by_one(const float* x, float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = i < n ? x[i] : 0.0f;
}

TEST(Emu, OutOfBoundsGlobalWriteIsCaughtByTheGuards) {
  const int64_t n = 100;
  const std::vector<float> x = testing::random_vec<float>(n, 3);
  testing::Guarded<float> y(n, NAN);
  launch("copy_off_by_one", copy_off_by_one, dim3(4), dim3(32), 0, nullptr, x.data(), y.data(), n);
  EXPECT_FALSE(y.intact()) << "the write past the end went unnoticed";
}

// Writes one float past its dynamic shared memory.
__global__ void shared_off_by_one(int n) {
  float* s = dynamic_shared<float>();
  for (int i = int(threadIdx.x); i <= n; i += int(blockDim.x)) s[i] = 1.0f;
}

TEST(Emu, OutOfBoundsSharedWriteIsAnError) {
#ifdef MOECORE_EMU_ASAN  // ASan stops the process at the write into the poisoned guard
  EXPECT_DEATH(launch("shared_off_by_one", shared_off_by_one, dim3(1), dim3(32), 50 * sizeof(float),
                      nullptr, 50),
               "use-after-poison");
  return;
#endif
  expect_error(
      [] {
        launch("shared_off_by_one", shared_off_by_one, dim3(1), dim3(32), 50 * sizeof(float),
               nullptr, 50);
      },
      "outside its 200 bytes of dynamic shared memory");
}

__global__ void nothing() {}

TEST(Emu, LaunchLimits) {
  expect_error([] { launch("nothing", nothing, dim3(1), dim3(1025), 0, nullptr); }, "1025 threads");
  expect_error([] { launch("nothing", nothing, dim3(1), dim3(32, 32, 2), 0, nullptr); },
               "2048 threads");
  expect_error([] { launch("nothing", nothing, dim3(0), dim3(32), 0, nullptr); }, "grid (0,1,1)");
  expect_error(
      [] { launch("nothing", nothing, dim3(1), dim3(32), emu::kMaxSharedBytes + 1, nullptr); },
      "bytes of dynamic shared memory");
  launch("nothing", nothing, dim3(1), dim3(1024), emu::kMaxSharedBytes, nullptr);
  expect_error([] { __syncthreads(); }, "outside a kernel");
}

}  // namespace
}  // namespace moecore
