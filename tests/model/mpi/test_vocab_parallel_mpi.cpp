// The vocab-parallel embedding, output head and cross entropy (model/vocab_parallel.h) over a
// real TP group of 2 and 4 ranks, with and without sequence parallelism, against one rank's
// fused ops on the whole vocabulary: the loss (the same on every TP rank), the input gradient
// of this rank's tokens and the weight gradient of this rank's vocabulary rows. Awkward sizes:
// a ragged last chunk of tokens, vocabulary rows per rank not a multiple of the chunk, ignored
// targets, targets on every rank's slice. A padded vocabulary (19 tokens in 28 rows: at TP 4 one
// rank's slice is padding only, another's partly) against the one-rank head of the 19 tokens:
// the padding joins no softmax and gets no gradient. And GPTModel at TP 2 without SP (dense
// blocks) vs one rank: the loss and the embedding / head gradients of each rank's vocabulary
// rows, also with a padded vocabulary whose second slice is padding only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/bf16_gemm_paths.h"
#include "common/mpi_testing.h"
#include "common/tolerances.h"
#include "core/exec.h"
#include "model/gpt_model.h"
#include "model/vocab_parallel.h"
#include "ops/cross_entropy.h"
#include "ops/cast.h"
#include "ops/embedding.h"
#include "ops/gemm_bf16.h"
#include "parallel/communicator.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "parallel/rank_generator.h"
#include "parallel/tensor_parallel.h"

namespace moecore {
namespace {

using parallel::ParallelConfig;
using namespace testing;
using parallel::ProcessGroups;
using parallel::TensorParallel;

parallel::Runtime g_rt;

template <typename T>
std::vector<T> randn(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(gen));
  return v;
}

// The groups of a TP layout over the world (TP x DP), connected.
struct TpGroups {
  ProcessGroups groups;
  TpGroups(int tp, bool sp) : groups(layout(tp, sp), g_rt.rank) {
    parallel::connect_communicators(groups);
  }
  static parallel::Layout layout(int tp, bool sp) {
    ParallelConfig cfg;
    cfg.tp = tp;
    cfg.sequence_parallel = sp;
    cfg.timeout_minutes = 1.0;
    return parallel::make_layout(cfg, g_rt.world_size);
  }
};

// Every TP size that divides the world, with and without SP.
template <typename F>
void for_each_tp_layout(F&& f) {
  for (int tp : {2, 4}) {
    if (g_rt.world_size % tp != 0) continue;
    for (bool sp : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "tp " << tp << (sp ? " with SP" : " without SP"));
      TpGroups g(tp, sp);
      f(TensorParallel::attention(&g.groups), tp);
    }
  }
}

template <typename T>
void expect_close(const T* got, const T* want, int64_t n, double rtol, double atol,
                  const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], rtol * std::abs(double(want[i])) + atol)
        << what << " [" << i << "]";
  }
}

