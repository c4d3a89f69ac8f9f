// Core: dtype conversions, checked errors, arena planning, counter-based RNG purity, and
// layout-independent parameter initialization.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "common/testing.h"
#include "core/arena.h"
#include "core/check.h"
#include "core/device.h"
#include "core/rng.h"
#include "nn/param_registry.h"

namespace moecore {

using testing::host;
namespace {

TEST(Check, MessageCarriesValuesAndLocation) {
  try {
    int k = 9, e = 8;
    MOE_CHECK(k <= e, "[router] top_k={} > num_experts={}", k, e);
    FAIL() << "no throw";
  } catch (const Error& err) {
    // The message is the user's; the failed check and its place are kept beside it (and
    // appended to the message only under MOECORE_DEBUG_ERRORS=1).
    std::string m = err.what();
    EXPECT_NE(m.find("[router] top_k=9 > num_experts=8"), std::string::npos) << m;
    EXPECT_EQ(m.find("test_core.cpp") != std::string::npos, debug_errors()) << m;
    EXPECT_NE(err.where().find("k <= e"), std::string::npos) << err.where();
    EXPECT_NE(err.where().find("test_core.cpp"), std::string::npos) << err.where();
  }
}

TEST(Arena, TwoPassesOneBlockThenFrozen) {
  Arena a;
  auto layout = [&](Arena& ar) {
    float* x = host(ar.alloc<float>(10, "x"));
    double* y = host(ar.alloc<double>(3, "y", MemKind::Weights));
    return std::make_pair(x, y);
  };
  auto [px, py] = layout(a);
  EXPECT_EQ(px, nullptr);
  EXPECT_EQ(py, nullptr);
  EXPECT_EQ(a.planned_bytes(), 128u);  // two 64-byte aligned buffers
  EXPECT_EQ(a.bytes_of(MemKind::Weights), 64u);
  a.commit();
  auto [x, y] = layout(a);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(y) % Arena::kAlign, 0u);
  EXPECT_EQ(x[9], 0.0f);  // zero-filled
  a.freeze();
  EXPECT_THROW(a.alloc<float>(1, "late"), Error);
}

// Both memory spaces plan the same way; on the CPU backend both blocks are zero-filled,
// aligned host memory. A CUDA context without the CUDA build refuses to allocate, naming why.
TEST(Arena, MemorySpaces) {
  for (MemSpace space : {MemSpace::Device, MemSpace::PinnedHost}) {
    SCOPED_TRACE(std::string(mem_space_name(space)));
    Arena a(cpu_exec(), space);
    EXPECT_EQ(a.space(), space);
    int64_t* p = nullptr;
    a.plan([&](Arena& ar) { p = host(ar.alloc<int64_t>(100, "x", MemKind::State)); });
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % Arena::kAlign, 0u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(p[i], 0) << i;
    p[99] = 5;  // host-writable
  }
  EXPECT_THROW(exec_alloc(cpu_exec(), MemSpace::Device, 0), Error);  // names the space
  if (cuda_built()) return;
  Exec cuda;
  cuda.device = Device::CUDA;
  Arena a(cuda, MemSpace::PinnedHost);
  a.alloc<float>(4, "x");
  try {
    a.commit();
    ADD_FAILURE() << "a CUDA block without the CUDA build";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pinned host"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
}

TEST(Arena, AllocatingPassMustMatchPlan) {
  Arena a;
  a.alloc<float>(4, "x");
  a.commit();
  a.alloc<float>(4, "x");
  EXPECT_THROW(a.alloc<float>(100, "extra"), Error);
  Arena b;
  b.alloc<float>(4, "x");
  b.alloc<float>(4, "y");
  b.commit();
  b.alloc<float>(4, "x");
  EXPECT_THROW(b.freeze(), Error);  // the second buffer was never allocated
}

// Overlay members start at the same address; the overlay is as large as its largest member;
// Share routes only the kinds it names, Retag changes a kind for its scope, scopes nest.
TEST(Arena, OverlaysShareMemoryBetweenMembers) {
  struct Ptrs {
    float *kept, *ws0, *ws1, *act0, *rec0, *rec1;
  };
  auto layout = [](Arena& a) {
    Ptrs p{};
    p.kept = host(a.alloc<float>(16, "kept"));  // 64 bytes, plain
    for (int m = 0; m < 2; ++m) {
      Arena::Share share(a, "layer", m, {MemKind::Workspace, MemKind::Recomputed});
      float* ws = host(a.alloc<float>(m == 0 ? 32 : 64, "ws", MemKind::Workspace));
      float* act = host(a.alloc<float>(16, "act"));  // Activations: not routed, stays plain
      float* rec = nullptr;
      {
        Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed);
        rec = host(a.alloc<float>(16, "rec"));  // Recomputed: into the member
      }
      (m == 0 ? p.ws0 : p.ws1) = ws;
      if (m == 0) p.act0 = act;
      (m == 0 ? p.rec0 : p.rec1) = rec;
    }
    return p;
  };
  Arena a;
  layout(a);
  // Plain: kept + two act = 192; overlay: max(128 + 64, 256 + 64) = 320.
  EXPECT_EQ(a.planned_bytes(), 192u + 320u);
  EXPECT_EQ(a.bytes_of(MemKind::Workspace), 128u + 256u);
  EXPECT_EQ(a.bytes_of(MemKind::Recomputed), 128u);
  EXPECT_EQ(a.bytes_of(MemKind::Activations), 192u);
  EXPECT_EQ(a.shared_saving_bytes(), (192u + 320u) - 320u);
  // Without recomputation: +128 plain, overlay max(128, 256) = 256 -> 576; with: 512.
  EXPECT_EQ(a.recompute_saving_bytes(), 576u - 512u);
  a.commit();
  Ptrs p = layout(a);
  a.freeze();
  EXPECT_EQ(p.ws0, p.ws1);                // members overlap
  EXPECT_EQ(p.ws0 + 32, p.rec0);          // a member's buffers follow one another
  EXPECT_EQ(p.ws1 + 64, p.rec1);
  EXPECT_LT(p.act0, p.ws0);               // the plain part comes first
  EXPECT_EQ(p.kept + 16, p.act0);
  // After the scopes, nothing is routed or retagged any more.
  Arena b;
  { Arena::Share share(b, "o", 0, {MemKind::Workspace}); }
  { Arena::Retag retag(b, MemKind::Activations, MemKind::Recomputed); }
  b.alloc<float>(16, "w", MemKind::Workspace);
  b.alloc<float>(16, "x");
  EXPECT_EQ(b.bytes_of(MemKind::Recomputed), 0u);
  EXPECT_EQ(b.shared_saving_bytes(), 0u);
  EXPECT_EQ(b.planned_bytes(), 128u);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  // 1 + 3 * 2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(INFINITY)), INFINITY);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123's published known-answer vector for philox4x32-10 with zero counter and key.
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(Rng, PureFunctionOfSeedNameIndex) {
  uint64_t k1 = rng_key(1234, "decoder.layers.0.mlp.router.weight");
  uint64_t k2 = rng_key(1234, "decoder.layers.1.mlp.router.weight");
  uint64_t k3 = rng_key(1235, "decoder.layers.0.mlp.router.weight");
  EXPECT_NE(k1, k2);
  EXPECT_NE(k1, k3);
  EXPECT_EQ(rng_normal(k1, 77), rng_normal(k1, 77));
  EXPECT_NE(rng_normal(k1, 77), rng_normal(k1, 78));
  // Moments of the normal stream.
  double m = 0, v = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = rng_normal(k1, i);
    m += x;
    v += x * x;
  }
  m /= n;
  v = v / n - m * m;
  EXPECT_NEAR(m, 0.0, 0.01);  // 4.5 standard errors
  EXPECT_NEAR(v, 1.0, 0.015);
  for (int i = 0; i < 1000; ++i) {
    double u = rng_uniform(k2, i);
    EXPECT_GT(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
}

// A parameter sliced along any dimension holds exactly the matching slice of the global one.
TEST(ParamRegistry, InitIsLayoutIndependent) {
  const std::vector<int64_t> shape = {6, 4, 5};
  for (int dim = 0; dim < 3; ++dim) {
    ParamRegistry full(DType::F64);
    full.add(ParamSpec{"w", shape, ParamInit::Normal, 0.02, ParamKind::Expert, true, {}});
    Arena full_arena;
    full_arena.plan([&](Arena& a) { full.allocate(a); });
    full.init(42);
    const int64_t n_parts = 2, len = shape[dim] / n_parts;
    for (int64_t p = 0; p < n_parts; ++p) {
      ParamSpec spec{"w", shape, ParamInit::Normal, 0.02, ParamKind::Expert, true,
                     ParamSlice{dim, p * len, len}};
      ParamRegistry one(DType::F64);
      one.add(spec);
      Arena arena;
      arena.plan([&](Arena& a) { one.allocate(a); });
      one.init(42);
      const double* g = host(full.get("w").data_as<double>());
      const double* l = host(one.get("w").data_as<double>());
      int64_t li = 0;
      for (int64_t i = 0; i < shape[0]; ++i) {
        for (int64_t j = 0; j < shape[1]; ++j) {
          for (int64_t k = 0; k < shape[2]; ++k) {
            int64_t idx[3] = {i, j, k};
            if (idx[dim] < p * len || idx[dim] >= (p + 1) * len) continue;
            EXPECT_EQ(l[li++], g[(i * shape[1] + j) * shape[2] + k]) << "dim " << dim;
          }
        }
      }
      EXPECT_EQ(li, one.get("w").local_numel());
    }
  }
}

// The digest of a sliced parameter's parts adds up to the whole one's, for every sliced
// dimension; any changed bit, a swap of two values or another name changes it.
TEST(ParamRegistry, DigestIsLayoutIndependentAndSensitive) {
  const std::vector<int64_t> shape = {6, 4, 8};  // even: two halves cover each dim
  auto make = [&](ParamRegistry& r, Arena& arena, const std::string& name, ParamSlice slice) {
    r.add(ParamSpec{name, shape, ParamInit::Normal, 0.02, ParamKind::Expert, true, slice});
    arena.plan([&](Arena& a) { r.allocate(a); });
    r.init(42);
  };
  ParamRegistry full(DType::F32);
  Arena full_arena;
  make(full, full_arena, "w", {});
  const uint64_t whole = full.digest(ParamKind::Expert);
  EXPECT_EQ(full.digest(ParamKind::Dense), 0u);  // no dense parameters
  for (int dim = 0; dim < 3; ++dim) {
    const int64_t len = shape[dim] / 2;
    uint64_t sum = 0;
    for (int64_t p = 0; p < 2; ++p) {
      ParamRegistry part(DType::F32);
      Arena arena;
      make(part, arena, "w", ParamSlice{dim, p * len, len});
      sum += part.digest(ParamKind::Expert);
    }
    EXPECT_EQ(sum, whole) << "dim " << dim;
  }
  float* v = host(full.get("w").data_as<float>());
  v[7] = std::nextafter(v[7], 1.0f);
  EXPECT_NE(full.digest(ParamKind::Expert), whole) << "one ulp";
  v[7] = std::nextafter(v[7], -1.0f);
  EXPECT_EQ(full.digest(ParamKind::Expert), whole);
  std::swap(v[3], v[11]);
  EXPECT_NE(full.digest(ParamKind::Expert), whole) << "swapped values";
  ParamRegistry renamed(DType::F32);
  Arena renamed_arena;
  make(renamed, renamed_arena, "w2", {});
  std::copy(v, v + full.get("w").local_numel(), host(renamed.get("w2").data_as<float>()));
  std::swap(host(renamed.get("w2").data_as<float>())[3],
            host(renamed.get("w2").data_as<float>())[11]);
  EXPECT_NE(renamed.digest(ParamKind::Expert), whole) << "another name";
}

// Two split dimensions, the second in two parts (expert TP of SwiGLU's [gate; up] rows inside an
// expert-parallel slice): each rank holds exactly its elements of the global tensor, in local
// row-major order, the four ranks' elements tile it once, and their digests add up to the whole.
TEST(ParamRegistry, PartedTwoDimSlicesHoldTheirElements) {
  const std::vector<int64_t> shape = {4, 8, 6};  // [experts, 2 x rows, columns]
  ParamRegistry full(DType::F32);
  full.add(ParamSpec{"w", shape, ParamInit::Normal, 0.02, ParamKind::Expert, true, {}});
  Arena full_arena;
  full_arena.plan([&](Arena& a) { full.allocate(a); });
  full.init(7);
  const float* g = host(full.get("w").data_as<float>());
  std::vector<int> seen(static_cast<size_t>(full.get("w").global_numel()), 0);
  uint64_t digest_sum = 0;
  for (int64_t ep = 0; ep < 2; ++ep) {
    for (int64_t etp = 0; etp < 2; ++etp) {
      ParamSlice sl{0, ep * 2, 2, 1, DimSlice{1, etp * 2, 2, 2}};
      ParamRegistry one(DType::F32);
      one.add(ParamSpec{"w", shape, ParamInit::Normal, 0.02, ParamKind::Expert, true, sl});
      Arena arena;
      arena.plan([&](Arena& a) { one.allocate(a); });
      one.init(7);
      const Param& p = one.get("w");
      EXPECT_EQ(p.local_shape(), (std::vector<int64_t>{2, 4, 6}));
      EXPECT_EQ(p.local_numel(), 48);
      const float* l = host(p.data_as<float>());
      int64_t li = 0;
      for (int64_t e = 0; e < 2; ++e) {
        for (int64_t j = 0; j < 4; ++j) {
          for (int64_t k = 0; k < 6; ++k, ++li) {
            const int64_t ge = ep * 2 + e, gj = (j / 2) * 4 + etp * 2 + j % 2;
            const int64_t gi = (ge * 8 + gj) * 6 + k;
            EXPECT_EQ(param_global_index(p, li), gi);
            EXPECT_EQ(l[li], g[gi]) << "rank " << ep << "," << etp << " local " << li;
            ++seen[static_cast<size_t>(gi)];
          }
        }
      }
      digest_sum += one.digest(ParamKind::Expert);
    }
  }
  for (int c : seen) EXPECT_EQ(c, 1);
  EXPECT_EQ(digest_sum, full.digest(ParamKind::Expert));
  ParamRegistry bad(DType::F32);
  EXPECT_THROW(bad.add(ParamSpec{"odd", {4, 7}, ParamInit::Ones, 0, ParamKind::Dense, false,
                                 ParamSlice{1, 0, 1, 2}}),
               Error);  // 7 rows are not two equal parts
  EXPECT_THROW(bad.add(ParamSpec{"order", shape, ParamInit::Ones, 0, ParamKind::Dense, false,
                                 ParamSlice{1, 0, 2, 1, DimSlice{0, 0, 2, 1}}}),
               Error);  // the second split dimension before the first
}

TEST(ParamRegistry, FlatBuffersPerKindAndErrors) {
  ParamRegistry r(DType::F32);
  r.add(ParamSpec{"a", {3, 2}, ParamInit::Ones, 0, ParamKind::Dense, false, {}});
  r.add(ParamSpec{"e", {4, 2}, ParamInit::Zeros, 0, ParamKind::Expert, true, ParamSlice{0, 2, 2}});
  r.add(ParamSpec{"b", {5}, ParamInit::Normal, 1.0, ParamKind::Dense, true, {}});
  EXPECT_THROW(r.add(ParamSpec{"a", {1}, ParamInit::Ones, 0, ParamKind::Dense, false, {}}), Error);
  EXPECT_THROW(r.add(ParamSpec{"bad", {4}, ParamInit::Ones, 0, ParamKind::Dense, false,
                               ParamSlice{0, 3, 2}}),
               Error);
  Arena a;
  r.allocate(a);
  a.commit();
  r.allocate(a);
  a.freeze();
  r.init(1);
  EXPECT_EQ(r.numel(ParamKind::Dense), 11);
  EXPECT_EQ(r.numel(ParamKind::Expert), 4);
  EXPECT_EQ(r.get("b").offset, 6);
  EXPECT_EQ(static_cast<float*>(host(r.flat_data(ParamKind::Dense)))[0], 1.0f);
  EXPECT_EQ(r.get("b").data_as<float>(),
            static_cast<float*>(host(r.flat_data(ParamKind::Dense))) + 6);
  EXPECT_THROW(r.get("missing"), Error);
  EXPECT_THROW(r.add(ParamSpec{"late", {1}, ParamInit::Ones, 0, ParamKind::Dense, false, {}}),
               Error);
}

}  // namespace
}  // namespace moecore
