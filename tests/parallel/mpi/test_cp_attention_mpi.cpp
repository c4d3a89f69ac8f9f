// Context parallelism's attention under mpirun (2 or 4 ranks): cp 2 (and cp 4 on 4 ranks), with
// --cp-comm-type p2p (the ring) and all_gather. Each rank holds its load-balanced 2 C rows of
// the sequence (parallel/context_split.h); the attention core (nn::ContextParallelAttention),
// the SelfAttention layer and the multi-latent attention layer with cp must equal the one-rank
// computation on the gathered sequence on every rank: out, lse, dq, dk, dv of the core; the
// layers' outputs, input gradients and every parameter gradient (summed over cp), in f64 with
// GQA and attention dropout, within docs/numerics.md's "CP attention parity" row.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/mpi_testing.h"
#include "core/arena.h"
#include "model/attention.h"
#include "model/mla_attention.h"
#include "nn/context_parallel_attention.h"
#include "ops/attention.h"
#include "parallel/context_parallel.h"
#include "parallel/context_split.h"
#include "parallel/process_groups.h"

namespace moecore {
namespace {

using parallel::ContextParallel;
using parallel::CpCommType;
using parallel::ProcessGroups;
using testing::random_vec;

// docs/numerics.md, "CP attention parity" (f64).
constexpr double kTol = 1e-12;

parallel::Runtime g_rt;
std::vector<ProcessGroups*> g_layouts;  // cp 2 (and 4)

std::string describe(const ContextParallel& cp) {
  return "cp=" + std::to_string(cp.size()) + " rank=" + std::to_string(cp.rank()) +
         (cp.type() == CpCommType::P2P ? " p2p" : " all_gather");
}

// This rank's rows of a sequence-major [S, row] tensor.
std::vector<double> local_rows(const parallel::ContextSplit& sp, const std::vector<double>& x,
                               int64_t row) {
  std::vector<double> out(sp.local_length() * row);
  parallel::context_split_rows(sp, x.data(), row, out.data());
  return out;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) e = std::max(e, std::abs(a[i] - b[i]));
  return e;
}

void report(const char* what, const ContextParallel& cp, double a, double b) {
  if (cp.rank() == 0)
    std::printf("[cp parity] %s %s: output max diff %.3g, gradients %.3g\n", what,
                describe(cp).c_str(), a, b);
}

// The core: GQA (Hq 4, Hkv 2), chunks of 3 rows (odd: dropout's groups of 4 keys cut across
// chunks), B 2, dropout 0.3 with the heads offset as on a TP rank.
TEST(CpAttention, CoreEqualsOneRank) {
  for (ProcessGroups* g : g_layouts) {
    for (CpCommType type : {CpCommType::P2P, CpCommType::AllGather}) {
      const ContextParallel cp(&g->cp(), type);
      SCOPED_TRACE(describe(cp));
      const int64_t C = 3, S = 2 * cp.size() * C, B = 2, Hq = 4, Hkv = 2, D = 8;
      const ops::AttentionShape whole{S, B, Hq, Hkv, D};
      const int64_t rq = B * Hq * D, rk = B * Hkv * D;
      const auto q = random_vec<double>(S * rq, 1, -2.0, 2.0),
                 k = random_vec<double>(S * rk, 2, -2.0, 2.0);
      const auto v = random_vec<double>(S * rk, 3), dout = random_vec<double>(S * rq, 4);
      const ops::DropoutCounters counters{5, 2};
      const ops::AttentionDropout drop{0.3, 77, &counters, 4};
      // The one-rank attention (the CPU fast path) of the whole sequence.
      std::vector<double> out(S * rq), lse(B * Hq * S), dq(S * rq), dk(S * rk), dv(S * rk);
      std::vector<double> ws(ops::attention_workspace_elems(whole, omp_get_max_threads()));
      ops::attention_forward<double>(cpu_exec(), out.data(), lse.data(), q.data(), k.data(),
                                     v.data(), whole, ws.data(), &drop);
      ops::attention_backward<double>(cpu_exec(), dq.data(), dk.data(), dv.data(), dout.data(),
                                      q.data(), k.data(), v.data(), out.data(), lse.data(), whole,
                                      ws.data(), &drop);
      const parallel::ContextSplit sp = cp.split(S);
      const int64_t L = sp.local_length();
      const auto q_l = local_rows(sp, q, rq), k_l = local_rows(sp, k, rk),
                 v_l = local_rows(sp, v, rk), dout_l = local_rows(sp, dout, rq);
      nn::ContextParallelAttention<double> cpa(cp);
      Arena arena;
      arena.plan([&](Arena& a) { cpa.allocate(a, ops::AttentionShape{L, B, Hq, Hkv, D}); });
      std::vector<double> out_l(L * rq), lse_l(B * Hq * L), dq_l(L * rq), dk_l(L * rk),
          dv_l(L * rk);
      cpa.forward(out_l.data(), lse_l.data(), q_l.data(), k_l.data(), v_l.data(), &drop);
      cpa.backward(dq_l.data(), dk_l.data(), dv_l.data(), dout_l.data(), q_l.data(), k_l.data(),
                   v_l.data(), out_l.data(), lse_l.data(), &drop);
      // lse [B, Hq, S] -> this rank's [B, Hq, 2C].
      std::vector<double> lse_want(B * Hq * L);
      for (int64_t bh = 0; bh < B * Hq; ++bh)
        for (int64_t s = 0; s < L; ++s) lse_want[bh * L + s] = lse[bh * S + sp.global_position(s)];
      const double e_out = std::max(max_diff(out_l, local_rows(sp, out, rq)),
                                    max_diff(lse_l, lse_want));
      const double e_grad = std::max({max_diff(dq_l, local_rows(sp, dq, rq)),
                                      max_diff(dk_l, local_rows(sp, dk, rk)),
                                      max_diff(dv_l, local_rows(sp, dv, rk))});
      EXPECT_LE(e_out, kTol) << "out / lse";
      EXPECT_LE(e_grad, kTol) << "dq / dk / dv";
      report("core attention", cp, e_out, e_grad);
    }
  }
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  using namespace moecore;
  using namespace moecore::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  g_rt = runtime_init(&argc, &argv);
  moecore::testing::quiet_gtest_on_other_ranks(g_rt.rank);
  int rc = 0;
  {
    std::vector<std::unique_ptr<ProcessGroups>> groups;
    for (int cp : {2, 4}) {
      if (cp > g_rt.world_size || g_rt.world_size % cp != 0) continue;
      ParallelConfig c;
      c.cp = cp;
      c.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic
      groups.push_back(std::make_unique<ProcessGroups>(make_layout(c, g_rt.world_size), g_rt.rank));
      connect_communicators(*groups.back());
      g_layouts.push_back(groups.back().get());
    }
    rc = RUN_ALL_TESTS();
    if (!groups.empty())
      rc = moecore::testing::any_rank_failed(rc, groups.front()->world().communicator());
    rc = moecore::testing::report_skips(rc, g_rt.rank, g_rt.world_size);
    g_layouts.clear();
  }
  runtime_finalize();
  return rc;
}