// Vp = V: no padding; Vp > V: the rows past V are padding (zeros in the table, as the model
// keeps them), which must change nothing.
template <typename T>
void head_loss_matches_one_rank(double rtol, double atol, int64_t V, int64_t Vp) {
  SCOPED_TRACE(::testing::Message() << "V " << V << " in " << Vp << " rows");
  const Exec& ex = cpu_exec();
  // n = 12 tokens in chunks of 5 (a ragged last chunk); Vp = 28: 14 or 7 rows per rank.
  const int64_t n = 12, H = 6, chunk = 5;
  const std::vector<T> h = randn<T>(n * H, 1);
  std::vector<T> w = randn<T>(Vp * H, 2, 0.7);
  std::fill(w.begin() + V * H, w.end(), T(0));
  std::vector<int32_t> tg(n);
  for (int64_t t = 0; t < n; ++t) tg[t] = int32_t((t * 5 + 2) % V);  // every slice gets targets
  tg[3] = -1;
  tg[10] = -1;
  tg[0] = 0;
  tg[1] = int32_t(V - 1);
  const ops::HeadLossShape s{n, H, V, chunk};
  // One rank, the fused head on the whole vocabulary.
  std::vector<T> loss1(n), lse1(n), ws1(ops::head_loss_workspace_elems(s)), dh1(n * H),
      dw1(V * H, T(0));
  double sum1 = 0;
  ops::head_loss_forward<T>(ex, &sum1, loss1.data(), lse1.data(), h.data(), w.data(), tg.data(), s,
                            ws1.data());
  const T dloss = T(1.0 / 7.0);
  ops::head_loss_backward<T>(ex, dh1.data(), dw1.data(), h.data(), w.data(), tg.data(), lse1.data(),
                             &dloss, s, ws1.data());

  for_each_tp_layout([&](const TensorParallel& tp, int tp_size) {
    ASSERT_EQ(tp.size(), tp_size);
    const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
    const int64_t Vl = tp.share(Vp), v0 = tp.share_offset(Vp);
    const int64_t model = std::clamp<int64_t>(V - v0, 0, Vl);  // this slice's model rows
    EXPECT_EQ(model::vocab_shard(tp, V, Vp).model, model);
    std::vector<T> h_local(h.begin() + t0 * H, h.begin() + (t0 + nl) * H);
    std::vector<T> w_local(w.begin() + v0 * H, w.begin() + (v0 + Vl) * H);
    std::vector<T> full(n * H), loss(n), lse(n), dfull(n * H, T(NAN)), dx(nl * H), dw(Vl * H, T(0));
    const int64_t rows = model::vocab_head_chunk_rows(s);
    std::vector<T> logits(rows * Vl), mx(rows);
    std::vector<double> sums(2 * rows);
    const model::VocabHeadWorkspace<T> ws{logits.data(), mx.data(), sums.data()};
    const DevPtr<const T> hin =
        tp.enter(ex, DevPtr<const T>(h_local.data()), DevPtr<T>(full.data()), n, H);
    double sum = 0;
    model::vocab_parallel_head_loss_forward<T>(ex, tp, &sum, loss.data(), lse.data(), hin,
                                               w_local.data(), tg.data(), s, Vp, ws);
    EXPECT_NEAR(sum, sum1, rtol * std::abs(sum1) + atol);
    expect_close(loss.data(), loss1.data(), n, rtol, atol, "loss");
    expect_close(lse.data(), lse1.data(), n, rtol, atol, "lse");
    // The report's sum is the same on every TP rank (counted once by the trainer's dp x cp sum).
    std::vector<double> hi = {sum}, neg_lo = {-sum};
    tp.group()->communicator().all_reduce(hi, parallel::ReduceOp::Max);
    tp.group()->communicator().all_reduce(neg_lo, parallel::ReduceOp::Max);
    EXPECT_EQ(-neg_lo[0], hi[0]);
    model::vocab_parallel_head_loss_backward<T>(ex, tp, dfull.data(), dw.data(), hin,
                                                w_local.data(), tg.data(), lse.data(), &dloss, s,
                                                Vp, ws);
    tp.enter_backward(ex, DevPtr<T>(dfull.data()), DevPtr<T>(dx.data()), n, H);
    expect_close(dx.data(), dh1.data() + t0 * H, nl * H, rtol, atol, "dh");
    expect_close(dw.data(), dw1.data() + v0 * H, model * H, rtol, atol, "dw");
    for (int64_t i = model * H; i < Vl * H; ++i) ASSERT_EQ(dw[i], T(0)) << "padding dw " << i;
  });
}

TEST(VocabParallelMpi, HeadLossMatchesOneRankF64) {
  head_loss_matches_one_rank<double>(kParityF64Rtol, 1e-14, 28, 28);
}
TEST(VocabParallelMpi, HeadLossMatchesOneRankF32) {
  head_loss_matches_one_rank<float>(kParityF32Rtol, 1e-7, 28, 28);
}
// 19 tokens in 28 rows: TP 2 holds 14 + 5 model rows, TP 4 7 + 7 + 5 + 0.
TEST(VocabParallelMpi, PaddedHeadLossMatchesOneRankF64) {
  head_loss_matches_one_rank<double>(kParityF64Rtol, 1e-14, 19, 28);
}
TEST(VocabParallelMpi, PaddedHeadLossMatchesOneRankF32) {
  head_loss_matches_one_rank<float>(kParityF32Rtol, 1e-7, 19, 28);
}

