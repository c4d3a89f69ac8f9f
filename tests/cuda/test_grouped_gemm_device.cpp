// The device-table grouped GEMM on a GPU (ops/cuda/grouped_gemm_device.h; the CUDA build's
// CUTLASS sm_90a backend) against a plain-loop host reference: the MoE layer's forms (forward
// with w [G,N,K] and [G,K,N], dgrad, wgrad accumulating and assigning), experts without tokens
// (m = 0 in the forward, k = 0 in the wgrad: D stays beta D), uneven sizes with K and N tails,
// more problems than a warp scans at once, an all-empty table, the bitwise repeat, and the call
// captured in a CUDA graph. The table is written on the stream before the call, as the MoE
// layer's table kernel does. Every D element no problem covers is checked untouched (bitwise).
// Built in the CUDA configuration only; skipped where device_grouped_gemm_supported says no
// (no GPU, not sm_90), with its reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/exec.h"
#include "ops/cuda/grouped_gemm_device.h"

namespace moecore::ops::cuda {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

// One problem over the flat host arrays A, B, D (element offsets).
struct Problem {
  int32_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int64_t a_off = 0, b_off = 0, d_off = 0;
};

struct Operands {
  std::vector<bf16> a, b;
  std::vector<float> d0;  // D before the call
};

// The reference: double sums of the bf16 values (exact for the products), D = sum + beta D0,
// and each element's error bound for f32 accumulation in any order, rounding faithfully:
// (k + 1) * 2^-23 * (sum |a b| + |beta D0|).
void reference(const std::vector<Problem>& ps, const Operands& o, float beta, std::vector<float>* d,
               std::vector<double>* tol, std::vector<char>* covered) {
  *d = o.d0;
  tol->assign(o.d0.size(), 0.0);
  covered->assign(o.d0.size(), 0);
  for (const Problem& p : ps) {
    for (int32_t i = 0; i < p.m; ++i) {
      for (int32_t j = 0; j < p.n; ++j) {
        double sum = 0, abs_sum = 0;
        for (int32_t l = 0; l < p.k; ++l) {
          const int64_t ai = p.a_off + (p.trans_a ? l * p.lda + i : i * p.lda + l);
          const int64_t bi = p.b_off + (p.trans_b ? j * p.ldb + l : l * p.ldb + j);
          const double prod =
              double(bf16_to_float(o.a[size_t(ai)])) * double(bf16_to_float(o.b[size_t(bi)]));
          sum += prod;
          abs_sum += std::fabs(prod);
        }
        const size_t di = size_t(p.d_off + i * p.ldd + j);
        const double c = beta == 0.f ? 0.0 : double(beta) * double(o.d0[di]);
        (*d)[di] = float(sum + c);
        (*tol)[di] = double(p.k + 1) * std::ldexp(1.0, -23) * (abs_sum + std::fabs(c));
        (*covered)[di] = 1;
      }
    }
  }
}

template <typename T>
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t count) : bytes(count * sizeof(T)) {
    EXPECT_EQ(cudaMalloc(&p, bytes > 0 ? bytes : 1), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  T* get() const { return static_cast<T*>(p); }
};

// The device table of the problems over device operands a, b and D (elements of d_bytes).
std::vector<GroupedGemmProblem> table_of(const std::vector<Problem>& ps, const bf16* a,
                                         const bf16* b, void* d, size_t d_bytes) {
  std::vector<GroupedGemmProblem> table(ps.size());
  for (size_t g = 0; g < ps.size(); ++g) {
    const Problem& p = ps[g];
    GroupedGemmProblem& t = table[g];
    t.m = p.m;
    t.n = p.n;
    t.k = p.k;
    t.trans_a = p.trans_a;
    t.trans_b = p.trans_b;
    t.lda = p.lda;
    t.ldb = p.ldb;
    t.ldd = p.ldd;
    t.a = a + p.a_off;
    t.b = b + p.b_off;
    t.d = static_cast<char*>(d) + p.d_off * int64_t(d_bytes);
  }
  return table;
}

// Uploads the operands and D's initial values d0 (elements of D: float for Bf16F32, bf16 bits
// for Bf16Bf16), writes the device table on `stream`, runs the call of `types` (captured in a
// graph when `graph`), and returns D. The workspace starts ws_offset bytes into its allocation (a
// multiple of 64 that no allocation starts at: an address no earlier call used).
template <typename D>
std::vector<D> run_types_on_device(desc::GemmTypes types, const std::vector<Problem>& ps,
                                   const Operands& o, const std::vector<D>& d0, float beta,
                                   cudaStream_t stream, bool graph, size_t ws_offset = 0) {
  DeviceBuffer<bf16> a(o.a.size()), b(o.b.size());
  DeviceBuffer<D> d(d0.size());
  EXPECT_EQ(cudaMemcpy(a.p, o.a.data(), a.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(b.p, o.b.data(), b.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d.p, d0.data(), d.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  const std::vector<GroupedGemmProblem> table = table_of(ps, a.get(), b.get(), d.p, sizeof(D));
  const int64_t G = static_cast<int64_t>(ps.size());
  DeviceBuffer<GroupedGemmProblem> dtable(table.size());
  const size_t ws_bytes = device_grouped_gemm_workspace_bytes(G);
  DeviceBuffer<char> ws(ws_bytes + ws_offset);
  void* workspace = ws.get() + ws_offset;
  const Exec ex{Device::CUDA, stream};
  const auto call = [&] {
    device_grouped_gemm(ex, types, dtable.get(), G, beta, workspace, ws_bytes);
  };
  if (graph) {
    // The table is in place before the capture (a copy from pageable memory is not capturable);
    // the graph holds the call: the table kernel and the GEMM.
    EXPECT_EQ(cudaMemcpy(dtable.p, table.data(), dtable.bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    call();
    EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  } else {
    EXPECT_EQ(cudaMemcpyAsync(dtable.p, table.data(), dtable.bytes, cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    call();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  std::vector<D> out(d0.size());
  EXPECT_EQ(cudaMemcpy(out.data(), d.p, d.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// The f32 D's call (Bf16F32) from the operands' d0.
std::vector<float> run_on_device(const std::vector<Problem>& ps, const Operands& o, float beta,
                                 cudaStream_t stream, bool graph, size_t ws_offset = 0) {
  return run_types_on_device(desc::GemmTypes::Bf16F32, ps, o, o.d0, beta, stream, graph,
                             ws_offset);
}

// Values on a grid of 1/2 in [-4, 4]: every product and partial sum of a test is exact in f32,
// so the device must equal the reference bitwise. `real`: full-mantissa bf16 values in [-1, 1].
bf16 value(std::mt19937& rng, bool real) {
  if (real) return float_to_bf16(std::uniform_real_distribution<float>(-1.f, 1.f)(rng));
  return float_to_bf16(0.5f * float(std::uniform_int_distribution<int>(-8, 8)(rng)));
}

// The MoE layer's tables over G experts with m_G rows each (x stacked [T,K], w per expert):
//   forward:  y_g [m_g,N] = x_g [m_g,K] w_g^T (w [G,N,K], trans_w) or x_g w_g (w [G,K,N])
//   dgrad:    dx_g [m_g,K] = dy_g [m_g,N] w_g (w [G,N,K]) or dy_g w_g^T (w [G,K,N])
//   wgrad:    dw_g [N,K] = dy_g^T [N,m_g] x_g [m_g,K] (beta 1 accumulates)
// D gets `guard` rows after its last used row (checked untouched).
enum class Kind { Forward, Dgrad, Wgrad };
struct Layer {
  std::vector<Problem> problems;
  Operands operands;
};
Layer moe_layer(Kind kind, const std::vector<int32_t>& m_G, int32_t N, int32_t K, bool trans_w,
                bool real, uint32_t seed) {
  const int64_t G = static_cast<int64_t>(m_G.size());
  int64_t T = 0;
  for (int32_t m : m_G) T += m;
  const int64_t guard = 3;
  Layer l;
  std::mt19937 rng(seed);
  int64_t a_elems = 0, b_elems = 0, d_elems = 0;
  if (kind == Kind::Forward) {
    a_elems = T * K, b_elems = G * N * K, d_elems = (T + guard) * N;
  } else if (kind == Kind::Dgrad) {  // A = dy [T,N], B = w, D = dx [T,K]
    a_elems = T * N, b_elems = G * N * K, d_elems = (T + guard) * K;
  } else {  // A = dy [T,N], B = x [T,K], D = dw [G,N,K]
    a_elems = T * N, b_elems = T * K, d_elems = (G * N + guard) * K;
  }
  for (int64_t i = 0; i < a_elems; ++i) l.operands.a.push_back(value(rng, real));
  for (int64_t i = 0; i < b_elems; ++i) l.operands.b.push_back(value(rng, real));
  for (int64_t i = 0; i < d_elems; ++i) {
    // D0 on a grid of 1/4 (exact under beta 1), NaN-free so that "untouched" compares bitwise.
    l.operands.d0.push_back(0.25f * float(std::uniform_int_distribution<int>(-40, 40)(rng)));
  }
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int32_t rows = m_G[size_t(g)];
    Problem p;
    if (kind == Kind::Forward) {
      p.m = rows, p.n = N, p.k = K;
      p.trans_b = trans_w;  // w_g stored [N,K] read transposed, or [K,N]
      p.lda = K, p.ldb = trans_w ? K : N, p.ldd = N;
      p.a_off = row0 * K, p.b_off = g * N * K, p.d_off = row0 * N;
    } else if (kind == Kind::Dgrad) {
      p.m = rows, p.n = K, p.k = N;
      p.trans_b = !trans_w;  // w_g [N,K] is B stored [k=N, n=K]; w_g [K,N] is B stored [n,k]
      p.lda = N, p.ldb = trans_w ? K : N, p.ldd = K;
      p.a_off = row0 * N, p.b_off = g * N * K, p.d_off = row0 * K;
    } else {
      p.m = N, p.n = K, p.k = rows;
      p.trans_a = true;  // dy_g stored [m_g, N]
      p.lda = N, p.ldb = K, p.ldd = K;
      p.a_off = row0 * N, p.b_off = row0 * K, p.d_off = g * N * K;
    }
    l.problems.push_back(p);
    row0 += rows;
  }
  return l;
}

class DeviceGroupedGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_grouped_gemm_supported(desc::GemmTypes::Bf16F32, 8, 8, &why)) GTEST_SKIP() << why;
    ex_ = make_exec(Device::CUDA);
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(ex_.stream); }

  // Runs `l` and checks D: bitwise the reference when `exact`, else within each element's
  // bound; every element no problem covers bitwise untouched.
  void check(const Layer& l, float beta, bool exact, bool graph = false) {
    std::vector<float> want;
    std::vector<double> tol;
    std::vector<char> covered;
    reference(l.problems, l.operands, beta, &want, &tol, &covered);
    const std::vector<float> got = run_on_device(l.problems, l.operands, beta, stream(), graph);
    ASSERT_EQ(got.size(), want.size());
    int64_t bad = 0;
    for (size_t i = 0; i < got.size() && bad < 10; ++i) {
      const bool ok = covered[i] && !exact ? std::fabs(double(got[i]) - double(want[i])) <= tol[i]
                                           : std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
      if (!ok) {
        ++bad;
        ADD_FAILURE() << "D[" << i << "] = " << got[i] << ", want " << want[i]
                      << (covered[i] ? "" : " (no problem covers it: must stay D0)")
                      << " tolerance " << tol[i];
      }
    }
  }
  Exec ex_;
};

const std::vector<int32_t> kUneven = {0, 1, 130, 0, 7, 257, 64, 0, 33};

TEST_F(DeviceGroupedGemm, SupportNamesWhatIsMissing) {
  std::string why;
  EXPECT_FALSE(device_grouped_gemm_supported(desc::GemmTypes::F32, 64, 64, &why));
  EXPECT_NE(why.find("bf16"), std::string::npos) << why;
  EXPECT_TRUE(device_grouped_gemm_supported(desc::GemmTypes::Bf16Bf16, 200, 136, &why));
  EXPECT_FALSE(device_grouped_gemm_supported(desc::GemmTypes::Bf16Bf16, 200, 132, &why));
  // TF32 (--fp32-matmul-precision high): no kernel (wgmma's TF32 operands are K-major only and
  // the MoE layer's dgrad and wgrad have MN-major ones), so the f32 grouped GEMMs keep the host
  // tables, with TF32 (docs/gpu.md, "No TF32 kernel").
  EXPECT_FALSE(device_grouped_gemm_supported(desc::GemmTypes::F32Tf32, 64, 64, &why));
  EXPECT_NE(why.find("TF32"), std::string::npos) << why;
  EXPECT_FALSE(device_grouped_gemm_supported(desc::GemmTypes::Bf16F32, 64, 36, &why));
  EXPECT_NE(why.find("K=36"), std::string::npos) << why;
  EXPECT_TRUE(device_grouped_gemm_supported(desc::GemmTypes::Bf16F32, 200, 136, &why));
}

TEST_F(DeviceGroupedGemm, ForwardBothWeightLayoutsWithEmptyExperts) {
  for (bool trans_w : {true, false}) {
    SCOPED_TRACE(trans_w ? "w [G,N,K]" : "w [G,K,N]");
    check(moe_layer(Kind::Forward, kUneven, 200, 136, trans_w, false, 1), 0.f, true);
  }
}

TEST_F(DeviceGroupedGemm, DgradBothWeightLayouts) {
  for (bool trans_w : {true, false}) {
    SCOPED_TRACE(trans_w ? "w [G,N,K]" : "w [G,K,N]");
    check(moe_layer(Kind::Dgrad, kUneven, 200, 136, trans_w, false, 2), 0.f, true);
  }
}

TEST_F(DeviceGroupedGemm, WgradAccumulatesAndExpertsWithoutTokensKeepBetaD) {
  // k = 0 for the experts without rows: beta 1 leaves dw_g as it was, beta 0 zeroes it.
  for (float beta : {1.f, 0.f}) {
    SCOPED_TRACE("beta " + std::to_string(beta));
    check(moe_layer(Kind::Wgrad, kUneven, 200, 136, false, false, 3), beta, true);
  }
}

TEST_F(DeviceGroupedGemm, RealValuesWithinTheAccumulationBound) {
  check(moe_layer(Kind::Forward, kUneven, 200, 136, true, true, 4), 0.f, false);
  check(moe_layer(Kind::Dgrad, kUneven, 200, 136, false, true, 5), 0.f, false);
  check(moe_layer(Kind::Wgrad, kUneven, 200, 136, false, true, 6), 1.f, false);
}

TEST_F(DeviceGroupedGemm, ManyMostlyEmptyProblemsAndAnEmptyTable) {
  // 300 experts (the tile scheduler scans 32 problems a step), most without tokens.
  std::vector<int32_t> m_G(300, 0);
  m_G[5] = 17, m_G[40] = 130, m_G[263] = 1, m_G[299] = 64;
  check(moe_layer(Kind::Forward, m_G, 64, 72, true, false, 7), 0.f, true);
  check(moe_layer(Kind::Wgrad, m_G, 64, 72, false, false, 8), 1.f, true);
  // Nothing to compute anywhere (an EP rank whose experts got no token): D stays as it was.
  check(moe_layer(Kind::Forward, {0, 0, 0, 0}, 64, 72, true, false, 9), 0.f, true);
  check(moe_layer(Kind::Wgrad, {0, 0, 0}, 64, 72, false, false, 10), 1.f, true);
}

// The bf16 D (fc1's h under --bf16): the same mainloop and tiles as the f32 D, so on full-mantissa
// values each element is the f32 D's rounded to nearest even, bitwise; the forward's forms (both
// weight layouts, and the dgrad's), empty experts; what no problem covers keeps its bits.
TEST_F(DeviceGroupedGemm, Bf16OutputIsTheF32OutputRoundedOnce) {
  std::string why;
  ASSERT_TRUE(device_grouped_gemm_supported(desc::GemmTypes::Bf16Bf16, 200, 136, &why)) << why;
  const uint16_t fill = 0x7fc1;  // a NaN no result has
  uint32_t seed = 40;
  for (Kind kind : {Kind::Forward, Kind::Dgrad})
    for (bool trans_w : {true, false}) {
      SCOPED_TRACE(std::string(kind == Kind::Forward ? "forward" : "dgrad") +
                   (trans_w ? ", w [G,N,K]" : ", w [G,K,N]"));
      const Layer l = moe_layer(kind, kUneven, 200, 136, trans_w, true, seed++);
      std::vector<float> want;
      std::vector<double> tol;
      std::vector<char> covered;
      reference(l.problems, l.operands, 0.f, &want, &tol, &covered);
      const std::vector<float> f32 = run_on_device(l.problems, l.operands, 0.f, stream(), false);
      const std::vector<uint16_t> got =
          run_types_on_device(desc::GemmTypes::Bf16Bf16, l.problems, l.operands,
                              std::vector<uint16_t>(l.operands.d0.size(), fill), 0.f, stream(),
                              false);
      int64_t bad = 0;
      for (size_t i = 0; i < got.size() && bad < 10; ++i) {
        const uint16_t expect = covered[i] ? float_to_bf16(f32[i]).bits : fill;
        if (got[i] != expect) {
          ++bad;
          ADD_FAILURE() << "D[" << i << "] bits " << got[i] << ", want " << expect
                        << (covered[i] ? " (the f32 D rounded)" : " (no problem covers it)");
        }
      }
    }
}

TEST_F(DeviceGroupedGemm, NoProblemsIsNoWork) {
  device_grouped_gemm(ex_, desc::GemmTypes::Bf16F32, nullptr, 0, 0.f, nullptr, 0);
  CUDA_OK(cudaStreamSynchronize(stream()));
}

TEST_F(DeviceGroupedGemm, BitwiseRunToRunAndCapturedInAGraph) {
  const Layer l = moe_layer(Kind::Forward, kUneven, 200, 136, true, true, 11);
  const std::vector<float> first = run_on_device(l.problems, l.operands, 0.f, stream(), false);
  const std::vector<float> second = run_on_device(l.problems, l.operands, 0.f, stream(), false);
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // A workspace address no call has used: the call's parameters are built during the capture.
  const std::vector<float> captured = run_on_device(l.problems, l.operands, 0.f, s, true, 64);
  CUDA_OK(cudaStreamDestroy(s));
  EXPECT_EQ(std::memcmp(first.data(), captured.data(), first.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace moecore::ops::cuda
