// Training pieces: the synthetic language's entropy rate, Megatron's LR schedule, AdamW with
// global-norm clipping, and short end-to-end runs (loss approaches the floor; bitwise
// determinism for the same seed).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "cli/train_flags.h"
#include "common/bf16_gemm_paths.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "common/tolerances.h"
#include "core/arena.h"
#include "data/synthetic_language.h"
#include "ops/gemm_bf16.h"
#include "optim/chained_optimizer.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace moecore {

using testing::host;
namespace {

using train::StepMetrics;

TEST(SyntheticLanguage, EmpiricalEntropyMatchesRate) {
  data::SyntheticLanguage lang(64, 4, 7);
  EXPECT_GT(lang.entropy_rate(), 0.3);
  EXPECT_LT(lang.entropy_rate(), std::log(4.0));
  // Mean -log P(next | prev) over samples estimates the entropy rate.
  std::vector<int32_t> tok(257);
  double nll = 0;
  int64_t n = 0;
  for (uint64_t i = 0; i < 400; ++i) {
    lang.sample(tok.data(), 257, i);
    for (int t = 1; t < 257; ++t) {
      double p = lang.transition(tok[t - 1], tok[t]);
      ASSERT_GT(p, 0.0);
      nll -= std::log(p);
      ++n;
    }
  }
  EXPECT_NEAR(nll / n, lang.entropy_rate(), 0.02);  // ~5 standard errors at 1e5 tokens
  // A pure function of (seed, index).
  std::vector<int32_t> a(32), b(32);
  lang.sample(a.data(), 32, 123);
  data::SyntheticLanguage again(64, 4, 7);
  again.sample(b.data(), 32, 123);
  EXPECT_EQ(a, b);
}

TEST(LrSchedule, MatchesMegatronFormulas) {
  optim::LrSchedule s;
  s.max_lr = 1.0;
  s.min_lr = 0.1;
  s.warmup_steps = 10;
  s.decay_steps = 110;
  s.style = optim::LrDecayStyle::Cosine;
  EXPECT_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(5), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(10), 1.0);
  EXPECT_NEAR(s.lr(60), 0.55, 1e-12);  // half way: 0.1 + 0.9 * 0.5
  EXPECT_NEAR(s.lr(110), 0.1, 1e-12);
  EXPECT_EQ(s.lr(500), 0.1);
  s.style = optim::LrDecayStyle::Linear;
  EXPECT_NEAR(s.lr(35), 0.1 + 0.9 * 0.75, 1e-12);
  s.style = optim::LrDecayStyle::Constant;
  EXPECT_EQ(s.lr(100), 1.0);
  s.style = optim::LrDecayStyle::WSD;
  s.wsd_decay_steps = 20;
  s.wsd_style = optim::WsdDecayStyle::Linear;
  EXPECT_EQ(s.lr(90), 1.0);
  EXPECT_NEAR(s.lr(100), 0.55, 1e-12);
  EXPECT_THROW(optim::parse_lr_decay_style("cosinus"), Error);
}

