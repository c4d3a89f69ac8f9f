// The numeric guard on one rank, driven by hand over a tiny model's registry and gradient
// buckets: Megatron's is_unexpectedly_large history (the first N finite values set the maximum,
// then >= factor x max is flagged), a non-finite loss or gradient stopping with exit code 17 and
// naming the micro-batch or the parameter, the veto the optimizer reads, spikes skipped or
// stopping with code 18, and the checks that are off raising nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cli/train_flags.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "model/gpt_model.h"
#include "parallel/grad_buckets.h"
#include "train/numeric_guard.h"

namespace moecore {

using testing::host;
namespace {

using train::LargeValueHistory;
using train::NumericFault;
using train::NumericGuard;
using train::NumericGuardConfig;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

cli::TrainFlags small_flags() {
  cli::TrainFlags f = cli::tiny_train_flags();
  f.vocab_size = 64;
  f.make_vocab_size_divisible_by = 64;
  f.model.hidden = 16;
  f.model.num_heads = 2;
  f.model.seq_length = 8;
  f.model.ffn_hidden = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 8;
  f.train.micro_batch = 2;
  f.train.global_batch = 2;
  cli::finalize_train_flags(f);
  return f;
}

TEST(LargeValueHistory, MegatronSamplesThenFlagsFactorTimesTheMax) {
  LargeValueHistory h(3, 10);
  EXPECT_TRUE(std::isinf(h.threshold()));
  h.observe(2);
  h.observe(kNaN);  // not a sample
  h.observe(-5);    // magnitudes
  EXPECT_TRUE(std::isinf(h.threshold()));
  h.observe(std::numeric_limits<double>::infinity());  // not a sample
  h.observe(1);
  EXPECT_EQ(h.observed(), 3);
  EXPECT_EQ(h.threshold(), 50);
  h.observe(1000);  // after the window the maximum is fixed
  EXPECT_EQ(h.max(), 5);
  EXPECT_EQ(h.threshold(), 50);
}

// A tiny model's registry and buckets, the guard on its hook, and one hand-driven step.
struct GuardRig {
  cli::TrainFlags f = small_flags();
  model::GPTModel<float> m{f.model, 2, 7};
  parallel::GradBuckets buckets{m.params(), m.grad_stages(), nullptr, nullptr,
                                parallel::GradReduceConfig{}};
  NumericGuard guard;
  int64_t iteration = 0;
  double loss = 0;

  explicit GuardRig(const NumericGuardConfig& cfg)
      : guard(cfg, cpu_exec(), m.params(), buckets, nullptr, 0) {
    buckets.set_before_reduce([this](size_t b) { guard.check_bucket(b); });
  }
  void set_grads(float v) {
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      float* g = static_cast<float*>(host(m.params().flat_grad(k)));
      for (int64_t i = 0; i < m.params().numel(k); ++i) g[i] = v;
    }
  }
  // Checks the loss and every bucket (the trainer's order), then reads the flags.
  bool step(double loss_value, float grad = 0.01f, const char* nan_param = nullptr) {
    ++iteration;
    guard.begin_step(iteration);
    loss = loss_value;
    guard.check_loss(0, &loss);
    set_grads(grad);
    if (nan_param) host(m.params().get(nan_param).grad_as<float>())[1] = std::nanf("");
    buckets.arm();
    buckets.finish();
    guard.combine();
    return guard.after_step(iteration, {loss});
  }
  bool vetoed() const {
    const int32_t* v = host(guard.veto());
    for (int64_t i = 0; i < guard.veto_count(); ++i) {
      if (v[i] != 0) return true;
    }
    return false;
  }
};

TEST(NumericGuard, CleanStepsRaiseNothing) {
  GuardRig r{NumericGuardConfig{}};
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(r.step(5.0 + i));
    EXPECT_FALSE(r.vetoed());
  }
}

