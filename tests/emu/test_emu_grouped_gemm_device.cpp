// The emulated build's device-table grouped GEMM (tests/emu/grouped_gemm_device_emu.cpp) and the
// CUDA path that feeds it (ops/cuda/gemm.cu, grouped_gemm_device_tables: the table kernel, then
// device_grouped_gemm), on emulated device allocations:
// - bitwise the host-table path's results: the descriptors cuBLAS is handed
//   (desc::grouped_batched_forward / _wgrad) run through the cuBLAS stand-in's interpreter, for
//   the forward in both weight layouts, the dgrad and the wgrad, f32, f64 and bf16, empty experts
//   first, last, in the middle and all, more experts than a warp; the rows past the last group,
//   the dw of empty experts and the workspace's tail untouched;
// - TF32 (--fp32-matmul-precision high, GemmTypes::F32Tf32) on full-mantissa inputs: bitwise the
//   host tables' TF32 results, directly and through the switch of ops/gemm.h;
// - the CUDA backend's parameter cache (ops/cuda/grouped_gemm_params_cache.h): its policy, and the
//   plan's count of distinct calls reaching the emulated backend's model of it;
// - what it takes (the project's types, N and K multiples of 16 bytes' worth of elements) and the
//   override MOECORE_EMU_GROUPED_GEMM=unsupported;
// - strict: a table, workspace or operand outside one device allocation, misaligned operands,
//   overlapping outputs, a workspace too small or over the table, invalid fields: each an error
//   naming it, nothing written;
// - the whole path with device memory kept apart from the host (strict mode, in a child process).
// The in-process tests run in shared mode (device allocations readable by the test itself); the
// mode is the process's, fixed at its first allocation, so they set it first.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/blas_interpreter.h"
#include "core/check.h"
#include "core/dtype.h"
#include "emu/device_memory_emu.h"
#include "emu/grouped_gemm_device_emu.h"
#include "ops/cuda/grouped_gemm_device.h"
#include "ops/cuda/grouped_gemm_params_cache.h"
#include "ops/desc/grouped_gemm_desc.h"
#include "ops/f32_matmul_precision.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm_tables.h"