// --bf16: the vocab-parallel head's bf16 GEMMs on this rank's slice vs the fused one-rank head's
// (ops::HeadLossBf16), both operand forms (the bf16 copy on the native GEMM path where the CPU
// has one, the widened copy), on the same bf16 values: the loss, the input gradient and the
// slice's weight gradient.
TEST(VocabParallelMpi, HeadLossBf16MatchesFusedHead) {
  const Exec& ex = cpu_exec();
  const int64_t n = 12, H = 6, V = 28, chunk = 5;
  const std::vector<float> h = randn<float>(n * H, 5), w = randn<float>(V * H, 6, 0.7);
  std::vector<int32_t> tg(n);
  for (int64_t t = 0; t < n; ++t) tg[t] = int32_t((t * 5 + 2) % V);
  tg[3] = -1;
  const ops::HeadLossShape s{n, H, V, chunk};
  std::vector<bf16> w16(V * H);
  std::vector<float> w_wide(V * H);
  ops::cast_f32_to_bf16(ex, w16.data(), w.data(), V * H);
  ops::round_f32_to_bf16(ex, w_wide.data(), w.data(), V * H);
  const float dloss = 1.f / 7.f;
  for (ops::Bf16GemmPath path : testing::runnable_bf16_gemm_paths()) {
    const bool wide = path == ops::Bf16GemmPath::Widen;
    SCOPED_TRACE(wide ? "widened" : "bf16 copy");
    testing::ScopedBf16GemmPath scope(path);
    // One rank, the fused head.
    std::vector<float> loss1(n), lse1(n), ws1(ops::head_loss_workspace_elems(s)), dh1(n * H),
        dw1(V * H, 0.f), h32(n * H), ws32(std::max<int64_t>(1, ops::head_loss_bf16_workspace_elems(ex, s)));
    std::vector<bf16> h16(n * H), dz16(ops::head_loss_workspace_elems(s));
    ops::HeadLossBf16 one;
    if (wide) {
      one.w_VH_wide = w_wide.data();
      one.h32 = h32.data();
    } else {
      one = ops::HeadLossBf16{w16.data(), h16.data(), dz16.data(), ws32.data()};
    }
    double sum1 = 0;
    ops::head_loss_forward<float>(ex, &sum1, loss1.data(), lse1.data(), h.data(), nullptr,
                                  tg.data(), s, ws1.data(), &one);
    ops::head_loss_backward<float>(ex, dh1.data(), dw1.data(), h.data(), nullptr, tg.data(),
                                   lse1.data(), &dloss, s, ws1.data(), &one);
    for_each_tp_layout([&](const TensorParallel& tp, int) {
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      const int64_t Vl = tp.share(V), v0 = tp.share_offset(V);
      std::vector<bf16> w16_local(w16.begin() + v0 * H, w16.begin() + (v0 + Vl) * H);
      std::vector<float> w_wide_local(w_wide.begin() + v0 * H, w_wide.begin() + (v0 + Vl) * H);
      std::vector<float> h_local(h.begin() + t0 * H, h.begin() + (t0 + nl) * H);
      std::vector<float> full(n * H), loss(n), lse(n), dfull(n * H), dx(nl * H), dw(Vl * H, 0.f);
      const int64_t rows = model::vocab_head_chunk_rows(s);
      std::vector<float> logits(rows * Vl), mx(rows), th32(n * H),
          tws32(std::max<int64_t>(1, model::vocab_head_bf16_workspace_elems(ex, tp, s, V)));
      std::vector<double> sums(2 * rows);
      std::vector<bf16> th16(n * H), tdz16(rows * Vl);
      const model::VocabHeadWorkspace<float> ws{logits.data(), mx.data(), sums.data()};
      ops::HeadLossBf16 b;
      if (wide) {
        b.w_VH_wide = w_wide_local.data();
        b.h32 = th32.data();
      } else {
        b = ops::HeadLossBf16{w16_local.data(), th16.data(), tdz16.data(), tws32.data()};
      }
      const DevPtr<const float> hin =
          tp.enter(ex, DevPtr<const float>(h_local.data()), DevPtr<float>(full.data()), n, H);
      double sum = 0;
      model::vocab_parallel_head_loss_forward<float>(ex, tp, &sum, loss.data(), lse.data(), hin,
                                                     nullptr, tg.data(), s, V, ws, &b);
      EXPECT_NEAR(sum, sum1, kParityF32Rtol * std::abs(sum1));
      expect_close(loss.data(), loss1.data(), n, kParityF32Rtol, 1e-7, "loss");
      expect_close(lse.data(), lse1.data(), n, kParityF32Rtol, 1e-7, "lse");
      model::vocab_parallel_head_loss_backward<float>(ex, tp, dfull.data(), dw.data(), hin, nullptr,
                                                      tg.data(), lse.data(), &dloss, s, V, ws, &b);
      tp.enter_backward(ex, DevPtr<float>(dfull.data()), DevPtr<float>(dx.data()), n, H);
      expect_close(dx.data(), dh1.data() + t0 * H, nl * H, kParityF32Rtol, 1e-7, "dh");
      expect_close(dw.data(), dw1.data() + v0 * H, Vl * H, kParityF32Rtol, 1e-7, "dw");
    });
  }
}