TEST(Optimizer, GlobalNormClipAndDecoupledDecay) {
  ParamRegistry params(DType::F32);
  params.add(ParamSpec{"w", {2}, ParamInit::Ones, 0, ParamKind::Dense, true, {}});
  params.add(ParamSpec{"norm", {1}, ParamInit::Ones, 0, ParamKind::Dense, false, {}});
  params.add(ParamSpec{"e", {1}, ParamInit::Ones, 0, ParamKind::Expert, true, {}});
  Arena arena;
  arena.plan([&](Arena& a) { params.allocate(a); });
  params.init(0);
  float* g = static_cast<float*>(host(params.flat_grad(ParamKind::Dense)));
  g[0] = 3;
  g[1] = 0;
  g[2] = 0;
  static_cast<float*>(host(params.flat_grad(ParamKind::Expert)))[0] = 4;
  optim::AdamWConfig cfg;
  cfg.weight_decay = 0.5;
  cfg.clip_grad = 1.0;
  optim::AdamWOptimizer opt(params, cfg);
  optim::StepInfo info = opt.step(0.1);
  EXPECT_DOUBLE_EQ(info.grad_norm, 5.0);  // dense and expert grads in one norm
  EXPECT_NEAR(info.clip_coeff, 1.0 / (5.0 + 1e-6), 1e-12);
  // First Adam step moves by lr * sign(g) (bias-corrected), plus decoupled decay lr * wd * p.
  const float* w = host(params.get("w").data_as<float>());
  EXPECT_NEAR(w[0], 1.0 - 0.1 - 0.1 * 0.5, 1e-6);
  EXPECT_NEAR(w[1], 1.0 - 0.1 * 0.5, 1e-6);                       // zero grad: decay only
  EXPECT_FLOAT_EQ(host(params.get("norm").data_as<float>())[0], 1.0f);  // no decay, no grad
  EXPECT_NEAR(host(params.get("e").data_as<float>())[0], 1.0 - 0.1 - 0.05, 1e-6);
}

// The gradient sum of squares: f64 accuracy on a long vector of awkward length (n not a
// multiple of the lanes or blocks, both kinds, f32 and f64 gradients), and bitwise the same for
// 1, 2 and 3 threads.
template <typename T>
void check_sum_squares() {
  SCOPED_TRACE(DTypeOf<T>::value == DType::F32 ? "f32" : "f64");
  ParamRegistry params(DTypeOf<T>::value);
  params.add(ParamSpec{"a", {1000, 1003}, ParamInit::Zeros, 0, ParamKind::Dense, true, {}});
  params.add(ParamSpec{"b", {5}, ParamInit::Zeros, 0, ParamKind::Dense, false, {}});
  params.add(ParamSpec{"e", {3, 7001}, ParamInit::Zeros, 0, ParamKind::Expert, true, {}});
  Arena arena;
  arena.plan([&](Arena& a) { params.allocate(a); });
  double expect = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    auto g = testing::random_vec<T>(params.numel(k), 30 + static_cast<uint32_t>(k), -3, 3);
    std::copy(g.begin(), g.end(), static_cast<T*>(host(params.flat_grad(k))));
    long double s = 0;  // serial, wider than the sum under test
    for (T x : g) s += static_cast<long double>(x) * static_cast<long double>(x);
    expect += static_cast<double>(s);
  }
  double by_threads[3];
  for (int threads = 1; threads <= 3; ++threads) {
    testing::ScopedOmpThreads scoped(threads);
    by_threads[threads - 1] = optim::global_grad_norm(params);
  }
  EXPECT_NEAR(by_threads[0], std::sqrt(expect), 1e-13 * std::sqrt(expect));
  EXPECT_EQ(by_threads[1], by_threads[0]) << "2 threads vs 1";
  EXPECT_EQ(by_threads[2], by_threads[0]) << "3 threads vs 1";
}

// A non-finite gradient norm stops training with the norm and the step named, after a step
// that changed nothing: the update read the skip flag the clip op set (no host round trip
// between the norm and the update), so the weights and moments are the ones before the step.
TEST(Optimizer, NonFiniteNormIsAnErrorAfterAStepThatChangedNothing) {
  for (bool chained : {false, true}) {
    SCOPED_TRACE(chained);
    ParamRegistry params(DType::F32);
    params.add(ParamSpec{"w", {2}, ParamInit::Ones, 0, ParamKind::Dense, true, {}});
    params.add(ParamSpec{"e", {1}, ParamInit::Ones, 0, ParamKind::Expert, true, {}});
    Arena arena;
    arena.plan([&](Arena& a) { params.allocate(a); });
    params.init(0);
    float* g = static_cast<float*>(host(params.flat_grad(ParamKind::Dense)));
    g[0] = 1;
    g[1] = std::numeric_limits<float>::infinity();
    static_cast<float*>(host(params.flat_grad(ParamKind::Expert)))[0] = 2;
    optim::AdamWConfig cfg;
    std::unique_ptr<optim::AdamWOptimizer> single;
    std::unique_ptr<optim::ChainedOptimizer> chain;
    if (chained) chain = std::make_unique<optim::ChainedOptimizer>(params, cfg);
    else single = std::make_unique<optim::AdamWOptimizer>(params, cfg);
    try {
      if (chained) chain->step(0.1);
      else single->step(0.1);
      ADD_FAILURE() << "no error for an infinite gradient";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("gradient norm is inf at step 1"), std::string::npos)
          << e.what();
      // Clipping is on (--clip-grad 1.0): it is not the advice.
      EXPECT_EQ(std::string(e.what()).find("enable --clip-grad"), std::string::npos) << e.what();
    }
    EXPECT_EQ(host(params.get("w").data_as<float>())[0], 1.0f);
    EXPECT_EQ(host(params.get("w").data_as<float>())[1], 1.0f);
    EXPECT_EQ(host(params.get("e").data_as<float>())[0], 1.0f);
  }
}