namespace moecore {
namespace {

using ops::GroupedGemmForm;
using ops::cuda::GroupedGemmProblem;
using ops::desc::GemmTypes;

// Shared mode for the in-process tests (no other test of this binary allocates device memory in
// its own process). Skips when the process is already strict (run alone under
// MOECORE_EMU_DEVICE_MEMORY=strict).
bool shared_mode() {
  if (std::getenv("MOECORE_EMU_DEVICE_MEMORY") == nullptr)
    setenv("MOECORE_EMU_DEVICE_MEMORY", "shared", 1);
  return emu::device_memory_mode() == emu::DeviceMemoryMode::Shared;
}

// One emulated device allocation, freed at scope end.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : p(emu::device_alloc(std::max<size_t>(n, 1), false)), bytes(n) {}
  ~DevBuf() { emu::device_free(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  unsigned char* bytes_ptr() const { return static_cast<unsigned char*>(p); }
};

size_t in_bytes(GemmTypes t) {
  return size_t(ops::desc::gemm_input_bytes(t));
}
size_t out_bytes(GemmTypes t) {
  return size_t(ops::desc::gemm_output_bytes(t));
}

// n small integers (exact in every type) in the type's bytes; `real`: full-mantissa f32 values
// in [-1, 1] instead (TF32's rounding of the inputs shows in the products).
std::vector<unsigned char> values(size_t n, size_t elem, uint32_t seed, bool real = false) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-8, 8);
  std::uniform_real_distribution<float> r(-1.f, 1.f);
  std::vector<unsigned char> v(n * elem);
  for (size_t i = 0; i < n; ++i) {
    const float x = real ? r(rng) : float(u(rng)) * 0.25f;
    if (elem == 8) {
      const double y = x;
      std::memcpy(v.data() + i * 8, &y, 8);
    } else if (elem == 4) {
      std::memcpy(v.data() + i * 4, &x, 4);
    } else {
      const bf16 y = float_to_bf16(x);
      std::memcpy(v.data() + i * 2, &y, 2);
    }
  }
  return v;
}

struct Call {
  GroupedGemmForm form;
  bool trans_w;
  const char* name;
};

// One call of the CUDA path on device buffers vs the host-table descriptors on host copies.
void check_against_host_tables(GemmTypes types, const std::vector<int64_t>& m_G, int64_t N,
                               int64_t K, Call c, uint32_t seed, bool real = false) {
  const int64_t G = int64_t(m_G.size());
  const int64_t rows = std::accumulate(m_G.begin(), m_G.end(), int64_t{0});
  SCOPED_TRACE(::testing::Message() << c.name << " types " << int(types) << " G=" << G
                                    << " rows=" << rows << " N=" << N << " K=" << K);
  const bool wgrad = c.form == GroupedGemmForm::Wgrad;
  const size_t ib = in_bytes(types), ob = out_bytes(types);
  const int64_t extra = 3;  // rows past the last group: never written
  const size_t a_n = size_t((rows + extra) * (wgrad ? N : K)),
               b_n = size_t(wgrad ? (rows + extra) * K : G * N * K),
               d_n = size_t(wgrad ? G * N * K : (rows + extra) * N);
  const auto a = values(a_n, ib, seed, real), b = values(b_n, ib, seed + 1, real),
             d0 = values(d_n, ob, seed + 2, real);
  // The host-table path: cuBLAS's grouped call as the descriptor states it.
  const ops::desc::GroupedBatchedDesc desc =
      wgrad ? ops::desc::grouped_batched_wgrad(types, m_G.data(), G, N, K)
            : ops::desc::grouped_batched_forward(types, m_G.data(), G, N, K, c.trans_w);
  std::vector<unsigned char> want = d0;
  const auto slot = [&](ops::desc::GemmOperand o) -> const void* {
    return o == ops::desc::GemmOperand::A ? a.data() : b.data();
  };
  testing::gemm_grouped_batched(desc, slot(desc.a_operand), slot(desc.b_operand), want.data());

  // The device-table path on emulated device memory.
  DevBuf da(a.size()), db(b.size()), dd(d0.size()), dm(size_t(G) * 8);
  std::memcpy(da.p, a.data(), a.size());
  std::memcpy(db.p, b.data(), b.size());
  std::memcpy(dd.p, d0.data(), d0.size());
  std::memcpy(dm.p, m_G.data(), size_t(G) * 8);
  const int64_t ws_bytes = ops::grouped_gemm_device_workspace_bytes(G);
  const int64_t tail = 64;  // past the workspace: must stay as it was
  DevBuf dws(size_t(ws_bytes + tail));
  std::memset(dws.p, 0x5a, dws.bytes);
  const Exec ex{Device::CUDA, nullptr};
  ops::cuda::grouped_gemm_device_tables({&ex, types, c.form, static_cast<const int64_t*>(dm.p), G,
                                         N, K, c.trans_w, da.p, db.p, dd.p,
                                         static_cast<std::byte*>(dws.p), ws_bytes});
  EXPECT_EQ(std::memcmp(dd.p, want.data(), want.size()), 0)
      << "the device tables computed other bytes than the host tables";
  for (int64_t i = 0; i < tail; ++i) ASSERT_EQ(dws.bytes_ptr()[ws_bytes + i], 0x5a);
}

TEST(EmuGroupedGemmDevice, BitwiseTheHostTables) {
  if (!shared_mode()) GTEST_SKIP() << "device memory is strict in this process";
  std::vector<std::vector<int64_t>> loads = {
      {0, 5, 0, 3}, {0, 0, 7}, {7, 0, 0}, {0, 0, 0, 0}, {6}, {3, 1, 4, 1, 5, 9, 2, 6}};
  std::vector<int64_t> many(40);
  for (int64_t i = 0; i < 40; ++i) many[size_t(i)] = i % 3 == 0 ? 0 : i % 5 + 1;
  loads.push_back(many);
  const Call calls[] = {{GroupedGemmForm::Forward, false, "forward, w [G, K, N]"},
                        {GroupedGemmForm::Forward, true, "forward, w [G, N, K]"},
                        {GroupedGemmForm::Wgrad, false, "wgrad"}};
  uint32_t seed = 1;
  for (GemmTypes t : {GemmTypes::F32, GemmTypes::F64, GemmTypes::Bf16F32, GemmTypes::Bf16Bf16}) {
    for (const auto& m : loads) {
      for (const Call& c : calls) {
        // A bf16 output is assigned only (fc1's h): no weight gradient.
        if (t == GemmTypes::Bf16Bf16 && c.form == GroupedGemmForm::Wgrad) continue;
        check_against_host_tables(t, m, 16, 24, c, seed += 3);
        // The dgrad: the forward with N and K exchanged (and the other weight layout).
        if (c.form == GroupedGemmForm::Forward)
          check_against_host_tables(t, m, 24, 16, {c.form, !c.trans_w, "dgrad"}, seed += 3);
      }
    }
  }
}

// --fp32-matmul-precision high (GemmTypes::F32Tf32): the inputs rounded to TF32 as the emulated
// cuBLASLt rounds them, so on full-mantissa values the device tables give the host tables' TF32
// results bitwise (the f32 model, which sums exact products in double, gives other bits).
TEST(EmuGroupedGemmDevice, Tf32BitwiseTheHostTablesTf32) {
  if (!shared_mode()) GTEST_SKIP() << "device memory is strict in this process";
  const Call calls[] = {{GroupedGemmForm::Forward, false, "forward, w [G, K, N]"},
                        {GroupedGemmForm::Forward, true, "forward, w [G, N, K]"},
                        {GroupedGemmForm::Wgrad, false, "wgrad"}};
  uint32_t seed = 501;
  const std::vector<std::vector<int64_t>> loads = {{0, 5, 0, 3}, {3, 1, 4, 1, 5, 9}};
  for (const std::vector<int64_t>& m : loads) {
    for (const Call& c : calls) {
      check_against_host_tables(GemmTypes::F32Tf32, m, 16, 24, c, seed += 3, true);
      if (c.form == GroupedGemmForm::Forward) {
        check_against_host_tables(GemmTypes::F32Tf32, m, 24, 16, {c.form, !c.trans_w, "dgrad"},
                                  seed += 3, true);
      }
    }
  }
}

// The switch of ops/gemm.h under --fp32-matmul-precision high: the f32 grouped GEMMs (forward
// and wgrad, an expert without rows in the middle) take the device tables with TF32 products,
// bitwise the host tables' TF32 results; back at highest, the full f32 ones.
TEST(EmuGroupedGemmDevice, HighPrecisionTakesTheDeviceTablesWithTf32) {
  if (!shared_mode()) GTEST_SKIP() << "device memory is strict in this process";
  struct High {  // the process's setting for this test, restored after it
    High() { ops::set_f32_matmul_precision(ops::F32MatmulPrecision::High); }
    ~High() { ops::set_f32_matmul_precision(ops::F32MatmulPrecision::Highest); }
  } high;
  const std::vector<int64_t> m_G = {5, 0, 9};
  const int64_t G = 3, N = 16, K = 24, rows = 14;
  const Exec ex{Device::CUDA, nullptr};
  ASSERT_EQ(ops::grouped_gemm_types<float>(ex), GemmTypes::F32Tf32);
  ASSERT_EQ(ops::grouped_gemm_path(GemmTypes::F32Tf32, N, K), ops::GroupedGemmPath::Device);
  const auto x = values(size_t(rows * K), 4, 71, true), w = values(size_t(G * N * K), 4, 72, true),
             dy = values(size_t(rows * N), 4, 73, true),
             dw0 = values(size_t(G * N * K), 4, 74, true);
  // What the host tables compute (the cuBLAS stand-in's interpreter) for `types`.
  const auto host_tables = [&](GemmTypes types, bool wgrad) {
    std::vector<unsigned char> d = wgrad ? dw0 : std::vector<unsigned char>(size_t(rows * N) * 4);
    const ops::desc::GroupedBatchedDesc desc =
        wgrad ? ops::desc::grouped_batched_wgrad(types, m_G.data(), G, N, K)
              : ops::desc::grouped_batched_forward(types, m_G.data(), G, N, K, true);
    const auto& a = wgrad ? dy : x;
    const auto& b = wgrad ? x : w;
    const auto slot = [&](ops::desc::GemmOperand o) -> const void* {
      return o == ops::desc::GemmOperand::A ? a.data() : b.data();
    };
    testing::gemm_grouped_batched(desc, slot(desc.a_operand), slot(desc.b_operand), d.data());
    return d;
  };
  DevBuf dx(x.size()), dwt(w.size()), ddy(dy.size()), dy_out(size_t(rows * N) * 4), ddw(dw0.size()),
      dm(size_t(G) * 8);
  std::memcpy(dx.p, x.data(), x.size());
  std::memcpy(dwt.p, w.data(), w.size());
  std::memcpy(ddy.p, dy.data(), dy.size());
  std::memcpy(dm.p, m_G.data(), size_t(G) * 8);
  const int64_t ws_bytes = ops::grouped_gemm_workspace_bytes(ex, G);
  ASSERT_GT(ws_bytes, 0);
  DevBuf dws{size_t(ws_bytes)};
  const ops::GroupedGemmWorkspace ws{static_cast<std::byte*>(dws.p), ws_bytes};
  const auto* mp = static_cast<const int64_t*>(dm.p);
  const auto run = [&] {
    std::memset(dy_out.p, 0, dy_out.bytes);
    std::memcpy(ddw.p, dw0.data(), dw0.size());
    ops::grouped_gemm<float>(ex, mp, G, N, K, static_cast<const float*>(dx.p),
                             static_cast<const float*>(dwt.p), true, static_cast<float*>(dy_out.p),
                             ws);
    ops::grouped_gemm_wgrad<float>(ex, mp, G, N, K, static_cast<const float*>(ddy.p),
                                   static_cast<const float*>(dx.p), static_cast<float*>(ddw.p), ws);
  };
  run();
  EXPECT_EQ(std::memcmp(dy_out.p, host_tables(GemmTypes::F32Tf32, false).data(), dy_out.bytes), 0)
      << "the forward under high is not the host tables' TF32 result";
  EXPECT_EQ(std::memcmp(ddw.p, host_tables(GemmTypes::F32Tf32, true).data(), ddw.bytes), 0)
      << "the wgrad under high is not the host tables' TF32 result";
  ops::set_f32_matmul_precision(ops::F32MatmulPrecision::Highest);
  run();
  EXPECT_EQ(std::memcmp(dy_out.p, host_tables(GemmTypes::F32, false).data(), dy_out.bytes), 0)
      << "the forward at highest is not the full f32 result";
  EXPECT_NE(std::memcmp(dy_out.p, host_tables(GemmTypes::F32Tf32, false).data(), dy_out.bytes), 0)
      << "TF32 and f32 agree bitwise: the inputs do not show TF32's rounding";
}

// The CUDA backend's parameter cache (ops/cuda/grouped_gemm_params_cache.h), its policy alone: a
// step of 24 layers x (forward, dgrad, wgrad) makes 48 distinct calls (the forward and dgrad share
// beta 0); with the default 32 slots the least recently used call goes first, so every step
// misses every call; with the slots reserved for the step's 48, only the first step builds any.
// A build that throws keeps nothing.
TEST(GroupedGemmParamsCache, ReservedForAStepsCallsOnlyTheFirstStepBuilds) {
  using Cache = ops::cuda::GroupedGemmParamsCache<int>;
  using Key = ops::cuda::GroupedGemmParamsKey;
  std::vector<char> ws(64);
  const int layers = 24;
  const auto step = [&](Cache& c) {
    for (int l = 0; l < layers; ++l) {
      for (float beta : {0.f, 0.f, 1.f}) {
        const Key k{ws.data() + l, 8, beta, 0};
        const int want = l * 2 + int(beta);
        const int* p = c.find(k);
        if (p == nullptr) p = &c.keep(k, [&](int& v) { v = want; });
        EXPECT_EQ(*p, want) << "layer " << l << " beta " << beta;
      }
    }
  };
  Cache unplanned;
  ASSERT_LT(unplanned.slots(), size_t(2 * layers));
  for (int i = 0; i < 3; ++i) step(unplanned);
  EXPECT_EQ(unplanned.misses(), uint64_t(3 * 2 * layers)) << "more calls than slots: all miss";
  Cache planned;
  planned.reserve(size_t(2 * layers));
  EXPECT_EQ(planned.slots(), size_t(2 * layers));
  planned.reserve(4);  // never shrinks
  EXPECT_EQ(planned.slots(), size_t(2 * layers));
  step(planned);
  EXPECT_EQ(planned.misses(), uint64_t(2 * layers));
  step(planned);
  step(planned);
  EXPECT_EQ(planned.misses(), uint64_t(2 * layers)) << "a step after the first rebuilt parameters";
  const Key k{ws.data(), 9, 0.f, 0};
  EXPECT_THROW(planned.keep(k, [](int&) { throw std::runtime_error("driver refused"); }),
               std::runtime_error);
  EXPECT_EQ(planned.find(k), nullptr);
}

// The plan's count reaches the backend: every workspace sized on a context that runs reserves
// its two calls (beta 0 and 1) in the cache the emulated backend models, so a step over 24
// layers' workspaces, forward, dgrad and wgrad each, builds every call's parameters once, in its
// first step. A sizing pass's context (no stream) reserves nothing.
TEST(EmuGroupedGemmDevice, PlannedWorkspacesKeepEveryCallOfAStep) {
  if (!shared_mode()) GTEST_SKIP() << "device memory is strict in this process";
  const int64_t G = 7;  // no other test of this file calls with 7 problems (no key of theirs)
  const int layers = 24;
  const emu::GroupedGemmParamsCounts start = emu::grouped_gemm_params_counts();
  const Exec sizing{Device::CUDA, nullptr};
  for (int l = 0; l < layers; ++l) ASSERT_GT(ops::grouped_gemm_workspace_bytes(sizing, G), 0);
  EXPECT_EQ(emu::grouped_gemm_params_counts().slots, start.slots) << "a sizing pass reserved";
  int stream_tag = 0;
  const Exec runs{Device::CUDA, &stream_tag};
  for (int l = 0; l < layers; ++l) ASSERT_GT(ops::grouped_gemm_workspace_bytes(runs, G), 0);
  EXPECT_GE(emu::grouped_gemm_params_counts().slots, size_t(2 * layers));

  // Each layer's calls from its own workspace, over a table of experts without rows.
  DevBuf table(size_t(G) * sizeof(GroupedGemmProblem));
  for (int64_t g = 0; g < G; ++g) {
    GroupedGemmProblem p;
    p.lda = p.ldb = p.ldd = 1;
    std::memcpy(table.bytes_ptr() + g * int64_t(sizeof p), &p, sizeof p);
  }
  const size_t ws_bytes = (ops::cuda::device_grouped_gemm_workspace_bytes(G) + 63) / 64 * 64;
  DevBuf ws(ws_bytes * size_t(layers));
  const Exec ex{Device::CUDA, nullptr};
  const auto step = [&] {
    for (int l = 0; l < layers; ++l) {
      for (float beta : {0.f, 0.f, 1.f}) {  // forward, dgrad, wgrad
        ops::cuda::device_grouped_gemm(ex, GemmTypes::F32,
                                       static_cast<const GroupedGemmProblem*>(table.p), G, beta,
                                       ws.bytes_ptr() + size_t(l) * ws_bytes, ws_bytes);
      }
    }
  };
  step();
  const uint64_t first = emu::grouped_gemm_params_counts().built - start.built;
  EXPECT_EQ(first, uint64_t(2 * layers));
  step();
  step();
  EXPECT_EQ(emu::grouped_gemm_params_counts().built - start.built, first)
      << "steps after the first rebuilt the parameters of some calls";
}

TEST(EmuGroupedGemmDevice, TakesTheProjectTypesAtSixteenByteAlignment) {
  std::string why;
  EXPECT_TRUE(ops::cuda::device_grouped_gemm_supported(GemmTypes::Bf16F32, 8, 16, &why));
  EXPECT_FALSE(ops::cuda::device_grouped_gemm_supported(GemmTypes::Bf16F32, 12, 16, &why));
  EXPECT_NE(why.find("multiples of 8"), std::string::npos) << why;
  EXPECT_TRUE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F32, 12, 4, nullptr));
  EXPECT_FALSE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F32, 6, 4, nullptr));
  EXPECT_TRUE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F32Tf32, 12, 4, nullptr));
  EXPECT_FALSE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F32Tf32, 12, 6, &why));
  EXPECT_NE(why.find("tf32"), std::string::npos) << why;
  EXPECT_TRUE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F64, 6, 2, nullptr));
  EXPECT_FALSE(ops::cuda::device_grouped_gemm_supported(GemmTypes::F64, 7, 2, nullptr));
  EXPECT_EQ(ops::cuda::device_grouped_gemm_workspace_bytes(0), 0u);
  EXPECT_GT(ops::cuda::device_grouped_gemm_workspace_bytes(3), 0u);
}

