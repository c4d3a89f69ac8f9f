// The GEMM library calls of the emulated CUDA build (tests/emu/blas_emu.cpp: ops/cuda/blas.h's
// run_matmul and run_grouped_batched over the plain-loop interpreters) from the project's
// row-major arguments: call -> descriptor (ops/desc/) -> run_matmul / run_grouped_batched, whose
// argument plumbing (slots, scalars, pointer tables: ops/desc/blas_args.h) is the cuBLASLt
// backend's own, against gemm_ref, gemm_bf16_ref and the grouped refs, bitwise over whole
// buffers. Small-integer operands make every sum exact, so only a wrong index, slot, stride,
// offset or scalar changes a bit. Awkward shapes: every transpose, leading dimensions wider than
// the rows, batch strides with gaps, one row, one column, K = 1, non-trivial alpha and beta,
// experts with zero rows.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/exec.h"
#include "ops/cuda/blas.h"
#include "ops/desc/gemm_desc.h"
#include "ops/desc/grouped_gemm_desc.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {
namespace {

using desc::GemmCall;
using desc::GemmTypes;

const Exec& emu_exec() {
  static const Exec ex{Device::CUDA, nullptr};
  return ex;
}

template <typename T>
std::vector<T> small_ints(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-8, 8);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, bf16>)
      x = float_to_bf16(static_cast<float>(u(rng)));
    else
      x = static_cast<T>(u(rng));
  }
  return v;
}

template <typename T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << "element " << i << " of " << got.size() << ": got " << got[i] << " want " << want[i];
}

// One row-major call (padded rows, gaps between batch items) through gemm_desc and run_matmul
// against gemm_ref / gemm_bf16_ref per batch item. In is the operand type, Out C's.
template <typename In, typename Out>
void check_matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t pad, int64_t batch,
                  double alpha, double beta, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K
               << " pad=" << pad << " batch=" << batch << " alpha=" << alpha << " beta=" << beta);
  constexpr bool kBf16 = std::is_same_v<In, bf16>;
  GemmCall call;
  call.types =
      kBf16 ? GemmTypes::Bf16F32 : (std::is_same_v<In, double> ? GemmTypes::F64 : GemmTypes::F32);
  call.trans_a = ta;
  call.trans_b = tb;
  call.M = M;
  call.N = N;
  call.K = K;
  call.lda = (ta ? M : K) + pad;
  call.ldb = (tb ? K : N) + pad;
  call.ldc = N + pad;
  call.batch = batch;
  call.stride_a = (ta ? K : M) * call.lda + 3;
  call.stride_b = (tb ? N : K) * call.ldb + 5;
  call.stride_c = M * call.ldc + 2;
  call.alpha = alpha;
  call.beta = beta;
  const auto A = small_ints<In>(call.stride_a * batch, seed);
  const auto B = small_ints<In>(call.stride_b * batch, seed + 1);
  auto want = small_ints<Out>(call.stride_c * batch, seed + 2);
  auto got = want;
  for (int64_t b = 0; b < batch; ++b) {
    const In* a = A.data() + b * call.stride_a;
    const In* bb = B.data() + b * call.stride_b;
    Out* c = want.data() + b * call.stride_c;
    if constexpr (kBf16) {
      ASSERT_EQ(alpha, 1.0) << "gemm_bf16 has no alpha";
      gemm_bf16_ref(ta, tb, M, N, K, a, call.lda, bb, call.ldb, static_cast<float>(beta), c,
                    call.ldc);
    } else {
      gemm_ref<Out>(ta, tb, M, N, K, Out(alpha), a, call.lda, bb, call.ldb, Out(beta), c, call.ldc);
    }
  }
  cuda::run_matmul(emu_exec(), desc::gemm_desc(call), A.data(), B.data(), got.data(),
                   cuda::blas_handles(emu_exec()));
  expect_bitwise(got, want);
}