TEST(Optimizer, GradSumOfSquaresIsAccurateAndThreadCountInvariant) {
  check_sum_squares<float>();
  check_sum_squares<double>();
}

// --bf16: the optimizer writes the bf16 copies with the update; the trainer's refresh_bf16 then
// skips them once. The copies equal the rounded master values either way, and a later change of
// the values is still picked up by the next refresh.
TEST(Optimizer, Bf16CopiesWrittenWithTheUpdate) {
  // p also keeps the widened copies (the widened-bf16 GEMM path): written in the same pass.
  auto make = [](ParamRegistry& p, Arena& arena, bool widened) {
    p.enable_bf16_copies(widened);
    p.add(ParamSpec{"w", {300, 70}, ParamInit::Normal, 0.02, ParamKind::Dense, true, {}});
    p.add(ParamSpec{"e", {2, 9000}, ParamInit::Normal, 0.02, ParamKind::Expert, true, {}});
    arena.plan([&](Arena& a) { p.allocate(a); });
    p.init(5);
    p.refresh_bf16();
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      auto g = testing::random_vec<float>(p.numel(k), 40 + static_cast<uint32_t>(k));
      std::copy(g.begin(), g.end(), static_cast<float*>(host(p.flat_grad(k))));
    }
  };
  auto copies_match = [](const ParamRegistry& p) {
    for (const Param& q : p.params()) {
      ASSERT_NE(q.data16 == nullptr, q.data16w == nullptr) << q.name() << ": one copy format";
      for (int64_t i = 0; i < q.local_numel(); ++i) {
        const bf16 expect = float_to_bf16(host(q.data_as<float>())[i]);
        if (q.data16 != nullptr && host(q.data16)[i].bits != expect.bits) {
          ADD_FAILURE() << q.name() << "[" << i << "]";
          return;
        }
        if (q.data16w != nullptr && std::bit_cast<uint32_t>(host(q.data16w)[i]) !=
                                        std::bit_cast<uint32_t>(bf16_to_float(expect))) {
          ADD_FAILURE() << q.name() << " widened [" << i << "]";
          return;
        }
      }
    }
  };
  ParamRegistry p(DType::F32), ref(DType::F32);
  Arena pa, ra;
  make(p, pa, true);
  make(ref, ra, false);
  ASSERT_NE(p.params().front().data16w, nullptr);
  ASSERT_EQ(p.params().front().data16, nullptr);  // the widened path keeps no bf16 copy
  ASSERT_EQ(ref.params().front().data16w, nullptr);
  ASSERT_NE(ref.params().front().data16, nullptr);
  optim::AdamWConfig cfg;
  optim::ChainedOptimizer opt(p, cfg);
  optim::AdamWOptimizer opt_ref(ref, cfg);
  for (int step = 0; step < 2; ++step) {
    opt.step(1e-2);
    copies_match(p);  // before the refresh: written by the update itself
    p.refresh_bf16();
    copies_match(p);
    opt_ref.step(1e-2);
    ref.refresh_bf16();
    copies_match(ref);
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      EXPECT_EQ(
          0, std::memcmp(host(p.flat_data(k)), host(ref.flat_data(k)), p.numel(k) * sizeof(float)));
    }
  }
  // After the skipped refresh, a refresh converts again.
  host(p.get("w").data_as<float>())[7] = 3.0f;
  host(p.get("e").data_as<float>())[11] = -5.0f;
  p.refresh_bf16();
  copies_match(p);
}