// --bf16 on the native GEMM path: the lookup of the slice's bf16 copy gives
// ops::embedding_forward_bf16's rows of the whole table, bitwise.
// Also with a padded table (19 tokens in 28 rows).
TEST(VocabParallelMpi, EmbeddingBf16MatchesOneRankBitwise) {
  for (const int64_t V : {28, 19}) {
    SCOPED_TRACE(::testing::Message() << "V " << V << " in 28 rows");
    const Exec& ex = cpu_exec();
    const int64_t n = 12, H = 70, Vp = 28;
    std::vector<float> w = randn<float>(Vp * H, 7);
    std::fill(w.begin() + V * H, w.end(), 0.f);
    std::vector<bf16> w16(Vp * H);
    ops::cast_f32_to_bf16(ex, w16.data(), w.data(), Vp * H);
    std::vector<int32_t> ids(n);
    for (int64_t t = 0; t < n; ++t) ids[t] = int32_t((t * 11 + 5) % V);
    std::vector<float> y1(n * H);
    ops::embedding_forward_bf16(ex, y1.data(), ids.data(), w16.data(), n, H, V);
    for_each_tp_layout([&](const TensorParallel& tp, int) {
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      const int64_t Vl = tp.share(Vp), v0 = tp.share_offset(Vp);
      std::vector<bf16> w16_local(w16.begin() + v0 * H, w16.begin() + (v0 + Vl) * H);
      std::vector<float> y(nl * H), partial(n * H), w32(Vl * H);
      model::vocab_parallel_embedding_forward_bf16(ex, tp, y.data(), partial.data(), ids.data(),
                                                   w16_local.data(), w32.data(), n, H, V, Vp);
      for (int64_t i = 0; i < nl * H; ++i) ASSERT_EQ(y[i], y1[t0 * H + i]) << i;
    });
  }
}

// Also with a padded table (19 tokens in 28 rows): the padding rows get no gradient.
TEST(VocabParallelMpi, EmbeddingMatchesOneRankBitwise) {
  for (const int64_t V : {28, 19}) {
    SCOPED_TRACE(::testing::Message() << "V " << V << " in 28 rows");
    const Exec& ex = cpu_exec();
    const int64_t n = 12, H = 70, Vp = 28;  // H: more than one 64-column backward block
    std::vector<double> w = randn<double>(Vp * H, 3);
    std::fill(w.begin() + V * H, w.end(), 0.0);
    const std::vector<double> dy = randn<double>(n * H, 4);
    std::vector<int32_t> ids(n);
    for (int64_t t = 0; t < n; ++t) ids[t] = int32_t((t * 11 + 5) % V);
    ids[7] = ids[2];  // a repeated id: its gradient rows add in token order
    std::vector<double> y1(n * H), dw1(Vp * H, 0.0);
    ops::embedding_forward<double>(ex, y1.data(), ids.data(), w.data(), n, H, V);
    ops::embedding_backward<double>(ex, dw1.data(), dy.data(), ids.data(), n, H, V);
    for_each_tp_layout([&](const TensorParallel& tp, int) {
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      const int64_t Vl = tp.share(Vp), v0 = tp.share_offset(Vp);
      std::vector<double> w_local(w.begin() + v0 * H, w.begin() + (v0 + Vl) * H);
      std::vector<double> y(nl * H), partial(n * H), full(n * H), dw(Vl * H, 0.0);
      model::vocab_parallel_embedding_forward<double>(ex, tp, y.data(), partial.data(), ids.data(),
                                                      w_local.data(), n, H, V, Vp);
      for (int64_t i = 0; i < nl * H; ++i) ASSERT_EQ(y[i], y1[t0 * H + i]) << i;
      std::vector<double> dy_local(dy.begin() + t0 * H, dy.begin() + (t0 + nl) * H);
      model::vocab_parallel_embedding_backward<double>(ex, tp, dw.data(), dy_local.data(),
                                                       full.data(), ids.data(), n, H, V, Vp);
      for (int64_t i = 0; i < Vl * H; ++i) ASSERT_EQ(dw[i], dw1[v0 * H + i]) << i;
    });
  }
}

