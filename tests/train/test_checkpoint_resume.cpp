// Checkpoints through the trainer: N steps, save, a fresh trainer loads, N more steps == an
// uninterrupted 2N-step run, bitwise (losses, grad norms, weights), with jitter, z-loss, the
// expert bias and quantile balancing in the run state, and the two runs' checkpoints the same
// bytes (`moecore checkpoint compare`); a weights-only load, whose checkpoint differs in the
// AdamW moments only; and a checkpoint of another model is refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint_command.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors_writer.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "nn/param_registry.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

cli::TrainFlags resume_flags(int64_t iters, bool quantile, bool megatron_model = false) {
  cli::TrainFlags f = megatron_model ? cli::megatron_model_train_flags() : cli::tiny_train_flags();
  f.vocab_size = 64;
  f.model.hidden = 32;
  f.model.seq_length = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 32;
  f.model.moe.router.z_loss_coeff = 1e-3;
  f.model.moe.router.input_jitter_eps = 0.01;
  if (quantile) {
    f.router.load_balancing = {"quantile_balancing"};
    f.model.moe.router.aux_loss_coeff = 0;  // balances without a loss
  } else {
    f.router.score_function = "sigmoid";
    f.model.moe.router.enable_expert_bias = true;
    f.model.moe.router.bias_update_rate = 1e-3;
  }
  f.make_vocab_size_divisible_by = 64;
  f.train.train_iters = iters;
  f.train.micro_batch = 4;
  f.train.global_batch = 8;
  f.train.log_interval = 1000;
  f.train.lr.warmup_steps = 2;
  f.train.peak_gflops = 100;  // skip the start-up GEMM probe
  cli::finalize_train_flags(f);
  return f;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("moecore_resume." + std::to_string(::getpid()) + "." + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The third case is Megatron's default model (GeLU, biases, LayerNorm, learned positions) with
// hidden and attention dropout 0.1: the masks follow the iteration, so a resumed run draws the
// uninterrupted run's. The fourth adds two multi-token prediction depths (their MoE layers'
// expert biases in the run state, their losses compared too).
TEST(CheckpointResume, SaveLoadContinueEqualsAnUninterruptedRunBitwise) {
  for (int run = 0; run < 4; ++run) {
    const bool quantile = run == 1, megatron_model = run == 2, mtp = run == 3;
    SCOPED_TRACE(megatron_model ? "Megatron's default model with dropout"
                 : quantile     ? "quantile balancing"
                 : mtp          ? "expert bias and MTP"
                                : "expert bias");
    cli::TrainFlags f = resume_flags(6, quantile, megatron_model);
    if (mtp) f.model.mtp_num_layers = 2;
    const std::string name = megatron_model ? "megatron" : quantile ? "quantile" : mtp ? "mtp" : "bias";
    const fs::path dir = fresh_dir(name);
    train::Trainer whole(f.model, f.train);
    std::vector<train::StepMetrics> ref;
    for (int i = 0; i < 6; ++i) ref.push_back(whole.train_step());

    train::Trainer first(f.model, f.train);
    for (int i = 0; i < 3; ++i) first.train_step();
    first.save_checkpoint(dir);
    EXPECT_EQ(ckpt::read_tracker(dir), 3);

    train::Trainer second(f.model, f.train);
    second.load_checkpoint(dir);
    EXPECT_EQ(second.iteration(), 3);
    EXPECT_EQ(second.consumed_train_samples(), first.consumed_train_samples());
    EXPECT_EQ(second.weights_digest(), first.weights_digest());
    for (int i = 3; i < 6; ++i) {
      const train::StepMetrics m = second.train_step();
      EXPECT_EQ(m.iteration, ref[i].iteration);
      EXPECT_EQ(m.lm_loss, ref[i].lm_loss) << "iteration " << i + 1;
      EXPECT_EQ(m.mtp_loss, ref[i].mtp_loss) << "iteration " << i + 1;
      EXPECT_EQ(m.grad_norm, ref[i].grad_norm) << "iteration " << i + 1;
      EXPECT_EQ(m.lr, ref[i].lr) << "iteration " << i + 1;
    }
    if (mtp) {
      EXPECT_GT(ref.back().mtp_loss[1], 0.0);
      EXPECT_NE(second.model().params().find("mtp.layers.1.eh_proj.weight"), nullptr);
      EXPECT_EQ(second.model().routers().size(), 4u) << "the decoder's two, the depths' two";
    }
    EXPECT_EQ(second.weights_digest(), whole.weights_digest());
    // Their checkpoints of iteration 6 too: weights, AdamW moments and the routers' expert bias
    // or quantile beta, byte for byte (`moecore checkpoint compare`).
    const fs::path whole_dir = fresh_dir(name + "_whole");
    second.save_checkpoint(dir);
    whole.save_checkpoint(whole_dir);
    EXPECT_EQ(ckpt::compare_checkpoints(dir, whole_dir), std::vector<std::string>{});
    fs::remove_all(dir);
    fs::remove_all(whole_dir);
  }
}

// Without the optimizer state the weights and the data position still load; the moments start
// from zero, so the next step differs from the uninterrupted run's.
TEST(CheckpointResume, WeightsOnlyLoadKeepsTheWeightsNotTheMoments) {
  const cli::TrainFlags f = resume_flags(4, false);
  const fs::path dir = fresh_dir("weights_only");
  train::Trainer a(f.model, f.train);
  for (int i = 0; i < 2; ++i) a.train_step();
  a.save_checkpoint(dir);
  train::Trainer b(f.model, f.train);
  train::Trainer::LoadOptions weights_only;
  weights_only.optim = false;
  b.load_checkpoint(dir, weights_only);
  EXPECT_EQ(b.weights_digest(), a.weights_digest());
  // Saved again at once, b differs from a's checkpoint in the moments only, and
  // `moecore checkpoint compare` names each of them (two runs that differ, not a corrupt file).
  const fs::path b_dir = fresh_dir("weights_only_b");
  b.save_checkpoint(b_dir);
  const auto is_moment = [](const std::string& line) {
    return line.rfind("'exp_avg.", 0) == 0 || line.rfind("'exp_avg_sq.", 0) == 0;
  };
  std::vector<std::string> diff = ckpt::compare_checkpoints(dir, b_dir);
  int64_t moments = 0;
  const ckpt::CheckpointReader saved(ckpt::iteration_dir(dir, 2));
  for (const ckpt::GlobalTensor& t : saved.manifest().tensors) moments += is_moment("'" + t.name);
  EXPECT_GT(moments, 10);
  EXPECT_EQ(static_cast<int64_t>(diff.size()), moments);
  for (const std::string& d : diff) EXPECT_TRUE(is_moment(d)) << d;
  EXPECT_EQ(ckpt::compare_checkpoints(dir, b_dir, {"exp_avg.", "exp_avg_sq."}),
            std::vector<std::string>{});
  const train::StepMetrics ma = a.train_step(), mb = b.train_step();
  EXPECT_EQ(ma.lm_loss, mb.lm_loss);  // the same weights see the same batch
  EXPECT_NE(ma.grad_norm, 0.0);
  EXPECT_NE(a.weights_digest(), b.weights_digest());  // fresh moments, another update
  // One step later the weights differ too: the router and the experts among them.
  a.save_checkpoint(dir);
  b.save_checkpoint(b_dir);
  diff = ckpt::compare_checkpoints(dir, b_dir, {"exp_avg.", "exp_avg_sq."});
  const auto named = [&](const std::string& tensor) {
    for (const std::string& d : diff)
      if (d.rfind("'" + tensor + "': ", 0) == 0) return true;
    return false;
  };
  EXPECT_TRUE(named("decoder.layers.0.mlp.router.weight")) << ::testing::PrintToString(diff);
  EXPECT_TRUE(named("decoder.layers.1.mlp.experts.linear_fc1.weight"))
      << ::testing::PrintToString(diff);
  fs::remove_all(dir);
  fs::remove_all(b_dir);
}

TEST(CheckpointResume, RefusesACheckpointOfAnotherModel) {
  const cli::TrainFlags f = resume_flags(4, false);
  const fs::path dir = fresh_dir("other_model");
  train::Trainer a(f.model, f.train);
  a.train_step();
  a.save_checkpoint(dir);
  cli::TrainFlags g = resume_flags(4, false);
  g.model.moe.ffn_hidden = 48;
  cli::finalize_train_flags(g);
  train::Trainer b(g.model, g.train);
  const std::string e = testing::error_of([&] { b.load_checkpoint(dir); });
  EXPECT_NE(e.find("holds another model:\n  --moe-ffn-hidden-size: 32 in the checkpoint, 48 in "
                   "this run\nA checkpoint loads into the model that wrote it, in any layout"),
            std::string::npos)
      << e;
  EXPECT_FALSE(b.load_checkpoint(dir / "nothing").has_value());  // no tracker: nothing to load
  // GeLU (F wide fc1) vs SwiGLU, and the same shapes computing another function: RoPE vs none.
  cli::TrainFlags h = resume_flags(4, false);
  h.swiglu = false;
  h.position_embedding_type = "none";
  cli::finalize_train_flags(h);
  train::Trainer c(h.model, h.train);
  const std::string e2 = testing::error_of([&] { c.load_checkpoint(dir); });
  EXPECT_NE(e2.find("--position-embedding-type: \"rope\" in the checkpoint, \"none\" in this run"),
            std::string::npos)
      << e2;
  EXPECT_NE(e2.find("(the MLP activation): \"swiglu\" in the checkpoint, \"gelu\" in this run"),
            std::string::npos)
      << e2;
  fs::remove_all(dir);
}

// The model signature records the model's vocabulary, not the padding: TP 1, 2 and 4 (and any
// --make-vocab-size-divisible-by) sign alike; another vocabulary is another model; a checkpoint
// that recorded the padded vocabulary (written while the padding took part in the softmax) is
// refused with its own message, naming the key and what to do.
TEST(CheckpointSignature, RecordsTheModelsVocabularyNotThePadding) {
  ModelConfig m;
  m.vocab_size = 250;
  m.padded_vocab_size = 300;
  const nlohmann::json one = train::model_signature(m);
  EXPECT_EQ(one.at("--vocab-size"), 250);
  EXPECT_FALSE(one.contains("--vocab-size (padded)"));
  for (int64_t padded : {0, 250, 400, 512}) {
    m.padded_vocab_size = padded;
    EXPECT_EQ(train::model_signature(m), one) << "padded to " << padded;
    EXPECT_NO_THROW(train::check_same_model(one, train::model_signature(m), "dir"));
  }
  m.vocab_size = 256;
  std::string e =
      testing::error_of([&] { train::check_same_model(one, train::model_signature(m), "dir"); });
  EXPECT_NE(e.find("--vocab-size: 250 in the checkpoint, 256 in this run"), std::string::npos) << e;
  nlohmann::json old = one;
  old.erase("--vocab-size");
  old["--vocab-size (padded)"] = 512;
  e = testing::error_of([&] { train::check_same_model(old, train::model_signature(m), "dir"); });
  EXPECT_NE(e.find("'dir' records the padded vocabulary (--vocab-size (padded) = 512)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("train it again with this build"), std::string::npos) << e;
}

// Multi-latent attention is part of the model: an MLA checkpoint does not load into a QKV
// attention run or one with other MLA ranks, the refusal naming the flags; the QKV attention's
// kv_channels and query groups, which MLA does not read, are not compared.
TEST(CheckpointSignature, RecordsMultiLatentAttention) {
  ModelConfig m;
  m.multi_latent_attention = true;
  m.mla.q_lora_rank = 16;
  const nlohmann::json mla = train::model_signature(m);
  EXPECT_EQ(mla.at("--kv-lora-rank"), m.mla.kv_lora_rank);
  EXPECT_FALSE(mla.contains("--kv-channels"));
  m.num_query_groups = m.num_heads;
  EXPECT_NO_THROW(train::check_same_model(mla, train::model_signature(m), "dir"));
  m.mla.kv_lora_rank += 8;
  m.mla.q_lora_rank = 0;
  std::string e =
      testing::error_of([&] { train::check_same_model(mla, train::model_signature(m), "dir"); });
  EXPECT_NE(e.find("--kv-lora-rank: 32 in the checkpoint, 40 in this run"), std::string::npos) << e;
  EXPECT_NE(e.find("--q-lora-rank (0: a direct q projection): 16 in the checkpoint, 0 in this run"),
            std::string::npos)
      << e;
  m.multi_latent_attention = false;
  e = testing::error_of([&] { train::check_same_model(mla, train::model_signature(m), "dir"); });
  EXPECT_NE(e.find("--multi-latent-attention: true in the checkpoint, false in this run"),
            std::string::npos)
      << e;
}

// A gated shared expert and the attention output bias: their tensors save and load with the
// rest (save, load, continue == the uninterrupted run, bitwise), and the run state records both
// options, so a model without them refuses the checkpoint naming the flags.
TEST(CheckpointResume, SharedExpertGateAndOutputBiasResumeAndAreChecked) {
  auto with_options = [](bool on) {
    cli::TrainFlags f = resume_flags(4, false);
    f.model.moe.shared_ffn_hidden = 16;
    f.model.moe.shared_expert_gate = on;
    f.model.add_attention_output_bias = on;
    f.model.validate();
    return f;
  };
  const cli::TrainFlags f = with_options(true);
  const fs::path dir = fresh_dir("gate_bias");
  train::Trainer whole(f.model, f.train);
  std::vector<train::StepMetrics> ref;
  for (int i = 0; i < 4; ++i) ref.push_back(whole.train_step());
  train::Trainer first(f.model, f.train);
  for (int i = 0; i < 2; ++i) first.train_step();
  first.save_checkpoint(dir);
  train::Trainer second(f.model, f.train);
  second.load_checkpoint(dir);
  EXPECT_EQ(second.weights_digest(), first.weights_digest());
  for (int i = 2; i < 4; ++i) {
    const train::StepMetrics m = second.train_step();
    EXPECT_EQ(m.lm_loss, ref[i].lm_loss) << "iteration " << i + 1;
    EXPECT_EQ(m.grad_norm, ref[i].grad_norm) << "iteration " << i + 1;
  }
  EXPECT_EQ(second.weights_digest(), whole.weights_digest());
  const cli::TrainFlags g = with_options(false);
  train::Trainer plain(g.model, g.train);
  const std::string e = testing::error_of([&] { plain.load_checkpoint(dir); });
  EXPECT_NE(e.find("--moe-shared-expert-gate: true in the checkpoint, false in this run"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--add-attention-output-bias: true in the checkpoint, false in this run"),
            std::string::npos)
      << e;
  fs::remove_all(dir);
}

// The run loop with --save / --load: saves every --save-interval, stops after --exit-interval
// (saving first, skipping the final evaluation), and a run resumed from the last save ends with
// the uninterrupted run's weights. No staging directory is left behind.
TEST(CheckpointResume, TheRunLoopSavesStopsAndResumes) {
  std::ostringstream log;
  cli::TrainFlags f = resume_flags(6, false);
  train::Trainer whole(f.model, f.train);
  whole.run(log);
  const fs::path dir = fresh_dir("run_loop");
  f.train.ckpt.save = dir.string();
  f.train.ckpt.save_interval = 2;
  f.train.ckpt.exit_interval = 3;
  train::Trainer a(f.model, f.train);
  EXPECT_EQ(a.run(log).size(), 3u);
  EXPECT_TRUE(a.stopped_early());
  EXPECT_NE(log.str().find("[exit] stopping after iteration 3: --exit-interval 3"),
            std::string::npos)
      << log.str();
  EXPECT_EQ(ckpt::read_tracker(dir), 3);
  for (int it : {2, 3}) EXPECT_TRUE(fs::exists(ckpt::iteration_dir(dir, it))) << it;
  EXPECT_FALSE(fs::exists(ckpt::staging_dir(dir, 3)));

  f.train.ckpt.load = dir.string();
  f.train.ckpt.exit_interval = 0;
  train::Trainer b(f.model, f.train);
  EXPECT_EQ(b.run(log).size(), 3u);  // iterations 4..6
  EXPECT_FALSE(b.stopped_early());
  EXPECT_EQ(b.weights_digest(), whole.weights_digest());
  EXPECT_EQ(ckpt::read_tracker(dir), 6);  // saved at 4, 6 (the end)
  EXPECT_TRUE(fs::exists(ckpt::iteration_dir(dir, 4)));

  // --ckpt-step: an earlier iteration; --finetune: its weights, everything else from 0.
  cli::TrainFlags g = f;
  g.train.ckpt.save.clear();
  g.train.ckpt.save_interval = 0;
  train::Trainer c(g.model, g.train);
  train::Trainer::LoadOptions finetune;
  finetune.finetune = true;
  finetune.iteration = 2;
  EXPECT_EQ(c.load_checkpoint(dir, finetune), 2);
  EXPECT_EQ(c.iteration(), 0);
  EXPECT_EQ(c.consumed_train_samples(), 0);
  EXPECT_EQ(c.model().routers().front()->steps_finished(), 0);
  // An iteration directory instead of the --save directory says which to give.
  EXPECT_NE(testing::error_of([&] {
              c.load_checkpoint(ckpt::iteration_dir(dir, 2));
            }).find("is one iteration's directory: give the directory above it"),
            std::string::npos);
  fs::remove_all(dir);
}

// --async-save: the shards are written in the background while training goes on; every save
// completes (the next one, or the end of the run, waits), and the resumed run is bitwise the
// uninterrupted one.
TEST(CheckpointResume, AsyncSavesCompleteAndResumeBitwise) {
  std::ostringstream log;
  cli::TrainFlags f = resume_flags(6, true);
  train::Trainer whole(f.model, f.train);
  whole.run(log);
  const fs::path dir = fresh_dir("async");
  f.train.ckpt.save = dir.string();
  f.train.ckpt.save_interval = 1;
  f.train.ckpt.async_save = true;
  f.train.train_iters = 3;
  train::Trainer a(f.model, f.train);
  a.run(log);
  EXPECT_EQ(a.finish_pending_save(), -1);  // none left pending
  EXPECT_EQ(ckpt::read_tracker(dir), 3);
  for (int it : {1, 2, 3}) {
    EXPECT_TRUE(fs::exists(ckpt::iteration_dir(dir, it) / ckpt::kManifestFile)) << it;
    EXPECT_FALSE(fs::exists(ckpt::staging_dir(dir, it))) << it;
  }
  f.train.train_iters = 6;
  f.train.ckpt.load = dir.string();
  train::Trainer b(f.model, f.train);
  b.run(log);
  EXPECT_EQ(b.weights_digest(), whole.weights_digest());
  EXPECT_EQ(ckpt::read_tracker(dir), 6);
  fs::remove_all(dir);
}

// --moe-use-upcycling: a dense model's checkpoint into a MoE model of the same sizes, every
// expert a copy of its layer's dense MLP. With softmax after the top-k the combine weights sum
// to 1, so the MoE model's loss on a batch is the dense model's (f64: summation order only), in
// a model with a dense layer left dense too; then it trains. A MoE checkpoint is refused.
TEST(CheckpointResume, UpcyclingStartsAMoeModelAtTheDenseModelsLoss) {
  cli::TrainFlags dense_flags = resume_flags(4, false);
  dense_flags.router = {};
  dense_flags.model.num_experts = 0;
  dense_flags.model.moe = {};
  dense_flags.model.ffn_hidden = 32;
  cli::finalize_train_flags(dense_flags);
  const fs::path dir = fresh_dir("upcycling");
  train::BasicTrainer<double> dense(dense_flags.model, dense_flags.train);
  for (int i = 0; i < 2; ++i) dense.train_step();
  dense.save_checkpoint(dir);

  cli::TrainFlags moe_flags = resume_flags(4, false);
  moe_flags.model.ffn_hidden = 32;
  moe_flags.model.moe.ffn_hidden = 32;
  moe_flags.moe_layer_freq = "[1,0]";
  cli::finalize_train_flags(moe_flags);
  train::BasicTrainer<double> moe(moe_flags.model, moe_flags.train);
  train::Trainer::LoadOptions up;
  up.upcycle = true;
  EXPECT_EQ(moe.load_checkpoint(dir, up), 2);
  EXPECT_EQ(moe.iteration(), 0);

  const int64_t B = moe_flags.train.micro_batch, S = moe_flags.model.seq_length;
  std::vector<int32_t> ids(static_cast<size_t>(B * S)), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + 3) % 64);
    targets[i] = static_cast<int32_t>((i * 5 + 1) % 64);
  }
  dense.model().set_training(false);
  moe.model().set_training(false);
  const double want = dense.model().forward(ids.data(), targets.data());
  const double got = moe.model().forward(ids.data(), targets.data());
  EXPECT_NEAR(got, want, 1e-12 * want);
  moe.model().set_training(true);
  EXPECT_TRUE(std::isfinite(moe.train_step().lm_loss));

  // Upcycling a MoE checkpoint, or loading the dense one without upcycling, is refused.
  const fs::path moe_dir = fresh_dir("upcycling_moe");
  moe.save_checkpoint(moe_dir);
  train::BasicTrainer<double> again(moe_flags.model, moe_flags.train);
  EXPECT_NE(testing::error_of([&] {
              again.load_checkpoint(moe_dir, up);
            }).find("--moe-use-upcycling loads a dense checkpoint"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              again.load_checkpoint(dir);
            }).find("--num-experts: 0 in the checkpoint, 4 in this run"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(moe_dir);
}

// --no-save-optim writes the weights only; loading that with the optimizer state says how to
// load it instead.
TEST(CheckpointResume, AWeightsOnlyCheckpointNeedsNoLoadOptim) {
  const cli::TrainFlags f = resume_flags(4, false);
  const fs::path dir = fresh_dir("no_save_optim");
  train::Trainer a(f.model, f.train);
  a.train_step();
  a.save_checkpoint(dir, /*save_optim=*/false);
  EXPECT_FALSE(fs::exists(ckpt::iteration_dir(dir, 1) / ckpt::shard_name("optim", 0)));
  train::Trainer b(f.model, f.train);
  EXPECT_NE(testing::error_of([&] { b.load_checkpoint(dir); })
                .find("was saved without the optimizer state (--no-save-optim): load it with "
                      "--no-load-optim or --finetune"),
            std::string::npos);
  train::Trainer::LoadOptions weights_only;
  weights_only.optim = false;
  EXPECT_EQ(b.load_checkpoint(dir, weights_only), 1);
  EXPECT_EQ(b.weights_digest(), a.weights_digest());
  EXPECT_EQ(b.iteration(), 1);
  fs::remove_all(dir);
}

// Tensor and expert tensor parallelism through the trainer's slice rules (train/
// checkpoint_state.h), on hand-built parameters of a layout with attention TP 2 x DP 2 and, on
// the same 4 ranks, experts EP 2 x ETP 2: a column-parallel SwiGLU fc1 (rows in 2 parts), a
// row-parallel fc2 (dimension 1), a replicated norm, a router weight with partial gradients,
// expert weights split along the experts and along their rows or columns, and an expert bias
// replicated over ETP. The ranks holding copies of a slice take turns writing it (writes_slice),
// each its local values as they are: every distinct slice is written exactly once (the merged
// manifest validates),
// and every rank of other layouts (one rank; TP 4 with EP 4 x ETP 1; TP 1 with EP 1 x ETP 4)
// reads its slices back equal to the values it initializes (a pure function of the global
// index), byte for byte.
struct TpLayout {
  int tp, ep, etp;  // 4 ranks: dense TP x DP, experts EP x ETP x EDP
  int world = 4;
};

// Rank r's parameters at `l` (dense: tp rank = r % tp; experts: etp rank = r % etp, ep rank =
// (r / etp) % ep), their values initialized, and its place in the writer groups.
struct TpRank {
  std::vector<Param> params;
  train::HolderRanks holder;
};

TpRank tp_rank(const TpLayout& l, int r) {
  const int64_t H = 4, F = 8, E = 4;
  const TpShard tp{r % l.tp, l.tp}, etp{r % l.etp, l.etp};
  const int ep_rank = (r / l.etp) % l.ep;
  const ParamSlice experts{0, ep_rank * (E / l.ep), E / l.ep};
  const auto expert_slice = [&](int dim, int64_t extent, int parts) {
    ParamSlice s = experts;
    const ParamSlice t = etp.slice(dim, extent, parts);
    if (!t.whole()) s.second = t.first();
    if (l.ep == 1) {  // ETP alone: its dimension is the first
      s = t;
    }
    return s;
  };
  const auto spec = [](std::string name, std::vector<int64_t> shape, ParamSlice slice, TpRole role,
                       ParamKind kind = ParamKind::Dense) {
    ParamSpec p;
    p.name = std::move(name);
    p.global_shape = std::move(shape);
    p.slice = slice;
    p.tp_role = role;
    p.kind = kind;
    return p;
  };
  const std::vector<ParamSpec> specs = {
      spec("mlp.linear_fc1.weight", {2 * F, H}, tp.slice(0, 2 * F, 2), TpRole::Sharded),
      spec("mlp.linear_fc2.weight", {H, F}, tp.slice(1, F), TpRole::Sharded),
      spec("input_layernorm.weight", {H}, {}, TpRole::Replicated),
      spec("mlp.router.weight", {E, H}, {}, TpRole::ReplicatedPartialGrad),
      spec("mlp.experts.linear_fc1.weight", {E, 2 * F, H}, expert_slice(1, 2 * F, 2),
           TpRole::Sharded, ParamKind::Expert),
      spec("mlp.experts.linear_fc2.weight", {E, H, F}, expert_slice(2, F, 1), TpRole::Sharded,
           ParamKind::Expert),
      spec("mlp.experts.bias", {E, H}, l.ep > 1 ? experts : ParamSlice{}, TpRole::Replicated,
           ParamKind::Expert),
  };
  TpRank out;
  for (const ParamSpec& sp : specs) {
    Param p;
    p.spec = sp;
    out.params.push_back(p);
  }
  const int dp = l.world / l.tp, edp = l.world / (l.ep * l.etp);
  out.holder.dp_cp = (r / l.tp) % dp;
  out.holder.dp_cp_size = dp;
  out.holder.tp = r % l.tp;
  out.holder.tp_size = l.tp;
  out.holder.expt_dp = edp > 1 ? r / (l.ep * l.etp) : 0;
  out.holder.expt_dp_size = edp;
  out.holder.expt_tp = r % l.etp;
  out.holder.expt_tp_size = l.etp;
  out.holder.ep = ep_rank;
  out.holder.world = r;
  out.holder.world_size = l.world;
  return out;
}

std::vector<float> init_values(const Param& p) {
  std::vector<float> v(static_cast<size_t>(p.local_numel()));
  param_init_f32(p, 1234, 0, v.data(), p.local_numel());
  return v;
}

TEST(CheckpointResume, TensorParallelSlicesAreWrittenOnceAndReadIntoAnyLayout) {
  const fs::path save = fresh_dir("tp_slices");
  const TpLayout saved{2, 2, 2};
  const fs::path dir = ckpt::iteration_dir(save, 5);
  fs::create_directories(dir);
  std::vector<ckpt::Manifest> parts;
  std::map<std::string, int> writers;
  std::vector<int> dense_per_rank(saved.world, 0);
  for (int r = 0; r < saved.world; ++r) {
    const TpRank rank = tp_rank(saved, r);
    ckpt::Manifest part;
    part.iteration = 5;
    part.world_size = saved.world;
    ckpt::SafetensorsWriter shard;
    const std::string file = ckpt::shard_name("model", r);
    for (size_t i = 0; i < rank.params.size(); ++i) {
      const Param& p = rank.params[i];
      if (!train::writes_slice(p.spec, static_cast<int>(i), rank.holder)) continue;
      ++writers[p.name()];
      if (p.spec.kind == ParamKind::Dense) ++dense_per_rank[r];
      const std::vector<float> v = init_values(p);
      EXPECT_EQ(train::slice_shape(p.spec.global_shape, p.spec.slice), p.local_shape());
      shard.add(p.name(), "F32", p.local_shape(), std::as_bytes(std::span<const float>(v)));
      part.tensors.push_back(
          {p.name(), "F32", p.spec.global_shape, {train::checkpoint_slice(p.spec.slice, file)}});
    }
    if (shard.num_tensors() > 0) part.files = {ckpt::write_shard(dir, file, r, shard)};
    parts.push_back(ckpt::parse_manifest_part(part.to_json_text(), "part"));
  }
  // Each distinct slice once: each TP rank's own slice, one copy of a replicated tensor, each
  // (EP, ETP) rank's expert slice, each EP rank's bias replicated over ETP; and the dense writes
  // spread over the data-parallel copies (DP 2 here): every rank writes some, not only DP rank 0.
  EXPECT_EQ(writers, (std::map<std::string, int>{{"mlp.linear_fc1.weight", 2},
                                                 {"mlp.linear_fc2.weight", 2},
                                                 {"input_layernorm.weight", 1},
                                                 {"mlp.router.weight", 1},
                                                 {"mlp.experts.linear_fc1.weight", 4},
                                                 {"mlp.experts.linear_fc2.weight", 4},
                                                 {"mlp.experts.bias", 2}}));
  for (int r = 0; r < saved.world; ++r) {
    EXPECT_GT(dense_per_rank[r], 0) << "rank " << r << " writes no dense slice";
  }
  ckpt::write_manifest(dir, ckpt::merge_manifest_parts(parts, dir.string()));
  ckpt::CheckpointReader reader(dir);
  EXPECT_EQ(reader.manifest().needed_version(), ckpt::kManifestVersionParted);
  for (const TpLayout& l : {TpLayout{2, 2, 2}, TpLayout{1, 1, 1}, TpLayout{4, 4, 1},
                            TpLayout{1, 1, 4}, TpLayout{2, 4, 1}, TpLayout{1, 2, 2}}) {
    for (int r = 0; r < l.world; ++r) {
      for (const Param& p : tp_rank(l, r).params) {
        const std::vector<float> want = init_values(p);
        std::vector<float> got(want.size());
        reader.read(p.name(), "F32", train::checkpoint_slice(p.spec.slice),
                    std::as_writable_bytes(std::span<float>(got)));
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
            << p.name() << " at TP " << l.tp << ", EP " << l.ep << " x ETP " << l.etp
            << ", rank " << r;
      }
    }
  }
  // A replicated parameter written by a second TP rank too, as a wrong role would make it:
  // refused, naming it.
  ckpt::Manifest twice = ckpt::merge_manifest_parts(parts, dir.string());
  for (ckpt::GlobalTensor& t : twice.tensors) {
    if (t.name == "input_layernorm.weight") t.slices.push_back({twice.files[1].file});
  }
  const std::string msg = testing::error_of([&] { ckpt::validate_manifest(twice, "m"); });
  EXPECT_NE(msg.find("tensor 'input_layernorm.weight' has a whole-tensor slice and 1 others"),
            std::string::npos)
      << msg;
  fs::remove_all(save);
}

// The distributed optimizer's pieces, written without gathering: on the same hand-built
// parameters at TP 2 x DP 2 and EP 2 x ETP 2, each slice cut into the pieces of its data-parallel
// group (3 pieces per copy: cuts anywhere, some empty), each piece written by its owner
// (owned_piece: flat for a contiguous slice, ranged for the others; of a replicated parameter the
// group of one TP rank) without any other rank's data. The merged manifest validates (every
// element once), and every rank of every layout reads back its local tensor, and its own pieces
// of another cut, byte for byte.
std::vector<std::pair<int64_t, int64_t>> dp_pieces(int64_t n, int group, int salt) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t lo = 0;
  for (int k = 0; k < group; ++k) {
    const int64_t hi =
        k + 1 == group ? n : std::min(n, lo + (n * (k + 1 + salt % 2)) / (group + 1));
    out.push_back({lo, std::max(lo, hi) - lo});
    lo = std::max(lo, hi);
  }
  return out;
}

TEST(CheckpointResume, OwnedPiecesAreWrittenByTheirOwnersAndReadIntoAnyLayout) {
  const fs::path save = fresh_dir("owned_pieces");
  const TpLayout saved{2, 2, 2};
  const fs::path dir = ckpt::iteration_dir(save, 5);
  fs::create_directories(dir);
  std::vector<ckpt::Manifest> parts;
  int file_rank = 0;
  bool ranged = false;
  for (int r = 0; r < saved.world; ++r) {
    const TpRank rank = tp_rank(saved, r);
    for (int q = 0; q < 3; ++q) {  // this model-parallel rank's data-parallel group of 3
      ckpt::Manifest part;
      part.iteration = 5;
      part.world_size = 3 * saved.world;
      ckpt::SafetensorsWriter shard;
      const std::string file = ckpt::shard_name("optim", file_rank);
      for (size_t i = 0; i < rank.params.size(); ++i) {
        const Param& p = rank.params[i];
        // A replicated parameter's pieces come from the group of one (expert) TP rank; whether
        // it is this rank's depends on the index, and its dp_cp rank plays no part.
        if (!train::writes_owned_pieces(p.spec, static_cast<int>(i), rank.holder)) continue;
        // The slice's data-parallel copies (dense: dp_cp, experts: expt_dp) each own 3 of the
        // group's pieces of it.
        const bool dense = p.spec.kind == ParamKind::Dense;
        const int copies = dense ? rank.holder.dp_cp_size : rank.holder.expt_dp_size;
        const int copy = dense ? rank.holder.dp_cp : rank.holder.expt_dp;
        const auto [begin, count] =
            dp_pieces(p.local_numel(), 3 * copies, static_cast<int>(i))[3 * copy + q];
        const train::CheckpointPiece piece = train::owned_piece(p.spec, begin, count);
        if (piece.count == 0) continue;
        ranged = ranged || piece.slice.ranged();
        EXPECT_EQ(piece.slice.flat(), p.spec.slice.contiguous()) << p.name();
        const std::vector<float> v = init_values(p);
        ckpt::SliceRef slice = piece.slice;
        slice.file = file;
        const ckpt::GlobalTensor g{p.name(), "F32", train::checkpoint_shape(p.spec), {slice}};
        shard.add(p.name(), "F32", g.slice_shape(slice),
                  std::as_bytes(std::span<const float>(v).subspan(begin, piece.count)));
        part.tensors.push_back(g);
      }
      if (shard.num_tensors() > 0) part.files = {ckpt::write_shard(dir, file, file_rank, shard)};
      parts.push_back(ckpt::parse_manifest_part(part.to_json_text(), "part"));
      ++file_rank;
    }
  }
  EXPECT_TRUE(ranged);
  ckpt::write_manifest(dir, ckpt::merge_manifest_parts(parts, dir.string()));
  ckpt::CheckpointReader reader(dir, ckpt::HashCheck::OnRead);
  EXPECT_EQ(reader.manifest().needed_version(), ckpt::kManifestVersionRanged);
  for (const TpLayout& l : {TpLayout{2, 2, 2}, TpLayout{1, 1, 1}, TpLayout{4, 4, 1},
                            TpLayout{1, 1, 4}, TpLayout{2, 4, 1}}) {
    for (int r = 0; r < l.world; ++r) {
      for (const Param& p : tp_rank(l, r).params) {
        const std::vector<float> want = init_values(p);
        std::vector<float> got(want.size());
        reader.read(p.name(), "F32", train::slice_piece(p.spec).slice,
                    std::as_writable_bytes(std::span<float>(got)));
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
            << p.name() << " at TP " << l.tp << ", EP " << l.ep << " x ETP " << l.etp;
        for (const auto& [begin, count] : dp_pieces(p.local_numel(), 2, 1)) {
          const train::CheckpointPiece piece = train::owned_piece(p.spec, begin, count);
          std::vector<float> mine(static_cast<size_t>(piece.count));
          reader.read(p.name(), "F32", piece.slice, std::as_writable_bytes(std::span<float>(mine)));
          EXPECT_EQ(std::memcmp(mine.data(), want.data() + begin, mine.size() * sizeof(float)), 0)
              << p.name() << " piece [" << begin << ", +" << count << ") at TP " << l.tp;
        }
      }
    }
  }
  fs::remove_all(save);
}

// ParamSpec::model_rows: a vocabulary of 10 rows padded for TP (to 12 at TP 4, 14 at TP 2, 10 on
// one rank) is stored as [10, H] whatever the padding: each rank's slice clipped to the model
// rows (TP 4's last rank holds rows [9, 12): one is stored; at TP 2 x 7 rows the second rank's
// [7, 14) stores 3), distributed-optimizer pieces clipped too (flat of a row slice; ranged of a
// column slice), nothing for a slice all padding; any layout reads its rows back, the padding
// rows zero. So a checkpoint reshards between TP sizes whose paddings differ.
ParamSpec vocab_spec(int64_t padded, ParamSlice slice,
                     std::string name = "embedding.word_embeddings.weight") {
  ParamSpec p;
  p.name = std::move(name);
  p.global_shape = {padded, 3};
  p.slice = slice;
  p.tp_role = TpRole::Sharded;
  p.model_rows = 10;
  return p;
}

TEST(CheckpointResume, ModelRowsAreStoredAndPaddingRowsLoadAsZero) {
  EXPECT_EQ(train::checkpoint_shape(vocab_spec(12, {})), (std::vector<int64_t>{10, 3}));
  // TP 4 over 12 rows: the last rank's rows [9, 12), one model row; a padding-only slice.
  train::CheckpointPiece last = train::slice_piece(vocab_spec(12, {0, 9, 3}));
  EXPECT_EQ(last.slice.offset, 9);
  EXPECT_EQ(last.slice.length, 1);
  EXPECT_EQ(last.count, 3);
  EXPECT_EQ(train::slice_piece(vocab_spec(16, {0, 12, 4})).count, 0);
  // A flat piece of rows [9, 12) (local elements [1, 7)): clipped to global elements [28, 30).
  train::CheckpointPiece flat = train::owned_piece(vocab_spec(12, {0, 9, 3}), 1, 6);
  EXPECT_TRUE(flat.slice.flat());
  EXPECT_EQ(flat.slice.offset, 28);
  EXPECT_EQ(flat.count, 2);
  // A column slice (dimension 1) of all 12 rows: the model rows are the first 10 local rows.
  train::CheckpointPiece col = train::owned_piece(vocab_spec(12, {1, 1, 1}), 4, 20);
  EXPECT_TRUE(col.slice.ranged());
  EXPECT_EQ(col.slice.range, (ckpt::StorageRange{4, 6}));
  EXPECT_EQ(col.count, 6);
  EXPECT_NE(testing::error_of([] {
              train::slice_piece(vocab_spec(12, {0, 0, 3, 2}));
            })
                .find("is split along dimension 0 in 2 parts and has padding rows past its 10 "
                      "model rows"),
            std::string::npos);

  const fs::path save = fresh_dir("model_rows");
  const fs::path dir = ckpt::iteration_dir(save, 1);
  fs::create_directories(dir);
  // Saved at TP 4 (padded to 12), each piece in its own shard.
  std::vector<ckpt::Manifest> parts;
  int file_rank = 0;
  const auto write = [&](const ParamSpec& spec, const train::CheckpointPiece& piece) {
    Param p;
    p.spec = spec;
    const std::vector<float> v = init_values(p);
    const std::string file = ckpt::shard_name("model", file_rank);
    ckpt::Manifest part;
    part.iteration = 1;
    part.world_size = 32;
    if (piece.count > 0) {
      ckpt::SliceRef slice = piece.slice;
      slice.file = file;
      const ckpt::GlobalTensor g{spec.name, "F32", train::checkpoint_shape(spec), {slice}};
      ckpt::SafetensorsWriter shard;
      shard.add(spec.name, "F32", g.slice_shape(slice),
                std::as_bytes(std::span<const float>(v).subspan(piece.local, piece.count)));
      part.files = {ckpt::write_shard(dir, file, file_rank, shard)};
      part.tensors = {g};
    }
    parts.push_back(ckpt::parse_manifest_part(part.to_json_text(), "part"));
    ++file_rank;
  };
  // The embedding as the distributed optimizer's flat pieces (2 owners per TP slice), the same
  // rows as a run without it writes them (whole slices of dimension 0), and the output head
  // split along its 3 columns (TP 3) as ranged pieces.
  const std::string rows = "embedding.rows", head = "output_layer.weight";
  for (int r = 0; r < 4; ++r) {
    const ParamSpec spec = vocab_spec(12, {0, 3 * r, 3});
    write(spec, train::owned_piece(spec, 0, 4));
    write(spec, train::owned_piece(spec, 4, 5));
    const ParamSpec plain = vocab_spec(12, {0, 3 * r, 3}, rows);
    write(plain, train::slice_piece(plain));
    if (r < 3) {
      const ParamSpec col = vocab_spec(12, {1, r, 1}, head);
      for (const auto& [begin, count] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 7}}) {
        write(col, train::owned_piece(col, begin, count));
      }
    }
  }
  ckpt::write_manifest(dir, ckpt::merge_manifest_parts(parts, dir.string()));
  ckpt::CheckpointReader reader(dir, ckpt::HashCheck::OnRead);
  EXPECT_EQ(reader.tensor(vocab_spec(12, {}).name).shape, (std::vector<int64_t>{10, 3}));
  EXPECT_EQ(reader.tensor(head).shape, (std::vector<int64_t>{10, 3}));
  EXPECT_EQ(reader.tensor(rows).slices.size(), 4u);  // rank 3's slice holds one model row
  EXPECT_EQ(reader.tensor(rows).slices[3].length, 1);
  // Read back at TP 2 padded to 14 (7 rows each), on one rank padded to 10 and to 16, and at TP 4
  // again: the model rows are the saved values, the padding rows zero (what a load fills in).
  for (const auto& [padded, tp] :
       std::vector<std::pair<int64_t, int>>{{14, 2}, {10, 1}, {16, 1}, {12, 4}}) {
    for (int r = 0; r < tp; ++r) {
      for (const std::string& name : {vocab_spec(12, {}).name, rows, head}) {
        const ParamSlice slice = tp == 1        ? ParamSlice{}
                                 : name != head ? ParamSlice{0, r * (padded / tp), padded / tp}
                                                : ParamSlice{1, r % 3, 1};
        const ParamSpec spec = vocab_spec(padded, slice, name);
        Param p;
        p.spec = spec;
        const std::vector<float> want = init_values(p);  // zero past the model rows
        const train::CheckpointPiece piece = train::slice_piece(spec);
        std::vector<float> got(want.size(), 0.0f);
        if (piece.count > 0) {
          reader.read(spec.name, "F32", piece.slice,
                      std::as_writable_bytes(std::span<float>(got).first(piece.count)));
        }
        EXPECT_EQ(got, want) << spec.name << " padded to " << padded << ", rank " << r << " of "
                             << tp;
      }
    }
  }
  fs::remove_all(save);
}

}  // namespace
}  // namespace moecore