// Dense w [2] (decay), norm [1] (no decay), expert e [1]; grads dense (3, 0, 0), expert 4.
void fill_optimizer_registry(ParamRegistry& params, Arena& arena) {
  params.add(ParamSpec{"w", {2}, ParamInit::Ones, 0, ParamKind::Dense, true, {}});
  params.add(ParamSpec{"norm", {1}, ParamInit::Ones, 0, ParamKind::Dense, false, {}});
  params.add(ParamSpec{"e", {1}, ParamInit::Ones, 0, ParamKind::Expert, true, {}});
  arena.plan([&](Arena& a) { params.allocate(a); });
  params.init(0);
  float* g = static_cast<float*>(host(params.flat_grad(ParamKind::Dense)));
  g[0] = 3;
  g[1] = 0;
  g[2] = 0;
  static_cast<float*>(host(params.flat_grad(ParamKind::Expert)))[0] = 4;
}

TEST(ChainedOptimizer, OneRankEqualsTheSingleAdamWBitwise) {
  ParamRegistry a(DType::F32), b(DType::F32);
  Arena aa, ab;
  fill_optimizer_registry(a, aa);
  fill_optimizer_registry(b, ab);
  optim::AdamWConfig cfg;
  cfg.clip_grad = 1.0;
  optim::AdamWOptimizer single(a, cfg);
  optim::ChainedOptimizer chained(b, cfg);
  for (int step = 0; step < 3; ++step) {
    optim::StepInfo x = single.step(0.1), y = chained.step(0.1);
    EXPECT_EQ(x.grad_norm, y.grad_norm);
    EXPECT_EQ(x.clip_coeff, y.clip_coeff);
  }
  EXPECT_EQ(chained.steps_taken(), 3);
  for (const char* n : {"w", "norm", "e"}) {
    const Param& pa = a.get(n);
    const Param& pb = b.get(n);
    for (int64_t i = 0; i < pa.local_numel(); ++i) {
      EXPECT_EQ(host(pa.data_as<float>())[i], host(pb.data_as<float>())[i]) << n << "[" << i << "]";
    }
  }
  EXPECT_EQ(chained.state_bytes(MemKind::OptimizerState),
            single.arena().bytes_of(MemKind::OptimizerState));
}

TEST(ChainedOptimizer, ExpertSquaresSummedOverEpOneClipCoefficientForBoth) {
  ParamRegistry p(DType::F32);
  Arena arena;
  fill_optimizer_registry(p, arena);
  optim::AdamWConfig cfg;
  cfg.clip_grad = 1.0;
  cfg.weight_decay = 0;
  // As if a second EP rank held another expert with the same gradient: 16 + 16.
  optim::GradNormSync sync;
  sync.sum_expert = [](DevPtr<double> sq) { *host(sq) *= 2; };
  optim::ChainedOptimizer opt(p, cfg, sync);
  optim::StepInfo info = opt.step(0.1);
  EXPECT_DOUBLE_EQ(info.grad_norm, std::sqrt(9.0 + 32.0));
  EXPECT_DOUBLE_EQ(info.clip_coeff, 1.0 / (std::sqrt(41.0) + 1e-6));
  // First Adam step: lr * sign(g) for both kinds (the clip scale cancels in m / sqrt(v)).
  EXPECT_NEAR(host(p.get("w").data_as<float>())[0], 0.9, 1e-6);
  EXPECT_NEAR(host(p.get("e").data_as<float>())[0], 0.9, 1e-6);
  // One-kind AdamW leaves the other kind alone.
  ParamRegistry q(DType::F32);
  Arena qa;
  fill_optimizer_registry(q, qa);
  optim::AdamWOptimizer dense_only(q, cfg, ParamKind::Dense);
  double sum_sq[2] = {-1.0, -1.0};
  dense_only.grad_sum_squares(sum_sq);
  EXPECT_DOUBLE_EQ(sum_sq[0], 9.0);
  EXPECT_EQ(sum_sq[1], -1.0) << "a dense-only optimizer wrote the expert sum";
  ops::AdamWStep step;
  step.lr = 0.1;
  dense_only.update(&step);
  EXPECT_EQ(host(q.get("e").data_as<float>())[0], 1.0f);
  EXPECT_NEAR(host(q.get("w").data_as<float>())[0], 0.9, 1e-6);
}