TEST(EmuBlas, MatmulF32) {
  uint32_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_matmul<float, float>(ta, tb, 7, 5, 3, 0, 1, 1.0, 0.0, seed += 3);
      check_matmul<float, float>(ta, tb, 13, 7, 29, 3, 1, 0.5, -1.5, seed += 3);
      check_matmul<float, float>(ta, tb, 1, 13, 6, 2, 1, 1.0, 1.0, seed += 3);  // one row
      check_matmul<float, float>(ta, tb, 9, 1, 1, 1, 1, -2.0, 0.0, seed += 3);  // one column, K 1
    }
}

TEST(EmuBlas, MatmulF64) {
  uint32_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_matmul<double, double>(ta, tb, 5, 7, 4, 3, 1, 0.25, 1.0, seed += 3);
      check_matmul<double, double>(ta, tb, 1, 3, 2, 0, 1, 1.0, 0.0, seed += 3);
    }
}

TEST(EmuBlas, MatmulBf16InF32Out) {
  uint32_t seed = 200;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (double beta : {0.0, 1.0}) {
        check_matmul<bf16, float>(ta, tb, 6, 5, 9, 2, 1, 1.0, beta, seed += 3);
        check_matmul<bf16, float>(ta, tb, 1, 11, 1, 0, 1, 1.0, beta, seed += 3);
      }
}

TEST(EmuBlas, MatmulStridedBatched) {
  uint32_t seed = 300;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_matmul<float, float>(ta, tb, 4, 6, 11, 3, 4, -1.0, 0.25, seed += 3);
      check_matmul<double, double>(ta, tb, 3, 2, 5, 1, 3, 2.0, 1.0, seed += 3);
      check_matmul<bf16, float>(ta, tb, 5, 3, 7, 2, 2, 1.0, 1.0, seed += 3);
    }
}

TEST(EmuBlas, EmptyMatmulWritesNothing) {
  for (int64_t batch : {0, 2}) {
    GemmCall call{GemmTypes::F32, false, false, batch == 0 ? 3 : 0, 4, 5, 5, 4, 4};
    call.batch = batch;
    std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 7.0f);
    cuda::run_matmul(emu_exec(), desc::gemm_desc(call), a.data(), b.data(), c.data(),
                     cuda::blas_handles(emu_exec()));
    expect_bitwise(c, std::vector<float>(64, 7.0f));
  }
}

// Padded dispatch: one strided-batched matmul per phase == the grouped refs, every expert at
// `cap` rows.
TEST(EmuBlas, PaddedGroupedAsStridedBatched) {
  uint32_t seed = 400;
  for (bool trans_w : {false, true})
    for (int64_t cap : {1, 3}) {
      const int64_t G = 3, N = 5, K = 7;
      SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w << " cap=" << cap);
      const std::vector<int64_t> m_G(G, cap);
      const auto x = small_ints<float>(G * cap * K, seed++);
      const auto w = small_ints<float>(G * N * K, seed++);
      const auto dy = small_ints<float>(G * cap * N, seed++);
      auto& blas = cuda::blas_handles(emu_exec());
      auto want = small_ints<float>(G * cap * N, seed++), got = want;
      grouped_gemm_ref<float>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, want.data());
      cuda::run_matmul(
          emu_exec(),
          desc::gemm_desc(desc::padded_grouped_forward_call(GemmTypes::F32, G, cap, N, K, trans_w)),
          x.data(), w.data(), got.data(), blas);
      expect_bitwise(got, want);
      auto want_dx = small_ints<float>(G * cap * K, seed++), got_dx = want_dx;
      grouped_gemm_ref<float>(m_G.data(), G, K, N, dy.data(), w.data(), !trans_w, want_dx.data());
      cuda::run_matmul(emu_exec(),
                       desc::gemm_desc(desc::padded_grouped_forward_call(GemmTypes::F32, G, cap, K,
                                                                         N, !trans_w)),
                       dy.data(), w.data(), got_dx.data(), blas);
      expect_bitwise(got_dx, want_dx);
      auto want_dw = small_ints<float>(G * N * K, seed++), got_dw = want_dw;
      grouped_gemm_wgrad_ref<float>(m_G.data(), G, N, K, dy.data(), x.data(), want_dw.data());
      cuda::run_matmul(
          emu_exec(),
          desc::gemm_desc(desc::padded_grouped_wgrad_call(GemmTypes::F32, G, cap, N, K)), dy.data(),
          x.data(), got_dw.data(), blas);
      expect_bitwise(got_dw, want_dw);
    }
}

