// Cases: the grouped GEMMs' device-table path (ops/gemm.h, ops/grouped_gemm_tables.h,
// ops/cuda/grouped_gemm_device.h). On CUDA the path is forced (the choice
// MOECORE_GROUPED_GEMM=device makes) for each type the build's backend takes at the case's N and
// K: the forward in both weight layouts, the dgrad (N and K exchanged, trans_w flipped) and the
// wgrad onto a non-zero dw, through the ops with a staged, guarded workspace of
// grouped_gemm_workspace_bytes, against the `_ref` within the dtype's row (bf16: the f32 row on
// bf16-rounded inputs) and against the host-table path (MOECORE_GROUPED_GEMM=host) of the same
// build: bitwise in the emulated build (both interpret the same problems in the same order), within
// the row on a GPU (CUTLASS's pointer-array kernel against cuBLAS). Empty experts first, last, in
// the middle, every expert empty, G = 1, more experts than a warp. A type the backend does not take
// is reported as not run, naming why (a backend that takes none: the case is skipped). The first
// GPU run of this case is the CUTLASS backend's first run. On the CPU the same ops take the CPU
// path (no tables), and the tables op its `_ref`.
// Also: the tables op against its `_ref` on the backend's own addresses (bitwise), the workspace
// query, and the start-up line.
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <fmt/format.h>
#include <omp.h>

#include "backend_case.h"
#include "core/device.h"
#include "ops/f32_matmul_precision.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/grouped_gemm_tables.h"

namespace moecore::backend_test {

StagedGroupedWorkspace::StagedGroupedWorkspace(const Exec& ex, Staging& st, int64_t G)
    : buf(std::max<int64_t>(ops::grouped_gemm_workspace_bytes(ex, G), 0), uint8_t(0xA5)) {
  if (buf.size() > 0) {
    data = reinterpret_cast<std::byte*>(st.out(buf));
    bytes = buf.size();
  }
}

namespace {

using ops::GroupedGemmPathChoice;
using ops::desc::GemmTypes;

// Restores the process's grouped-GEMM path choice when the case ends (or throws).
class ScopedPathChoice {
 public:
  explicit ScopedPathChoice(GroupedGemmPathChoice c) : saved_(ops::grouped_gemm_path_choice()) {
    ops::set_grouped_gemm_path_choice(c);
  }
  ~ScopedPathChoice() { ops::set_grouped_gemm_path_choice(saved_); }
  ScopedPathChoice(const ScopedPathChoice&) = delete;
  ScopedPathChoice& operator=(const ScopedPathChoice&) = delete;