// Tensor parallelism's counting (one process standing for TP rank 1): the replicated "norm"
// is left out of this rank's sum of squares (TP rank 0 counts it), the dense sum then adds up
// over tp (here: rank 0's sum, scripted); a filter that keeps everything changes no bit.
TEST(ChainedOptimizer, CountedParametersOnlyThenSummedOverTp) {
  ParamRegistry p(DType::F32);
  Arena arena;
  fill_optimizer_registry(p, arena);
  static_cast<float*>(host(p.flat_grad(ParamKind::Dense)))[2] = 5;  // norm's gradient
  optim::AdamWConfig cfg;
  cfg.weight_decay = 0;
  {
    optim::AdamWOptimizer dense(p, cfg, ParamKind::Dense);
    double all[2] = {-1, -1}, kept[2] = {-1, -1};
    dense.grad_sum_squares(all);
    dense.count_only([](const Param&) { return true; });
    dense.grad_sum_squares(kept);
    EXPECT_EQ(all[0], 9.0 + 25.0);
    EXPECT_EQ(std::bit_cast<uint64_t>(all[0]), std::bit_cast<uint64_t>(kept[0]));
    dense.count_only([](const Param& q) { return q.name() != "norm"; });
    double counted[2] = {-1, -1};
    dense.grad_sum_squares(counted);
    EXPECT_EQ(counted[0], 9.0);
    EXPECT_EQ(counted[1], -1.0);
  }
  optim::GradNormSync sync;
  sync.counted = [](const Param& q) { return q.name() != "norm"; };
  // TP rank 0 counted its slice of w (3^2 again, as if the slices were equal) and the norm.
  sync.sum_dense = [](DevPtr<double> sq) { *host(sq) += 9.0 + 25.0; };
  optim::ChainedOptimizer opt(p, cfg, sync);
  EXPECT_DOUBLE_EQ(opt.step(0.1).grad_norm, std::sqrt(9.0 + 9.0 + 25.0 + 16.0));
}

cli::TrainFlags short_run_flags(int64_t iters) {
  cli::TrainFlags f = cli::tiny_train_flags();
  f.vocab_size = 64;
  f.model.hidden = 32;
  f.model.seq_length = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 32;
  f.model.moe.shared_ffn_hidden = 16;
  f.model.moe.router.z_loss_coeff = 1e-3;
  f.moe_layer_freq = "[1,0]";
  f.untie_embeddings = true;
  f.make_vocab_size_divisible_by = 64;
  f.train.train_iters = iters;
  f.train.micro_batch = 4;
  f.train.global_batch = 8;
  f.train.log_interval = 1000;
  f.train.lr.warmup_steps = 5;
  f.train.lr.decay_steps = 0;
  f.train.peak_gflops = 100;  // skip the start-up GEMM probe
  cli::finalize_train_flags(f);
  return f;
}

TEST(Train, LossApproachesEntropyFloor) {
  cli::TrainFlags f = short_run_flags(150);
  train::Trainer trainer(f.model, f.train);
  std::ostringstream log;
  auto m = trainer.run(log);
  double last = 0;
  for (int i = 140; i < 150; ++i) last += m[i].lm_loss / 10;
  EXPECT_NEAR(m[0].lm_loss, std::log(64.0), 0.1);
  // The full default run reaches the floor within 0.15 nats; this short one must be well on
  // its way (the floor is ~1.1 nats, uniform guessing 4.16).
  EXPECT_LT(last - trainer.entropy_floor(), 0.6) << log.str();
  EXPECT_GT(m.back().aux_loss, 0.9);
  EXPECT_LT(m.back().max_over_mean_load, 2.0);
}