// Dropless: cublasGemmGroupedBatchedEx from the descriptor's tables == the grouped refs (f32,
// f64), zero-row experts included (they write and add nothing).
template <typename T>
void check_grouped_batched(const std::vector<int64_t>& m_G, bool trans_w, uint32_t seed) {
  const int64_t G = static_cast<int64_t>(m_G.size()), N = 6, K = 4;
  int64_t rows = 0;
  for (int64_t m : m_G) rows += m;
  SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w << " G=" << G << " rows=" << rows);
  const GemmTypes types = std::is_same_v<T, double> ? GemmTypes::F64 : GemmTypes::F32;
  auto& blas = cuda::blas_handles(emu_exec());
  const auto x = small_ints<T>(rows * K, seed++);
  const auto w = small_ints<T>(G * N * K, seed++);
  const auto dy = small_ints<T>(rows * N, seed++);
  auto want = small_ints<T>(rows * N, seed++), got = want;
  grouped_gemm_ref<T>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, want.data());
  cuda::run_grouped_batched(emu_exec(),
                            desc::grouped_batched_forward(types, m_G.data(), G, N, K, trans_w),
                            x.data(), w.data(), got.data(), blas);
  expect_bitwise(got, want);
  auto want_dx = small_ints<T>(rows * K, seed++), got_dx = want_dx;
  grouped_gemm_ref<T>(m_G.data(), G, K, N, dy.data(), w.data(), !trans_w, want_dx.data());
  cuda::run_grouped_batched(emu_exec(),
                            desc::grouped_batched_forward(types, m_G.data(), G, K, N, !trans_w),
                            dy.data(), w.data(), got_dx.data(), blas);
  expect_bitwise(got_dx, want_dx);
  auto want_dw = small_ints<T>(G * N * K, seed++), got_dw = want_dw;
  grouped_gemm_wgrad_ref<T>(m_G.data(), G, N, K, dy.data(), x.data(), want_dw.data());
  cuda::run_grouped_batched(emu_exec(), desc::grouped_batched_wgrad(types, m_G.data(), G, N, K),
                            dy.data(), x.data(), got_dw.data(), blas);
  expect_bitwise(got_dw, want_dw);
}

TEST(EmuBlas, GroupedBatched) {
  const std::vector<std::vector<int64_t>> loads = {
      {3, 0, 5, 1}, {0, 0, 2, 0}, {1}, {0, 0, 0}, {6, 1, 0, 0, 2}};
  uint32_t seed = 500;
  for (bool trans_w : {false, true})
    for (const auto& m_G : loads) {
      check_grouped_batched<float>(m_G, trans_w, seed += 10);
      check_grouped_batched<double>(m_G, trans_w, seed += 10);
    }
}

// bf16 operands, f32 output: the forward against gemm_bf16_ref per expert.
TEST(EmuBlas, GroupedBatchedBf16InF32Out) {
  const std::vector<int64_t> m_G = {2, 0, 3, 1};
  const int64_t G = 4, N = 5, K = 3, rows = 6;
  uint32_t seed = 700;
  for (bool trans_w : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w);
    const auto x = small_ints<bf16>(rows * K, seed++);
    const auto w = small_ints<bf16>(G * N * K, seed++);
    auto want = small_ints<float>(rows * N, seed++), got = want;
    for (int64_t g = 0, row0 = 0; g < G; row0 += m_G[g], ++g)
      gemm_bf16_ref(false, trans_w, m_G[g], N, K, x.data() + row0 * K, K, w.data() + g * N * K,
                    trans_w ? K : N, 0.0f, want.data() + row0 * N, N);
    cuda::run_grouped_batched(
        emu_exec(), desc::grouped_batched_forward(GemmTypes::Bf16F32, m_G.data(), G, N, K, trans_w),
        x.data(), w.data(), got.data(), cuda::blas_handles(emu_exec()));
    expect_bitwise(got, want);
  }
}

}  // namespace
}  // namespace moecore::ops