 private:
  GroupedGemmPathChoice saved_;
};

bool emulated_device() {
  return cuda_device_info().description.rfind("emulated", 0) == 0;
}

// Empty experts first, last, in the middle, all; G = 1; 40 experts (more than a warp: the
// table kernel's scan across warps), row counts not divisible by 8.
std::vector<std::vector<int64_t>> device_groups() {
  std::vector<std::vector<int64_t>> g = {{0, 5, 0, 3}, {0, 0, 7}, {7, 0, 0}, {0, 0, 0, 0},
                                         {6},          {1},       {3, 1, 4, 1, 5, 9, 2, 6}};
  std::vector<int64_t> many(40);
  for (int64_t i = 0; i < 40; ++i) many[size_t(i)] = (i * 7) % 5 == 0 ? 0 : (i * 3) % 4 + 1;
  g.push_back(many);
  return g;
}

int64_t rows_of(const std::vector<int64_t>& m) {
  return std::accumulate(m.begin(), m.end(), int64_t{0});
}

// The three grouped GEMMs of one MLP-like shape on the current path: y = x op(w) for both
// layouts, dx = dy op'(w) (the forward with N, K exchanged), dw0 + dy^T x.
template <typename T>
struct GroupedOut {
  std::vector<T> y[2], dx, dw;
};

// Inputs as T (f32 / f64), or bf16 (types Bf16F32: x, dy, w cast; outputs f32).
template <typename T>
GroupedOut<T> run_grouped(const Exec& ex, GemmTypes types, const std::vector<int64_t>& m,
                          int64_t N, int64_t K, const std::vector<T>& x,
                          const std::vector<T>& dy, const std::vector<T>& w,
                          const std::vector<T>& dw0) {
  const int64_t G = int64_t(m.size()), rows = rows_of(m);
  GroupedOut<T> out;
  Staging st(ex);
  StagedGroupedWorkspace staged(ex, st, G);
  const ops::GroupedGemmWorkspace gws{staged.data, staged.bytes};
  Guarded<T> y0 = nan_out<T>(rows * N), y1 = nan_out<T>(rows * N), dx = nan_out<T>(rows * K);
  Guarded<T> dw = guarded(dw0);
  // The widened-bf16 CPU path's f32 operands (st.back() writes it back: it lives as long as st).
  Guarded<float> ws32(0);
  if (types == GemmTypes::Bf16F32) {
    if constexpr (std::is_same_v<T, float>) {
      const auto x16 = to_bf16(x), dy16 = to_bf16(dy), w16 = to_bf16(w);
      const int threads = omp_get_max_threads();
      ws32 = nan_out<float>(std::max(
          {ops::grouped_gemm_bf16_workspace_elems(ex, rows, N, K, threads),
           ops::grouped_gemm_bf16_workspace_elems(ex, rows, K, N, threads),
           ops::grouped_gemm_wgrad_bf16_workspace_elems(ex, rows, N, K)}));
      float* ws = ws32.size() > 0 ? st.out(ws32) : nullptr;
      ops::grouped_gemm_bf16(ex, st.in(m), G, N, K, st.in(x16), st.in(w16), false, st.out(y0), ws,
                             nullptr, gws);
      ops::grouped_gemm_bf16(ex, st.in(m), G, N, K, st.in(x16), st.in(w16), true, st.out(y1), ws,
                             nullptr, gws);
      // dgrad of the trans_w forward: w [G, N, K] read untransposed as [K', N'] = [N, K].
      ops::grouped_gemm_bf16(ex, st.in(m), G, K, N, st.in(dy16), st.in(w16), false, st.out(dx), ws,
                             nullptr, gws);
      ops::grouped_gemm_wgrad_bf16(ex, st.in(m), G, N, K, st.in(dy16), st.in(x16), st.out(dw), ws,
                                   gws);
    }
  } else {
    ops::grouped_gemm<T>(ex, st.in(m), G, N, K, st.in(x), st.in(w), false, st.out(y0), gws);
    ops::grouped_gemm<T>(ex, st.in(m), G, N, K, st.in(x), st.in(w), true, st.out(y1), gws);
    ops::grouped_gemm<T>(ex, st.in(m), G, K, N, st.in(dy), st.in(w), false, st.out(dx), gws);
    ops::grouped_gemm_wgrad<T>(ex, st.in(m), G, N, K, st.in(dy), st.in(x), st.out(dw), gws);
  }
  st.back();
  for (const auto* g : {&y0, &y1, &dx, &dw}) expect_intact(*g, "an output");
  EXPECT_TRUE(staged.buf.intact()) << "the grouped GEMMs wrote past their workspace";
  out.y[0] = y0.vec();
  out.y[1] = y1.vec();
  out.dx = dx.vec();
  out.dw = dw.vec();
  return out;
}

template <typename T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const char* what,
                 bool bitwise) {
  if (bitwise) {
    EXPECT_TRUE(same_bits(got.data(), want.data(), int64_t(want.size()))) << what;
  } else {
    EXPECT_TRUE(testing::all_close(got.data(), want.data(), int64_t(want.size()), Tol<T>::rtol,
                                   Tol<T>::atol))
        << what;
  }
}

template <typename T>
void device_tables_type(const Exec& ex, GemmTypes types, int64_t N, int64_t K, uint32_t seed) {
  const bool bf16 = types == GemmTypes::Bf16F32;
  for (const auto& m : device_groups()) {
    const int64_t G = int64_t(m.size()), rows = rows_of(m);
    BACKEND_TRACE("types " << (bf16 ? "bf16" : dtype_name<T>()) << " G=" << G << " rows=" << rows
                           << " N=" << N << " K=" << K);
    const auto x = random_vec<T>(rows * K, seed++), dy = random_vec<T>(rows * N, seed++);
    const auto w = random_vec<T>(G * N * K, seed++), dw0 = random_vec<T>(G * N * K, seed++);
    // The reference on the values the GEMMs see (bf16: the rounded inputs).
    std::vector<T> xr = x, dyr = dy, wr = w;
    if constexpr (std::is_same_v<T, float>) {
      if (bf16) xr = bf16_rounded(x), dyr = bf16_rounded(dy), wr = bf16_rounded(w);
    }
    GroupedOut<T> want;
    for (int tw = 0; tw < 2; ++tw) {
      want.y[tw].assign(size_t(rows * N), T(0));
      ops::grouped_gemm_ref<T>(m.data(), G, N, K, xr.data(), wr.data(), tw == 1,
                               want.y[tw].data());
    }
    want.dx.assign(size_t(rows * K), T(0));
    ops::grouped_gemm_ref<T>(m.data(), G, K, N, dyr.data(), wr.data(), false, want.dx.data());
    want.dw = dw0;
    ops::grouped_gemm_wgrad_ref<T>(m.data(), G, N, K, dyr.data(), xr.data(), want.dw.data());

    GroupedOut<T> dev;
    if (ex.on_cpu()) {
      dev = run_grouped<T>(ex, types, m, N, K, x, dy, w, dw0);
    } else {
      {
        const ScopedPathChoice device(GroupedGemmPathChoice::Device);
        dev = run_grouped<T>(ex, types, m, N, K, x, dy, w, dw0);
      }
      GroupedOut<T> host;
      {
        const ScopedPathChoice host_path(GroupedGemmPathChoice::Host);
        host = run_grouped<T>(ex, types, m, N, K, x, dy, w, dw0);
      }
      // The same problems interpreted alike in the emulated build; CUTLASS vs cuBLAS on a GPU.
      const bool bitwise = emulated_device();
      expect_same(dev.y[0], host.y[0], "y (w [G, K, N]): device tables vs host tables", bitwise);
      expect_same(dev.y[1], host.y[1], "y (w [G, N, K]): device tables vs host tables", bitwise);
      expect_same(dev.dx, host.dx, "dx: device tables vs host tables", bitwise);
      expect_same(dev.dw, host.dw, "dw: device tables vs host tables", bitwise);
    }
    expect_same(dev.y[0], want.y[0], "y (w [G, K, N]) vs grouped_gemm_ref", false);
    expect_same(dev.y[1], want.y[1], "y (w [G, N, K]) vs grouped_gemm_ref", false);
    expect_same(dev.dx, want.dx, "dx vs grouped_gemm_ref", false);
    expect_same(dev.dw, want.dw, "dw vs grouped_gemm_wgrad_ref", false);
    for (int64_t g = 0; g < G; ++g) {
      if (m[size_t(g)] == 0) {
        EXPECT_TRUE(same_bits(dev.dw.data() + g * N * K, dw0.data() + g * N * K, N * K))
            << "empty expert " << g << " changed its dw";
      }
    }
  }
}

void device_tables_case(const Exec& ex) {
  struct TypeShape {
    GemmTypes types;
    int64_t N, K;
  };
  // N and K multiples of 8: what the device tables take for bf16 (16-byte rows), and f32 / f64.
  const TypeShape shapes[] = {
      {GemmTypes::Bf16F32, 24, 40}, {GemmTypes::F32, 16, 24}, {GemmTypes::F64, 8, 16}};
  std::string not_run;
  int ran = 0;
  for (const TypeShape& s : shapes) {
    const char* name = s.types == GemmTypes::F64 ? "f64" : s.types == GemmTypes::F32 ? "f32" : "bf16";
    if (!ex.on_cpu()) {
      std::string why;
      if (!ops::cuda::device_grouped_gemm_supported(s.types, s.N, s.K, &why)) {
        not_run += fmt::format("{}{}: {}", not_run.empty() ? "" : "; ", name, why);
        continue;
      }
    }
    ++ran;
    if (s.types == GemmTypes::F64)
      device_tables_type<double>(ex, s.types, s.N, s.K, 900);
    else
      device_tables_type<float>(ex, s.types, s.N, s.K, s.types == GemmTypes::F32 ? 910 : 920);
  }
  if (!not_run.empty()) std::printf("[ NOT RUN  ] device-table grouped GEMMs: %s\n", not_run.c_str());
  if (ran == 0) GTEST_SKIP() << "not run: the device-table grouped GEMM takes no type here: " << not_run;
}

// The tables op on the backend's own addresses against its `_ref`, bitwise, every byte of every
// problem; the table's guards intact.
void tables_case(const Exec& ex) {
  uint32_t seed = 40;
  for (const auto& m : device_groups()) {
    for (GemmTypes types : {GemmTypes::F32, GemmTypes::F64, GemmTypes::Bf16F32}) {
      for (int form = 0; form < 3; ++form) {  // forward, forward with trans_w, wgrad
        const int64_t G = int64_t(m.size()), rows = rows_of(m), N = 5, K = 3;
        BACKEND_TRACE("G=" << G << " form " << form << " types " << int(types));
        const ops::GroupedGemmForm f =
            form == 2 ? ops::GroupedGemmForm::Wgrad : ops::GroupedGemmForm::Forward;
        const auto a = random_vec<float>(std::max<int64_t>(rows, 1) * 8, seed++);
        const auto b = random_vec<float>(std::max<int64_t>(G * N * K, rows * K) * 2, seed++);
        const auto d = random_vec<float>(std::max<int64_t>(G * N * K, rows * N) * 2, seed++);
        constexpr int64_t kP = int64_t(sizeof(ops::cuda::GroupedGemmProblem));
        Guarded<uint8_t> table(G * kP, uint8_t(0xA5));
        std::vector<uint8_t> want(size_t(G * kP));
        {
          Staging st(ex);
          const float* da = st.in(a);
          const float* db = st.in(b);
          const float* dd = st.in(d);
          auto* problems = reinterpret_cast<ops::cuda::GroupedGemmProblem*>(st.out(table));
          ops::grouped_gemm_tables(ex, problems, st.in(m), G, f, types, N, K, form == 1, da, db,
                                   const_cast<float*>(dd));
          st.back();
          // The reference on the same addresses (it only offsets them).
          ops::grouped_gemm_tables_ref(reinterpret_cast<ops::cuda::GroupedGemmProblem*>(want.data()),
                                       m.data(), G, f, types, N, K, form == 1, da, db,
                                       const_cast<float*>(dd));
        }
        EXPECT_TRUE(same_bits(table.data(), want.data(), G * kP)) << "the problem table";
        expect_intact(table, "the problem table");
      }
    }
  }
}

// The workspace query and the start-up line on each path; the types a grouped GEMM of f32 / f64
// asks for: TF32 products on a device under --fp32-matmul-precision high, else its own dtype.
void path_case(const Exec& ex) {
  {
    const ops::F32MatmulPrecision was = ops::f32_matmul_precision();
    for (ops::F32MatmulPrecision p : {ops::F32MatmulPrecision::Highest, ops::F32MatmulPrecision::High}) {
      ops::set_f32_matmul_precision(p);
      const bool tf32 = !ex.on_cpu() && p == ops::F32MatmulPrecision::High;
      EXPECT_EQ(ops::grouped_gemm_types<float>(ex), tf32 ? GemmTypes::F32Tf32 : GemmTypes::F32);
      EXPECT_EQ(ops::grouped_gemm_types<double>(ex), GemmTypes::F64);
    }
    ops::set_f32_matmul_precision(was);
  }
  const int64_t dims[] = {16, 64, 128};
  for (GemmTypes types : {GemmTypes::F32, GemmTypes::Bf16F32, GemmTypes::F64}) {
    if (ex.on_cpu()) {
      EXPECT_EQ(ops::grouped_gemm_workspace_bytes(ex, 8), 0);
      EXPECT_NE(ops::grouped_gemm_path_line(ex, types, dims).find("CPU"), std::string::npos);
      continue;
    }
    {
      const ScopedPathChoice host(GroupedGemmPathChoice::Host);
      EXPECT_EQ(ops::grouped_gemm_workspace_bytes(ex, 8), 0);
      const std::string line = ops::grouped_gemm_path_line(ex, types, dims);
      EXPECT_NE(line.find("host tables"), std::string::npos) << line;
      EXPECT_NE(line.find("MOECORE_GROUPED_GEMM=host"), std::string::npos) << line;
      EXPECT_EQ(ops::grouped_gemm_path(types, 16, 64), ops::GroupedGemmPath::Host);
    }
    const ScopedPathChoice autop(GroupedGemmPathChoice::Auto);
    const std::string line = ops::grouped_gemm_path_line(ex, types, dims);
    BACKEND_TRACE(line);
    const bool ok = ops::cuda::device_grouped_gemm_supported(types, 16, 64, nullptr);
    EXPECT_EQ(ops::grouped_gemm_path(types, 16, 64),
              ok ? ops::GroupedGemmPath::Device : ops::GroupedGemmPath::Host);
    if (ok) {
      EXPECT_NE(line.find("device tables"), std::string::npos);
      EXPECT_GE(ops::grouped_gemm_workspace_bytes(ex, 8),
                8 * int64_t(sizeof(ops::cuda::GroupedGemmProblem)));
      // A dim no backend aligns: that shape keeps the host tables, and the line names it.
      const int64_t odd[] = {16, 13};
      const std::string mixed = ops::grouped_gemm_path_line(ex, types, odd);
      EXPECT_NE(mixed.find("13"), std::string::npos) << mixed;
      EXPECT_EQ(ops::grouped_gemm_path(types, 16, 13), ops::GroupedGemmPath::Host);
    } else {
      EXPECT_NE(line.find("host tables"), std::string::npos);
    }
  }
}

}  // namespace

void add_grouped_gemm_device_cases(std::vector<OpCase>& out) {
  out.push_back({"grouped_gemm_device_tables",
                 {"grouped_gemm", "grouped_gemm_wgrad", "grouped_gemm_bf16",
                  "grouped_gemm_wgrad_bf16", "grouped_gemm_workspace_bytes"},
                 device_tables_case});
  out.push_back({"grouped_gemm_tables", {"grouped_gemm_tables"}, tables_case});
  out.push_back({"grouped_gemm_path",
                 {"grouped_gemm_workspace_bytes", "grouped_gemm_path_line", "grouped_gemm_types"},
                 path_case});
}

}  // namespace moecore::backend_test