// bf16 mixed precision meets the same bar as fp32 on the short run.
TEST(Train, Bf16LossApproachesEntropyFloor) {
  cli::TrainFlags f = short_run_flags(150);
  f.model.bf16 = true;
  train::Trainer trainer(f.model, f.train);
  std::ostringstream log;
  auto m = trainer.run(log);
  double last = 0;
  for (int i = 140; i < 150; ++i) last += m[i].lm_loss / 10;
  EXPECT_LT(last - trainer.entropy_floor(), 0.6) << log.str();
}

// Both bf16 GEMM paths compute the same products on the same bf16 inputs (only the f32
// summation order differs), so a short run trains alike on either; the start-up log names the
// path. The widen path's workspaces are planned (the arena would throw on a step allocation).
TEST(Train, Bf16GemmPathsTrainAlike) {
  std::vector<std::vector<train::StepMetrics>> runs;
  if (!ops::bf16_native_available()) {
    GTEST_SKIP() << "native bf16 path not run: oneDNN runs below AVX-512 here (no bf16 matmul); "
                    "the widen path trains in Train.Bf16LossApproachesEntropyFloor";
  }
  for (ops::Bf16GemmPath path : {ops::Bf16GemmPath::Native, ops::Bf16GemmPath::Widen}) {
    testing::ScopedBf16GemmPath scope(path);
    cli::TrainFlags f = short_run_flags(6);
    f.model.bf16 = true;
    train::Trainer trainer(f.model, f.train);
    std::ostringstream log;
    runs.push_back(trainer.run(log));
    EXPECT_NE(log.str().find(path == ops::Bf16GemmPath::Native ? "[gemm] bf16 GEMMs: oneDNN native"
                                                               : "[gemm] bf16 GEMMs: widen to f32"),
              std::string::npos)
        << log.str();
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_NEAR(runs[0][i].lm_loss, runs[1][i].lm_loss, 1e-4 * std::abs(runs[0][i].lm_loss))
        << "iteration " << i + 1;
    EXPECT_NEAR(runs[0][i].grad_norm, runs[1][i].grad_norm, 1e-3 * runs[0][i].grad_norm)
        << "iteration " << i + 1;
  }
}

// MFU never exceeds 100%: an achieved rate above the probed (or given) peak raises the peak to
// it and says so; below it, MFU = achieved / peak. Synthetic numbers, no clocks.
TEST(Mfu, AchievedAboveThePeakRaisesThePeak) {
  const train::MfuReport below = train::mfu_report(100e9, 2.0, 200.0);  // 50 GFLOP/s
  EXPECT_DOUBLE_EQ(below.achieved_gflops, 50.0);
  EXPECT_DOUBLE_EQ(below.peak_gflops, 200.0);
  EXPECT_DOUBLE_EQ(below.mfu, 0.25);
  EXPECT_FALSE(below.peak_raised);
  // The case: 55.3 GFLOP/s achieved against a 31.9 GFLOP/s probe (was "MFU 173.3%").
  const train::MfuReport above = train::mfu_report(55.3e9, 1.0, 31.9);
  EXPECT_TRUE(above.peak_raised);
  EXPECT_DOUBLE_EQ(above.peak_gflops, above.achieved_gflops);
  EXPECT_DOUBLE_EQ(above.mfu, 1.0);
  const train::MfuReport equal = train::mfu_report(10e9, 1.0, 10.0);
  EXPECT_FALSE(equal.peak_raised);
  EXPECT_DOUBLE_EQ(equal.mfu, 1.0);
  EXPECT_DOUBLE_EQ(train::mfu_report(0.0, 1.0, 10.0).mfu, 0.0);
  EXPECT_DOUBLE_EQ(train::mfu_report(1e9, 0.0, 10.0).mfu, 0.0);  // no time measured
  EXPECT_DOUBLE_EQ(train::mfu_report(1e9, 1.0, 0.0).mfu, 1.0);   // no peak: achieved is it
}