TEST(EmuGroupedGemmDevice, OverrideAnswersUnsupported) {
  setenv("MOECORE_EMU_GROUPED_GEMM", "unsupported", 1);
  std::string why;
  const bool ok = ops::cuda::device_grouped_gemm_supported(GemmTypes::Bf16F32, 64, 64, &why);
  const Exec ex{Device::CUDA, nullptr};
  bool refused = false;
  try {
    ops::cuda::device_grouped_gemm(ex, GemmTypes::F32, nullptr, 1, 0.f, nullptr, 0);
  } catch (const Error& e) {
    refused = std::string(e.what()).find("MOECORE_EMU_GROUPED_GEMM=unsupported") !=
              std::string::npos;
  }
  setenv("MOECORE_EMU_GROUPED_GEMM", "bogus", 1);
  EXPECT_THROW(ops::cuda::device_grouped_gemm_supported(GemmTypes::F32, 8, 8, nullptr), Error);
  unsetenv("MOECORE_EMU_GROUPED_GEMM");
  EXPECT_FALSE(ok);
  EXPECT_NE(why.find("MOECORE_EMU_GROUPED_GEMM=unsupported"), std::string::npos) << why;
  EXPECT_TRUE(refused);
  EXPECT_TRUE(ops::cuda::device_grouped_gemm_supported(GemmTypes::Bf16F32, 64, 64, nullptr));
}