TEST(NumericGuard, NonFiniteGradientStopsNamingRankIterationAndParameter) {
  GuardRig r{NumericGuardConfig{}};
  EXPECT_FALSE(r.step(4.0));
  const std::string name = r.m.params().params()[1].name();
  try {
    r.step(4.0, 0.01f, name.c_str());
    ADD_FAILURE() << "no stop for a NaN gradient";
  } catch (const NumericFault& e) {
    EXPECT_EQ(e.exit_code(), train::kExitNonFinite);
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0, iteration 2"), std::string::npos) << what;
    EXPECT_NE(what.find("'" + name + "'"), std::string::npos) << what;
    EXPECT_NE(what.find("before the data-parallel reduction"), std::string::npos) << what;
    EXPECT_NE(e.summary().find("exit code 17"), std::string::npos) << e.summary();
  }
  EXPECT_TRUE(r.vetoed());  // the optimizer skipped the update
}

TEST(NumericGuard, NonFiniteLossStopsNamingTheMicroBatch) {
  for (double bad : {kNaN, std::numeric_limits<double>::infinity()}) {
    GuardRig r{NumericGuardConfig{}};
    try {
      r.step(bad);
      ADD_FAILURE() << "no stop for a loss of " << bad;
    } catch (const NumericFault& e) {
      EXPECT_EQ(e.exit_code(), 17);
      EXPECT_NE(std::string(e.what()).find("the loss of micro-batch 0 is"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(r.vetoed());
  }
}

TEST(NumericGuard, ChecksOffRaiseNothing) {
  NumericGuardConfig cfg;
  cfg.check_nan = false;
  GuardRig r{cfg};
  EXPECT_FALSE(r.step(kNaN, 0.01f, r.m.params().params()[0].name().c_str()));
  EXPECT_FALSE(r.vetoed());
}

TEST(NumericGuard, SpikyLossSkippedOrStopping) {
  for (bool skip : {true, false}) {
    SCOPED_TRACE(skip);
    NumericGuardConfig cfg;
    cfg.check_spiky_loss = true;
    cfg.skip_spiky_steps = skip;
    cfg.samples = 3;
    GuardRig r{cfg};
    for (double l : {1.0, 3.0, 2.0}) EXPECT_FALSE(r.step(l));  // the window: max 3
    EXPECT_FALSE(r.step(29.99));
    EXPECT_FALSE(r.vetoed());
    if (skip) {
      EXPECT_TRUE(r.step(30.0));  // >= 10 x 3
      EXPECT_TRUE(r.vetoed());
      EXPECT_EQ(r.guard.skipped_iteration(), 5);
      EXPECT_NE(r.guard.skipped_summary().find("iteration 5 skipped"), std::string::npos);
      EXPECT_FALSE(r.step(2.0));  // and the run goes on
    } else {
      try {
        r.step(-31.0);
        ADD_FAILURE() << "no stop for a spiky loss";
      } catch (const NumericFault& e) {
        EXPECT_EQ(e.exit_code(), train::kExitSpike);
        EXPECT_NE(std::string(e.what()).find("spiky loss: micro-batch 0 loss -31"),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(NumericGuard, LargeGradientsFlaggedAgainstTheBucketNormHistory) {
  NumericGuardConfig cfg;
  cfg.check_large_grads = true;
  cfg.skip_spiky_steps = true;
  cfg.samples = 2;  // two bucket norms: the first step's
  GuardRig r{cfg};
  ASSERT_GE(r.buckets.buckets().size(), 2u);
  EXPECT_FALSE(r.step(1.0, 0.01f));
  EXPECT_FALSE(r.step(1.0, 0.05f));  // 5x: below 10x
  EXPECT_FALSE(r.vetoed());
  EXPECT_TRUE(r.step(1.0, 1.0f));  // 100x
  EXPECT_TRUE(r.vetoed());
}

TEST(NumericGuard, SkipNeedsASpikeCheck) {
  NumericGuardConfig cfg;
  cfg.skip_spiky_steps = true;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.check_large_grads = true;
  EXPECT_NO_THROW(cfg.validate());
  cfg.samples = 0;
  EXPECT_THROW(cfg.validate(), Error);
}

}  // namespace
}  // namespace moecore