// The probe runs the model's own GEMMs: bench-small's biggest dense ones (qkv projection,
// shared expert fc1, head chunk) and the routed experts' fc1 at the balanced load, each in
// forward, data-gradient and weight-gradient orientation.
TEST(Mfu, PeakProbeShapesAreTheModelsGemms) {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden = 512;
  c.num_heads = 8;
  c.num_query_groups = 2;
  c.kv_channels = 64;
  c.vocab_size = 8192;
  c.num_experts = 16;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden = 512;
  c.moe.shared_ffn_hidden = 512;
  const auto shapes = train::peak_probe_shapes(c, 2048, 1024);
  ASSERT_EQ(shapes.size(), 12u);
  auto has = [&](bool ta, bool tb, int64_t M, int64_t N, int64_t K) {
    for (const auto& s : shapes) {
      if (s.trans_a == ta && s.trans_b == tb && s.M == M && s.N == N && s.K == K) return true;
    }
    return false;
  };
  EXPECT_TRUE(has(false, true, 2048, 768, 512));    // qkv forward
  EXPECT_TRUE(has(false, false, 2048, 512, 1024));  // shared expert fc1 dx
  EXPECT_TRUE(has(false, true, 1024, 8192, 512));   // head chunk logits
  EXPECT_TRUE(has(true, false, 8192, 512, 1024));   // head dW
  EXPECT_TRUE(has(false, true, 256, 1024, 512));    // expert fc1 at 2048 * 2 / 16 rows
  EXPECT_TRUE(has(true, false, 1024, 512, 256));    // expert fc1 dW
}

TEST(Train, SameSeedGivesBitwiseIdenticalLosses) {
  cli::TrainFlags f = short_run_flags(6);
  std::ostringstream log;
  train::Trainer a(f.model, f.train), b(f.model, f.train);
  auto ma = a.run(log), mb = b.run(log);
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i].lm_loss, mb[i].lm_loss) << "iteration " << i + 1;
    EXPECT_EQ(ma[i].grad_norm, mb[i].grad_norm) << "iteration " << i + 1;
  }
}