// A valid f32 forward problem (4 x 8 times 8 x 8) on device buffers, to be broken one way at a
// time; the call must refuse it naming `expect` and write nothing.
struct Rig {
  DevBuf a{4 * 8 * 4 + 64}, b{8 * 8 * 4}, d{4 * 8 * 4 + 64}, table{2 * sizeof(GroupedGemmProblem)};
  DevBuf ws{size_t(ops::cuda::device_grouped_gemm_workspace_bytes(2)) + 256};
  GroupedGemmProblem p[2];
  Rig() {
    for (auto& q : p) {
      q.m = 4, q.n = 8, q.k = 8, q.lda = 8, q.ldb = 8, q.ldd = 8;
      q.a = a.p, q.b = b.p, q.d = d.p;
    }
    p[1].m = 0;  // the second computes nothing
  }
  void expect_refused(const std::string& expect, GroupedGemmProblem* where = nullptr,
                      void* workspace = nullptr, size_t ws_bytes = 0) {
    GroupedGemmProblem* t = where != nullptr ? where : static_cast<GroupedGemmProblem*>(table.p);
    std::memcpy(static_cast<void*>(t), p, sizeof p);
    std::memset(d.p, 0x77, d.bytes);
    const Exec ex{Device::CUDA, nullptr};
    try {
      ops::cuda::device_grouped_gemm(ex, GemmTypes::F32, t, 2, 0.f,
                                     workspace != nullptr ? workspace : ws.p,
                                     workspace != nullptr ? ws_bytes : ws.bytes);
      ADD_FAILURE() << "not refused: " << expect;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
    for (size_t i = 0; i < d.bytes; ++i) ASSERT_EQ(d.bytes_ptr()[i], 0x77) << "D written";
  }
};

TEST(EmuGroupedGemmDevice, StrictAboutWhatATableAddresses) {
  if (!shared_mode()) GTEST_SKIP() << "device memory is strict in this process";
  {
    Rig r;  // the valid call runs
    std::memcpy(r.table.p, r.p, sizeof r.p);
    const Exec ex{Device::CUDA, nullptr};
    ops::cuda::device_grouped_gemm(ex, GemmTypes::F32, static_cast<GroupedGemmProblem*>(r.table.p),
                                   2, 0.f, r.ws.p, r.ws.bytes);
  }
  {
    Rig r;  // the table in host memory
    std::vector<GroupedGemmProblem> host(2);
    r.expect_refused("the problem table", host.data());
  }
  {
    Rig r;  // A past the end of its allocation
    r.p[0].a = r.a.bytes_ptr() + r.a.bytes - 16;
    r.expect_refused("problem 0's A");
  }
  {
    Rig r;  // B in host memory
    std::vector<float> host(64);
    r.p[0].b = host.data();
    r.expect_refused("problem 0's B");
  }
  {
    Rig r;  // D misaligned (TMA's 16 bytes)
    r.p[0].d = r.d.bytes_ptr() + 4;
    r.expect_refused("16-byte aligned");
  }
  {
    Rig r;  // a row stride that is not whole 16 bytes
    r.p[0].lda = 9;
    r.expect_refused("16-byte aligned");
  }
  {
    Rig r;  // two problems writing the same rows
    r.p[1].m = 2;
    r.expect_refused("overlap");
  }
  {
    Rig r;  // D over A
    r.p[0].a = r.d.p;
    r.expect_refused("overlaps its A");
  }
  {
    Rig r;  // an invalid field
    r.p[0].trans_a = 2;
    r.expect_refused("trans 0 or 1");
  }
  {
    Rig r;  // ld not covering the row
    r.p[0].ldd = 4;
    r.expect_refused("do not cover");
  }
  {
    Rig r;  // the workspace too small
    r.expect_refused("needed for 2 problems", nullptr, r.ws.p, 8);
  }
  {
    Rig r;  // the workspace over the table
    r.expect_refused("overlaps the problem table", nullptr, r.table.p,
                     ops::cuda::device_grouped_gemm_workspace_bytes(2));
  }
}

// The whole path with device memory apart from the host: the table kernel's launch checks its
// pointers, the library call reads the table and operands under DeviceAccess.
void strict_forward() {
  setenv("MOECORE_EMU_DEVICE_MEMORY", "strict", 1);
  const std::vector<int64_t> m_G = {0, 3, 5};
  const int64_t G = 3, N = 8, K = 8, rows = 8;
  std::vector<float> x(rows * K), w(G * N * K), y(rows * N), want(rows * N);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 7) - 3);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 5) - 2);
  ops::grouped_gemm_ref<float>(m_G.data(), G, N, K, x.data(), w.data(), true, want.data());
  const auto dev = [](size_t n) { return emu::device_alloc(n, false); };
  void *dx = dev(x.size() * 4), *dw = dev(w.size() * 4), *dy = dev(y.size() * 4), *dm = dev(G * 8);
  const int64_t ws_bytes = ops::grouped_gemm_device_workspace_bytes(G);
  auto* dws = static_cast<std::byte*>(dev(size_t(ws_bytes)));
  ops::cuda::copy_bytes(nullptr, dx, x.data(), x.size() * 4);
  ops::cuda::copy_bytes(nullptr, dw, w.data(), w.size() * 4);
  ops::cuda::copy_bytes(nullptr, dm, m_G.data(), G * 8);
  const Exec ex{Device::CUDA, nullptr};
  ops::cuda::grouped_gemm_device_tables({&ex, GemmTypes::F32, GroupedGemmForm::Forward,
                                         static_cast<const int64_t*>(dm), G, N, K, true, dx, dw,
                                         dy, dws, ws_bytes});
  ops::cuda::read_back_bytes(nullptr, y.data(), dy, y.size() * 4);
  std::exit(emu::device_memory_mode() == emu::DeviceMemoryMode::Strict && y == want ? 0 : 1);
}

TEST(EmuGroupedGemmDevice, RunsWithDeviceMemoryApartFromTheHost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(strict_forward(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace moecore