// GPTModel at TP 2 without sequence parallelism (the dense blocks see every token) vs one rank:
// the loss on every TP rank and the vocab-parallel parameters' gradients, tied and untied, with
// learned absolute positions.
TEST(VocabParallelMpi, GptModelTp2MatchesOneRank) {
  if (g_rt.world_size % 2 != 0) GTEST_SKIP() << "needs an even world";
  for (auto [tied, padded] : {std::pair{true, false}, std::pair{false, false},
                              std::pair{true, true}, std::pair{false, true}}) {
    SCOPED_TRACE(std::string(tied ? "tied" : "untied") + (padded ? ", padded" : ""));
    ModelConfig cfg;
    cfg.vocab_size = 26;  // 13 rows per rank
    if (padded) {         // 11 tokens in 26 rows: rank 0 holds them all, rank 1 padding only
      cfg.vocab_size = 11;
      cfg.padded_vocab_size = 26;
    }
    cfg.hidden = 8;
    cfg.num_layers = 1;
    cfg.num_heads = 2;
    cfg.num_query_groups = 2;
    cfg.ffn_hidden = 12;
    cfg.seq_length = 6;
    cfg.init_std = 0.5;
    cfg.tie_embeddings = tied;
    cfg.position_embedding = PositionEmbedding::LearnedAbsolute;
    const int64_t B = 2, n = B * cfg.seq_length, V = cfg.vocab_size, H = cfg.hidden;
    std::vector<int32_t> ids(n), tg(n);
    for (int64_t t = 0; t < n; ++t) {
      ids[t] = int32_t((t * 7 + 1) % V);
      tg[t] = t == 4 ? -1 : int32_t((t * 5 + 3) % V);
    }
    ModelConfig unpadded = cfg;  // the one-rank reference has no padding at all
    unpadded.padded_vocab_size = 0;
    model::GPTModel<double> one(unpadded, B, 17);
    const double loss1 = one.forward(ids.data(), tg.data());
    one.backward(1.0);
    TpGroups g(2, false);
    model::GPTModel<double> m(cfg, B, 17, &g.groups);
    const double loss = m.forward(ids.data(), tg.data());
    m.backward(1.0);
    EXPECT_NEAR(loss, loss1, kParityF64Rtol * std::abs(loss1));
    const TensorParallel tp = TensorParallel::attention(&g.groups);
    const int64_t Vp = cfg.padded_vocab(), v0 = tp.share_offset(Vp), Vl = tp.share(Vp);
    const int64_t model = std::clamp<int64_t>(V - v0, 0, Vl);
    for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
      if (tied && std::string(name) == "output_layer.weight") continue;
      const Param* p1 = one.params().find(name);
      const Param* p = m.params().find(name);
      ASSERT_NE(p1, nullptr);
      ASSERT_NE(p, nullptr);
      ASSERT_EQ(p->local_numel(), Vl * H);
      ASSERT_EQ(p1->local_numel(), V * H);
      const double* g1 = raw_ptr(p1->grad_as<double>()) + std::min(v0, V) * H;
      const double* gl = raw_ptr(p->grad_as<double>());
      const double* w1 = raw_ptr(p1->data_as<double>()) + std::min(v0, V) * H;
      const double* wl = raw_ptr(p->data_as<double>());
      for (int64_t i = 0; i < model * H; ++i) {
        ASSERT_EQ(wl[i], w1[i]) << name << " init [" << i << "]";
        ASSERT_NEAR(gl[i], g1[i], kParityF64Rtol * std::abs(g1[i]) + 1e-14)
            << name << " [" << i << "]";
      }
      for (int64_t i = model * H; i < Vl * H; ++i) {
        ASSERT_EQ(wl[i], 0.0) << name << " padding [" << i << "]";
        ASSERT_EQ(gl[i], 0.0) << name << " padding gradient [" << i << "]";
      }
    }
    // forward_logits: every TP rank returns the whole [B, S, V] (V the model's vocabulary).
    std::vector<double> logits1(n * V), logits(n * V);
    one.forward_logits(ids.data(), logits1.data());
    m.forward_logits(ids.data(), logits.data());
    expect_close(logits.data(), logits1.data(), n * V, kParityF64Rtol, 1e-14, "logits");
  }
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}