// The vocabulary padding is not part of the model: vocabulary 250 padded to 300
// (--make-vocab-size-divisible-by 100) trains exactly the model of --make-vocab-size-divisible-by
// 1 (250 rows), in f64 with weight decay, untied: the same losses bitwise, the grad norms to a few
// ulps (their sum's association, below), the model's rows of the embedding and head bitwise, the
// same weights digest; the padding rows' values, gradients and AdamW moments exactly zero after
// every step.
TEST(Train, VocabularyPaddingTrainsTheSameModel) {
  auto flags = [](int64_t divisible_by) {
    cli::TrainFlags f = cli::tiny_train_flags();
    f.vocab_size = 250;
    f.make_vocab_size_divisible_by = divisible_by;
    f.untie_embeddings = true;
    f.model.hidden = 32;
    f.model.seq_length = 32;
    f.model.num_experts = 4;
    f.model.moe.ffn_hidden = 32;
    f.train.train_iters = 6;
    f.train.micro_batch = 4;
    f.train.global_batch = 8;
    f.train.log_interval = 1000;
    f.train.lr.warmup_steps = 2;
    f.train.lr.decay_steps = 0;
    f.train.adam.weight_decay = 0.1;
    f.train.peak_gflops = 100;  // skip the start-up GEMM probe
    cli::finalize_train_flags(f);
    return f;
  };
  const cli::TrainFlags plain = flags(1), padded = flags(100);
  ASSERT_EQ(padded.model.vocab_size, 250);
  ASSERT_EQ(padded.model.padded_vocab_size, 300);
  ASSERT_EQ(plain.model.padded_vocab(), 250);
  train::BasicTrainer<double> a(plain.model, plain.train), b(padded.model, padded.train);
  const int64_t H = plain.model.hidden, model = 250 * H, rows = 300 * H;
  const char* kVocab[] = {"embedding.word_embeddings.weight", "output_layer.weight"};
  std::ostringstream log;
  for (int64_t step = 1; step <= 6; ++step) {
    const StepMetrics ma = a.train_step(), mb = b.train_step();
    EXPECT_EQ(ma.lm_loss, mb.lm_loss) << "step " << step;
    // The norm's f64 sum of squares runs over the flat gradient buffer in fixed blocks of 16384
    // elements; the embedding's padding rows (zeros) shift the later parameters' elements into
    // other blocks, so the same terms are associated differently: a few f64 ulps (below the
    // clip, so the update, the weights and the losses are bitwise the same).
    EXPECT_NEAR(ma.grad_norm, mb.grad_norm, testing::kF64FewUlps * ma.grad_norm) << "step " << step;
    for (const char* name : kVocab) {
      const Param& p = *b.model().params().find(name);
      ASSERT_EQ(p.local_numel(), rows) << name;
      ASSERT_EQ(p.spec.model_rows, 250) << name;
      const double* w = host(p.data_as<double>());
      const double* g = host(p.grad_as<double>());
      const float* m1 = host(b.optimizer().dense().exp_avg(p));
      const float* m2 = host(b.optimizer().dense().exp_avg_sq(p));
      for (int64_t i = model; i < rows; ++i) {
        ASSERT_EQ(w[i], 0.0) << name << " padding value " << i << ", step " << step;
        ASSERT_EQ(g[i], 0.0) << name << " padding gradient " << i << ", step " << step;
        ASSERT_EQ(m1[i], 0.f) << name << " padding exp_avg " << i << ", step " << step;
        ASSERT_EQ(m2[i], 0.f) << name << " padding exp_avg_sq " << i << ", step " << step;
      }
      const double* w1 = host(a.model().params().find(name)->data_as<double>());
      for (int64_t i = 0; i < model; ++i)
        ASSERT_EQ(w[i], w1[i]) << name << " model element " << i << ", step " << step;
    }
  }
  EXPECT_EQ(a.weights_digest(), b.weights_digest());
}

// The step breakdown is exclusive time per phase: the parts never add up to more than the step,
// and to within 5% of it (only the bookkeeping outside the profiled region is missing) in the
// best of 4 steps: a loaded machine may preempt the process outside the profiled region in a
// step, not in every step, while a phase left out of the breakdown is missing from all of them.
// Each MoE phase shows up.
TEST(Train, StepBreakdownAddsUpToTheStepTime) {
  cli::TrainFlags f = short_run_flags(10);
  train::Trainer trainer(f.model, f.train);
  double best_covered = 0;
  for (int i = 0; i < 4; ++i) {
    StepMetrics m = trainer.train_step();
    double sum = 0;
    for (double s : m.phase_seconds) sum += s;
    EXPECT_LE(sum, m.seconds * (1 + 1e-9)) << "iteration " << m.iteration;
    best_covered = std::max(best_covered, sum / m.seconds);
    for (Phase p : {Phase::Gemm, Phase::Attention, Phase::Router, Phase::Permute, Phase::Optimizer,
                    Phase::Other}) {
      EXPECT_GT(m.phase_seconds[static_cast<int>(p)], 0.0) << phase_name(p);
    }
    EXPECT_EQ(m.phase_seconds[static_cast<int>(Phase::Communication)], 0.0);  // one rank
    EXPECT_GT(m.mem_bytes[static_cast<int>(MemKind::OptimizerState)], 0);
  }
  EXPECT_GT(best_covered, 0.95);
}

TEST(Train, BadConfigsStopBeforeTraining) {
  cli::TrainFlags f = short_run_flags(10);
  f.train.global_batch = 6;
  f.train.micro_batch = 4;
  try {
    cli::finalize_train_flags(f);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--global-batch-size=6"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore
