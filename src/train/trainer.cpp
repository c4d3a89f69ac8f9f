#include "train/trainer.h"

#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <optional>
#include <ostream>
#include <span>
#include <sstream>
#include <type_traits>

#include "ckpt/checkpoint_dir.h"
#include "core/check.h"
#include "core/fault_injection.h"
#include "core/host_memory.h"
#include "core/sync_audit.h"
#include "data/synthetic_language.h"
#include "data/tokenizer.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/f32_matmul_precision.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/gemm_probe.h"
#include "ops/memory.h"
#include "ops/numerics_class.h"
#include "ops/router_balance.h"
#include "parallel/communicator_nccl.h"
#include "train/context_batch.h"
#include "train/exit_conditions.h"
#include "train/progress.h"

namespace moecore::train {

void check_batch_split(int64_t global_batch, int64_t micro_batch, int dp) {
  MOE_CHECK(micro_batch >= 1 && global_batch >= 1 && global_batch % micro_batch == 0,
            "[train] --global-batch-size={} must be a positive multiple of --micro-batch-size={}",
            global_batch, micro_batch);
  MOE_CHECK(dp >= 1, "[train] data-parallel size {} must be >= 1", dp);
  // Every dp rank takes the same number of whole micro-batches of the global batch.
  MOE_CHECK(global_batch % (micro_batch * dp) == 0,
            "[train] --global-batch-size={} must be a multiple of --micro-batch-size={} x "
            "data-parallel size {} = {} (data-parallel size = world size / (tp*cp*pp)): change "
            "the batch sizes or the number of ranks",
            global_batch, micro_batch, dp, micro_batch * dp);
}

void TrainConfig::validate(int dp) const {
  check_batch_split(global_batch, micro_batch, dp);
  MOE_CHECK(train_iters >= 1, "[train] --train-iters={} must be >= 1", train_iters);
  MOE_CHECK(log_interval >= 1, "[train] --log-interval={} must be >= 1", log_interval);
  MOE_CHECK(eval_interval >= 0 && eval_iters >= 0,
            "[train] --eval-interval={} and --eval-iters={} must be >= 0", eval_interval,
            eval_iters);
  MOE_CHECK(peak_gflops >= 0, "[train] --peak-tflops must be >= 0");
  lr.validate();
  adam.validate();
  ddp.validate();
  ckpt.validate();
  guard.validate();
}

void check_parallel_support(const parallel::ParallelConfig& p, const ModelConfig& m) {
  if (p.cp == 1) return;
  // Before any rank starts: the split (2 cp chunks per sequence) and the comm types' list.
  parallel::check_context_split(parallel::ContextSplit{m.seq_length, p.cp, 0});
  MOE_CHECK(p.cp_comm_type.size() == 1 ||
                static_cast<int64_t>(p.cp_comm_type.size()) == m.num_layers,
            "[train] --cp-comm-type has {} values for {} layers: give one value for every layer "
            "or one per decoder layer (--num-layers {})",
            p.cp_comm_type.size(), m.num_layers, m.num_layers);
  // What context parallelism has not been built or tested with yet, named by its flags.
  const auto refuse = [&p](bool bad, const char* what) {
    MOE_CHECK(!bad,
              "[train] --context-parallel-size {} with {} is not implemented yet: drop one of "
              "them",
              p.cp, what);
  };
  refuse(m.mtp_num_layers > 0 && m.position_embedding == PositionEmbedding::LearnedAbsolute,
         "--mtp-num-layers and --position-embedding-type learned_absolute (the depths' positions "
         "would be rolled on the whole sequence too)");
  refuse(m.moe.router.uses(LoadBalancing::QuantileBalancing),
         "--moe-router-load-balancing-type quantile_balancing (its estimate needs the TP x CP "
         "group's logits)");
}

// (The layout and the model are not read: no pipeline layout is refused on the device.)
void check_device_parallel_support(const std::string& device,
                                   const parallel::ParallelConfig& /*cfg*/,
                                   const parallel::Degrees& d, const ModelConfig& /*model*/) {
  MOE_CHECK(d.world == 1 || parallel::nccl_built(),
            "[train] --device {} on {} processes needs NCCL for the collectives on device memory, "
            "which this build does not have: build with -DMOECORE_CUDA=ON (docs/gpu.md), or run "
            "one process, or --device cpu",
            device, d.world);
  // NCCL has no tags and runs a communicator's groups in order, each to its end. The pipeline
  // runner posts every receive in its sender's order (pipeline::recv_plan); 1F1B's stages form a
  // chain, and the interleaved schedule exchanges in lockstep rounds (pipeline/lockstep.h:
  // every group's partners lie in the neighbours' groups of the same round), so no two groups
  // wait on each other for any pipeline size, virtual stages or group size (a model of NCCL's
  // rules checks PP 2 to 4, VP 2 to 4, groups of PP to PP + 2, 1 to 24 micro-batches).
}

optim::GradNormSync grad_norm_sync(const parallel::ProcessGroups* groups,
                                   const parallel::GradBuckets& buckets, const Exec& ex) {
  optim::GradNormSync sync;
  // Every element counts once: TP slices on every TP rank, replicated parameters on TP rank 0.
  if (buckets.skips_some()) {
    const parallel::GradBuckets* b = &buckets;
    sync.counted = [b](const Param& p) { return b->counted_once(p); };
  }
  if (groups == nullptr) return sync;
  // The sums feed grad_clip, an op: ordered on the stream where the backend can.
  const auto sum_over = [&ex](const parallel::ProcessGroup* g) {
    const Exec* e = &ex;
    return [g, e](DevPtr<double> sq) {
      g->device_communicator()
          .all_reduce_async(sq, 1, DType::F64, parallel::ReduceOp::Sum)
          .wait_on(*e);
    };
  };
  // The distributed optimizer: each rank's owned elements, summed over the bucket's group
  // (dense: dp x cp, expert: expt_dp) first.
  if (buckets.sharded()) {
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      const parallel::ProcessGroup* g = buckets.group(k);
      if (g == nullptr || g->size() == 1) continue;
      (k == ParamKind::Dense ? sync.sum_dense_shards : sync.sum_expert_shards) = sum_over(g);
    }
  }
  // Dense: over tp. Expert: each expert's slices live on one tp_ep group (expt_tp x ep; ep
  // alone without expert tensor parallelism).
  // Pipeline parallelism: each stage holds its own layers, so both sums go over pp as well
  // (dense after tp; the expert grid's tp_ep_pp holds every expert slice of every stage).
  const parallel::ProcessGroup& tp = groups->group(parallel::GroupKind::Tp);
  const parallel::ProcessGroup& pp = groups->group(parallel::GroupKind::Pp);
  if (tp.size() > 1 && pp.size() > 1) {
    const auto over_tp = sum_over(&tp), over_pp = sum_over(&pp);
    sync.sum_dense = [over_tp, over_pp](DevPtr<double> sq) {
      over_tp(sq);
      over_pp(sq);
    };
  } else if (tp.size() > 1 || pp.size() > 1) {
    sync.sum_dense = sum_over(tp.size() > 1 ? &tp : &pp);
  }
  const parallel::ProcessGroup& expert =
      groups->group(pp.size() > 1 ? parallel::GroupKind::TpEpPp
                    : groups->group(parallel::GroupKind::ExptTp).size() > 1
                        ? parallel::GroupKind::TpEp
                        : parallel::GroupKind::Ep);
  if (expert.size() > 1) sync.sum_expert = sum_over(&expert);
  return sync;
}

// The context of --device; --fp32-matmul-precision set for the process's f32 GEMMs (TF32 on
// CUDA with "high"; the CPU has none, print_header says so).
static Exec train_exec(const TrainConfig& cfg) {
  Exec ex = make_exec(parse_device(cfg.device));
  ops::set_f32_matmul_precision(ops::parse_f32_matmul_precision(cfg.fp32_matmul_precision));
  return ex;
}

// Before the model is built layer by layer (minutes for a size no machine holds): its weights,
// gradients and Adam moments (16 bytes a parameter), the RoPE table and the layers' inputs kept
// for the backward (a lower bound of the activations) against the host memory available.
static void check_model_fits_host(const ModelConfig& m, int64_t ep, int64_t tp, int64_t etp,
                                  int64_t pp, int64_t micro_batch, int64_t cp) {
  // min_params_per_rank(ep) = dense + experts / ep: the expert part from two EP sizes, then
  // dense / tp + experts / (ep * etp) (the replicated norms and biases are left out: a lower
  // bound still).
  const double at_ep = m.min_params_per_rank(ep);
  const double experts = 2.0 * (at_ep - m.min_params_per_rank(2 * ep));  // experts / ep
  // Pipeline stages: the largest holds at least the average share.
  const double params = ((at_ep - experts) / static_cast<double>(tp) +
                         experts / static_cast<double>(etp)) /
                        static_cast<double>(pp);
  const double rope = m.position_embedding == PositionEmbedding::Rope
                          ? 4.0 * static_cast<double>(m.max_positions() * m.head_dim())
                          : 0.0;
  // A context-parallel rank holds S / cp positions of every sequence.
  const double activations = 4.0 * static_cast<double>(micro_batch) *
                             static_cast<double>(m.seq_length / cp) *
                             static_cast<double>(m.hidden) * static_cast<double>(m.num_layers) /
                             static_cast<double>(pp);
  const double bytes = 16.0 * params + rope + activations;
  const double available = static_cast<double>(host_bytes_available());
  MOE_CHECK(available == 0 || bytes <= available,
            "[memory] the model needs at least {} per rank (fp32 weights, gradients and Adam "
            "moments of {:.4g} parameters: {}; the layers' inputs of one micro-batch of {} x {} "
            "tokens: {}) but {} is available on this machine: lower --num-layers, "
            "--hidden-size, --num-experts, the FFN sizes, --seq-length or --micro-batch-size, or "
            "use more tensor-, context- or expert-parallel ranks (`moecore plan` with the same "
            "flags shows the memory per rank)",
            format_bytes(bytes), params, format_bytes(16.0 * params), micro_batch,
            m.seq_length / cp,
            format_bytes(activations), format_bytes(available));
}

template <typename T>
BasicTrainer<T>::BasicTrainer(const ModelConfig& model_cfg, const TrainConfig& cfg,
                              const parallel::ProcessGroups* groups)
    : model_cfg_(model_cfg),
      cfg_(cfg),
      groups_(groups),
      exec_(train_exec(cfg_)),  // first: a missing device says so
      // Phase boundaries timed where the ops run (stream events on a device).
      profiler_(make_phase_timer(exec_, PhaseProfiler::kDefaultMarks)) {
  {
    std::string why;
    MOE_CHECK(training_step_supported(exec_.device, &why), "[train] --device {}: {}", cfg_.device,
              why);
  }
  if (cfg_.lr.decay_steps == 0) cfg_.lr.decay_steps = cfg_.train_iters;
  if (!exec_.on_cpu()) {
    // The hang watchdog of the host's waits on the stream (core/exec.h): the collectives' limit.
    // (A collective's handle waited on by the stream is past its communicator's timeout once the
    // host moves on: a stream behind one that never ends is reported here.)
    const parallel::ParallelConfig one_process;  // the flag's default limit
    const parallel::ParallelConfig& pc =
        groups_ != nullptr ? groups_->layout().config : one_process;
    const int rank = groups_ != nullptr ? groups_->rank() : 0;
    double limit = pc.timeout_seconds();
    // The watchdog's tests: a limit of seconds, as the MPI communicators take it.
    if (const fault::Fault* f = fault::find("comm_timeout", rank)) {
      limit = static_cast<double>(f->int_arg("seconds", -1));
      MOE_CHECK(limit > 0, "[fault] MOECORE_FAULT: comm_timeout needs seconds=S (S > 0)");
    }
    set_stream_wait_limit(limit, groups_ != nullptr ? fmt::format("world rank {}", rank)
                                                    : std::string("this process"));
  }
  if (groups_ != nullptr) {
    check_parallel_support(groups_->layout().config, model_cfg_);
    if (!exec_.on_cpu()) {
      check_device_parallel_support(cfg_.device, groups_->layout().config, groups_->degrees(),
                                    model_cfg_);
      // Collectives on the device's memory go to NCCL (the host's MPI communicators keep the
      // host's traffic: agreements, the step report's values, the checkpoint protocol).
      device_groups_ = std::make_unique<parallel::ProcessGroups>(
          parallel::with_device_communicators(*groups_, exec_));
      groups_ = device_groups_.get();
    }
    // Each dp rank reads its own share of the global batch; the cp ranks of a group read the same
    // samples and keep their share of each sequence (dense gradients reduce over dp x cp).
    dp_size_ = groups_->group(parallel::GroupKind::Dp).size();
    dp_rank_ = groups_->group(parallel::GroupKind::Dp).rank;
    const parallel::ProcessGroup& cp = groups_->group(parallel::GroupKind::Cp);
    cp_split_ = parallel::ContextSplit{model_cfg_.seq_length, cp.size(), cp.rank};
  } else {
    cp_split_ = parallel::ContextSplit{model_cfg_.seq_length, 1, 0};
  }
  parallel::check_context_split(cp_split_);
  // Megatron: without --global-batch-size, one micro-batch per data-parallel rank.
  if (cfg_.global_batch == 0) cfg_.global_batch = cfg_.micro_batch * dp_size_;
  cfg_.validate(dp_size_);
  model_cfg_.validate();
  check_model_fits_host(model_cfg_, groups_ != nullptr ? groups_->degrees().ep : 1,
                        groups_ != nullptr ? groups_->degrees().tp : 1,
                        groups_ != nullptr ? groups_->degrees().etp : 1,
                        groups_ != nullptr ? groups_->degrees().pp : 1, cfg_.micro_batch,
                        cp_split_.cp);
  const int pp = groups_ != nullptr ? groups_->degrees().pp : 1;
  MOE_CHECK(pp == 1 || !model_cfg_.moe.router.uses(LoadBalancing::GlobalAuxLoss),
            "[train] --moe-router-load-balancing-type global_aux_loss with "
            "--pipeline-model-parallel-size {} is not implemented yet: a stage recomputes earlier "
            "micro-batches' forwards before their backwards, and the loss's running mean counts "
            "them in order; use aux_loss or seq_aux_loss",
            pp);
  MOE_CHECK(dp_size_ == 1 || !model_cfg_.moe.router.uses(LoadBalancing::GlobalAuxLoss),
            "[train] --moe-router-load-balancing-type global_aux_loss with data-parallel size {} "
            "is not implemented yet: its counts must be summed over TP x DP x CP inside every "
            "forward; use aux_loss or seq_aux_loss, or one data-parallel rank",
            dp_size_);
  n_micro_ = cfg_.global_batch / (cfg_.micro_batch * dp_size_);
  check_routing_replay();
  {
    if (cfg_.data.synthetic()) {
      splits_.split[0] = std::make_unique<data::SyntheticLanguage>(
          cfg_.data.synthetic_vocab, cfg_.data.synthetic_branching, cfg_.seed);
    } else {
      // Megatron's train / valid / test sample counts (get_train_valid_test_num_samples).
      const int64_t eval_points =
          (cfg_.eval_interval > 0 ? cfg_.train_iters / cfg_.eval_interval : 0) + 1;
      const std::array<int64_t, data::kNumSplits> samples = {
          cfg_.train_iters * cfg_.global_batch, eval_points * cfg_.eval_iters * cfg_.global_batch,
          cfg_.eval_iters * cfg_.global_batch};
      const auto tok = data::make_tokenizer(cfg_.data.tokenizer);
      splits_ = data::build_data_splits(cfg_.data, model_cfg_.seq_length,
                                        static_cast<uint32_t>(cfg_.seed), samples,
                                        tok->vocab_size(),
                                        cfg_.data.mock_data ? tok->eod() : -1);
      if (cfg_.data.eod_mask_loss) eod_mask_ = tok->eod();
    }
  }
  data_ = splits_.train();
  MOE_CHECK(data_ != nullptr, "[train] --split '{}' leaves no training data",
            cfg_.data.split);
  train_stream_ = std::make_unique<data::SampleStream>(data_, cfg_.global_batch, dp_size_, dp_rank_);
  train_stream_->set_eod_mask(eod_mask_);
  for (int s = 1; s < data::kNumSplits; ++s) {
    if (splits_.split[s]) {
      eval_streams_[s] = std::make_unique<data::SampleStream>(splits_.split[s].get(),
                                                              cfg_.global_batch, dp_size_, dp_rank_);
      eval_streams_[s]->set_eod_mask(eod_mask_);
    }
  }
  MOE_CHECK(data_->vocab() <= model_cfg_.vocab_size,
            "[train] the data has {} token ids but --vocab-size={}: raise --vocab-size",
            data_->vocab(), model_cfg_.vocab_size);
  // Dense gradients reduce over dp x cp, expert gradients over expt_dp.
  const parallel::ProcessGroup* dense_group =
      groups_ ? &groups_->group(parallel::GroupKind::DpCp) : nullptr;
  const parallel::ProcessGroup* expert_group =
      groups_ ? &groups_->group(parallel::GroupKind::ExptDp) : nullptr;
  // With one rank per data-parallel group nothing is sharded: the plain optimizer is the same
  // computation (and its moments are whole tensors, so checkpoints work as always).
  const bool sharded = parallel::GradBuckets::shards(cfg_.ddp, dense_group, expert_group);
  // --bf16 sharded: the fp32 master weights live in the optimizer's shards only.
  model_cfg_.master_weights_sharded = model_cfg_.bf16 && sharded;
  // Pipeline parallelism: this rank's virtual stages (one chunk each), where every layer goes.
  std::vector<parallel::VirtualStage> chunks;
  if (pp > 1) {
    layout_ = parallel::pipeline_layout(groups_->layout().config, model_cfg_.num_layers,
                                        model_cfg_.mtp_num_layers);
    for (int c = 0; c < layout_.vp; ++c) chunks.push_back(layout_.stage(groups_->pp_stage(), c));
  }
  model_ = std::make_unique<model::GPTModel<T>>(model_cfg_, cfg_.micro_batch, cfg_.seed, groups_,
                                                /*size_only=*/false, exec_, chunks);
  runner_ = std::make_unique<pipeline::PipelineRunner<T>>(
      *model_, groups_, n_micro_, pp > 1 ? groups_->layout().config.microbatch_group_size : 0,
      exec_);

  // The partial gradients of ReplicatedPartialGrad parameters are summed over tp (dense) and
  // expt_tp (expert) first.
  buckets_ = std::make_unique<parallel::GradBuckets>(
      model_->params(), model_->grad_stages(), dense_group, expert_group, cfg_.ddp,
      groups_ ? &groups_->group(parallel::GroupKind::Tp) : nullptr,
      groups_ ? &groups_->group(parallel::GroupKind::ExptTp) : nullptr);
  // The pipeline runner passes the backward's stages on (pipeline_hooks()).
  // --overlap-param-gather: each forward stage waits for the gathers of its parameters; with
  // --bf16 a bucket's compute copies follow its gather (refresh_bf16 after the step skips the
  // gathered kinds then).
  model_->set_params_needed_hook([this](int stage) { buckets_->params_needed(stage); });
  if (model_->params().has_bf16_copies()) {
    buckets_->set_after_gather([this](size_t b) {
      const parallel::GradBucket& bk = buckets_->buckets()[b];
      model_->params().refresh_bf16(bk.kind, bk.offset, bk.count);
    });
  }

  const optim::GradNormSync norm_sync = grad_norm_sync(groups_, *buckets_, exec_);
  MOE_CHECK(sharded == buckets_->sharded(), "[train] the distributed optimizer's groups "
            "disagree with its buckets");
  if (sharded) {
    // ZeRO-1: each rank updates its shard of every bucket; the norm's owned sums of squares
    // add up over the bucket's group (grad_norm_sync).
    optim::ShardedState sharded;
    sharded.seed = cfg_.seed;
    for (size_t b = 0; b < buckets_->buckets().size(); ++b) {
      const parallel::BucketShard& s = buckets_->shard(b);
      sharded.ranges[static_cast<int>(buckets_->buckets()[b].kind)].push_back(
          optim::OwnedRange{s.begin, s.count, s.owned_offset});
    }
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      sharded.owned_numel[static_cast<int>(k)] = buckets_->owned_numel(k);
    }
    parallel::GradBuckets* buckets = buckets_.get();
    ParamRegistry* params = &model_->params();
    sharded.gather_params = [buckets, params] {
      buckets->gather_params();
      if (!buckets->defers_gathers()) return;
      for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
        const parallel::ProcessGroup* g = buckets->group(k);
        if (g != nullptr && g->size() > 1) params->mark_bf16_current(k);
      }
    };
    optimizer_ = std::make_unique<optim::ChainedOptimizer>(model_->params(), cfg_.adam, norm_sync,
                                                           sharded);
  } else {
    optimizer_ = std::make_unique<optim::ChainedOptimizer>(model_->params(), cfg_.adam, norm_sync);
  }
  // The guards check each bucket before its reduction (the hook also runs the injected
  // gradient faults, with the checks off too).
  MOE_CHECK(!cfg_.guard.skip_spiky_steps ||
                (!model_cfg_.moe.router.enable_expert_bias &&
                 !model_cfg_.moe.router.uses(LoadBalancing::QuantileBalancing)),
            "[train] --skip-spiky-steps with --moe-router-enable-expert-bias or quantile "
            "balancing is not implemented yet: a skipped step would have to undo their "
            "once-per-step update; drop one of them");
  guard_ = std::make_unique<NumericGuard>(
      cfg_.guard, exec_, model_->params(), *buckets_, world_comm(),
      groups_ != nullptr ? groups_->rank() : 0,
      world_comm() != nullptr ? &groups_->world().device_communicator() : nullptr);
  buckets_->set_before_reduce([this](size_t b) { guard_->check_bucket(b); });

  // The routers' once-per-step all-reduces (MOE_SEMANTICS Router 4 and 5).
  if (groups_ && groups_->group(parallel::GroupKind::TpDpCp).size() > 1) {
    const parallel::ProcessGroup* g = &groups_->group(parallel::GroupKind::TpDpCp);
    const Exec* ex = &exec_;
    router_sync_.sum_tp_dp_cp = [g, ex](DevPtr<double> v, int64_t n) {
      ScopedPhase phase(Phase::Communication);
      g->device_communicator()
          .all_reduce_async(v, n, DType::F64, parallel::ReduceOp::Sum)
          .wait_on(*ex);
    };
  }
  if (groups_ && groups_->group(parallel::GroupKind::DpCp).size() > 1) {
    const parallel::ProcessGroup* g = &groups_->group(parallel::GroupKind::DpCp);
    const Exec* ex = &exec_;
    router_sync_.mean_dp_cp = [g, ex](DevPtr<double> v, int64_t n) {
      ScopedPhase phase(Phase::Communication);
      g->device_communicator()
          .all_reduce_async(v, n, DType::F64, parallel::ReduceOp::Sum)
          .wait_on(*ex);
      ops::divide_in_place(*ex, v, static_cast<double>(g->size()), n);
    };
  }

  flops_ = flops_model(model_cfg_);
  // The MFU denominator: the best rate of the GEMM path the model's GEMMs take (f32 sgemm, or
  // the bf16 path chosen for this CPU, widening included) at the model's own biggest dense
  // and expert GEMM shapes, forward and backward orientations, on this machine now, at this
  // thread count. A square 1024^3 sgemm is not what the step runs.
  if (cfg_.peak_gflops > 0) {
    peak_gflops_ = cfg_.peak_gflops;
  } else {
    for (const ops::GemmShape& s :
         peak_probe_shapes(model_cfg_, cfg_.micro_batch * model_cfg_.seq_length,
                           model::GPTModel<T>::kHeadChunk)) {
      peak_gflops_ =
          std::max(peak_gflops_, ops::measure_model_gemm_gflops(model_cfg_.bf16, s, 0.05));
    }
  }
  const int64_t S = model_cfg_.seq_length;
  // Under CP the host rolls MTP's ids and targets on the whole sequences (fill_inputs).
  const int64_t host_rolled = cp_split_.cp > 1 ? model_cfg_.mtp_num_layers : 0;
  if (cfg_.routing_replay) routing_layers_ = model_->routing_layers();
  const int64_t routing = static_cast<int64_t>(routing_layers_.size()) * cfg_.micro_batch * S *
                          model_cfg_.moe.router.topk;
  step_ = std::make_unique<StepBuffers>(exec_, n_micro_,
                                        cfg_.micro_batch * cp_split_.local_length(),
                                        model_cfg_.num_experts, model_->num_chunks(), host_rolled,
                                        routing);
  scratch_.resize(S + 1);
  if (cp_split_.cp > 1) {
    global_ids_.resize(cfg_.micro_batch * S);
    global_targets_.resize(cfg_.micro_batch * S);
    if (host_rolled > 0) {
      rolled_ids_.resize(cfg_.micro_batch * S);
      rolled_targets_.resize(cfg_.micro_batch * S);
    }
  }
  // Tokens per expert, then the dropped count in the last slot: one all-reduce for both.
  load_.resize(std::max<int64_t>(model_cfg_.num_experts, 1) + 1);
  mb_width_ = kMbValues + 2 * model_cfg_.mtp_num_layers;
  mb_values_.resize(n_micro_ * mb_width_);
  guard_losses_.resize(n_micro_);
  all_values_.resize(n_micro_ * dp_size_ * mb_width_);
  check_cuda_graph_support();
}

// What sharing the per-layer buffers across layers saves by itself: the overlays' saving less
// the part that activation recomputation accounts for (reported separately).
static size_t sharing_saving_bytes(const Arena& a) {
  return a.shared_saving_bytes() - a.recompute_saving_bytes();
}

template <typename T>
void BasicTrainer<T>::fill_inputs(data::SampleStream& stream) {
  ScopedPhase phase(Phase::Data);
  {
    SyncAudit::Paused inputs;  // the host writes the step's inputs into its staging
    for (int64_t mb = 0; mb < n_micro_; ++mb) {
      if (cp_split_.cp > 1) {
        // The whole sequences (labels and loss mask made on them), then this rank's chunks.
        stream.fill_micro_batch(mb, cfg_.micro_batch, model_cfg_.seq_length, global_ids_.data(),
                                global_targets_.data(), scratch_.data());
        split_inputs(mb, global_ids_.data(), global_targets_.data());
      } else {
        stream.fill_micro_batch(mb, cfg_.micro_batch, model_cfg_.seq_length, step_->ids(mb),
                                step_->targets(mb), scratch_.data());
      }
      // The dropout masks follow the sample's place in the global batch, not this rank's.
      step_->dropout(mb) = ops::DropoutCounters{iteration_, stream.first_sample(mb, cfg_.micro_batch)};
      if (!routing_layers_.empty()) stage_routing(mb);
    }
  }
  step_->upload();  // an op on the stream: part of the step
}

template <typename T>
void BasicTrainer<T>::split_inputs(int64_t mb, const int32_t* ids_BS, const int32_t* targets_BS) {
  split_micro_batch(cp_split_, cfg_.micro_batch, ids_BS, targets_BS, step_->ids(mb),
                    step_->targets(mb));
  // MTP depth k's tokens rolled on the whole sequences, then split the same way.
  for (int64_t j = 0; j < model_cfg_.mtp_num_layers; ++j) {
    roll_micro_batch(cfg_.micro_batch, model_cfg_.seq_length, j + 1, ids_BS, targets_BS,
                     rolled_ids_.data(), rolled_targets_.data());
    split_micro_batch(cp_split_, cfg_.micro_batch, rolled_ids_.data(), rolled_targets_.data(),
                      step_->mtp_ids(mb, j), step_->mtp_targets(mb, j));
  }
}

template <typename T>
StepMetrics BasicTrainer<T>::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  profiler_.reset();
  ActiveProfiler active(&profiler_);
  std::optional<ScopedPhase> step_phase(Phase::Other);
  const int64_t n_global = n_micro_ * dp_size_;
  const int64_t S = model_cfg_.seq_length;
  StepMetrics m;
  m.iteration = ++iteration_;
  fault::set_iteration(iteration_);
  m.lr = cfg_.lr.lr(optimizer_->steps_taken());
  if (std::find(cfg_.iterations_to_skip.begin(), cfg_.iterations_to_skip.end(), iteration_) !=
      cfg_.iterations_to_skip.end()) {
    // Megatron's dummy_train_step: the batch is consumed, nothing is computed.
    train_stream_->advance();
    m.skipped = true;
    return m;
  }
  guard_->begin_step(iteration_);
  // --sync-audit: from here to the end of the step's work nothing may allocate or sync outside
  // the documented points; the audit is disarmed on any exit, and end_step() reports.
  SyncAudit& audit = SyncAudit::instance();
  struct Disarm {
    SyncAudit* a;
    ~Disarm() {
      if (a && a->in_step()) a->end_step_quietly();
    }
  } disarm{cfg_.sync_audit ? &audit : nullptr};
  // The first step is the warm-up (what a CUDA graph is captured after): libraries and
  // reusable host structures reach their sizes there; every later step is audited.
  const bool audited = cfg_.sync_audit && iteration_ > 1;
  if (audited) audit.begin_step();
  const StepComm comm_before = step_comm();
  model_->params().zero_grads();
  // This rank's contiguous share of the global batch (data::SampleStream), every micro-batch's
  // inputs written before the step's work.
  fill_inputs(*train_stream_);
  // Every micro-batch's forward and backward, and the gradient reduction: eager, or the CUDA
  // graph of them (--cuda-graph-impl full_iteration).
  forward_backward(n_global);
  guard_->combine();   // every rank's findings, so that all skip or stop together
  train_stream_->advance();
  // No active guard: no veto (a null one).
  optimizer_->apply(m.lr, guard_->active() ? guard_->veto() : nullptr,
                    guard_->active() ? guard_->veto_count() : 0);
  // Once per step, after the update: expert-bias and quantile updates, balancing counts reset.
  model_->finish_step(router_sync_);
  if (audited) audit.end_step();
  // A replayed step's traffic: the captured region's, which the host did not count, and the
  // rest of the step's.
  StepComm comm = step_comm() - comm_before;
  if (graph_replayed_) comm = comm + graph_comm_;
  m.alltoall_bytes = comm.alltoall_bytes;
  const auto forms = [](const parallel::CommBytesSent& b) {
    return StepMetrics::FormBytes{b.all_gather, b.reduce_scatter, b.all_reduce};
  };
  m.tp_bytes = forms(comm.tp_bytes);
  m.expt_tp_bytes = forms(comm.etp_bytes);
  m.tp_calls = comm.tp_calls;
  m.pp_bytes = comm.pp_bytes;
  m.expt_tp_calls = comm.etp_calls;

  // The step report, read once after the step: this rank's micro-batches' losses, dropped
  // slots and tokens per expert; with it the guards' flags and the optimizer's results.
  step_->download();
  if (!routing_layers_.empty() && cfg_.routing_replay->mode() == RoutingReplayMode::Record)
    record_routing();
  const int loss_chunk = model_->num_chunks() - 1;  // its report holds the loss, if any here
  const bool has_loss = model_->chunk(loss_chunk).loss;
  for (int64_t mb = 0; mb < n_micro_; ++mb)
    guard_losses_[mb] = has_loss ? step_->report(mb, loss_chunk).lm_loss_sum : 0.0;
  // First the guards: a non-finite loss or gradient stops here, naming itself, before the
  // optimizer's own message about the norm it caused.
  m.skipped = guard_->after_step(iteration_, guard_losses_);
  if (m.skipped) undo_step_counters();
  m.grad_norm = optimizer_->last_step().grad_norm;
  std::fill(load_.begin(), load_.end(), 0);
  m.dropped_tokens = gather_micro_batch_values();
  const bool moe_layers = [&] {
    for (int64_t mb = 0; mb < n_micro_; ++mb)
      if (mb_values_[mb * mb_width_ + 4] > 0) return true;
    return false;
  }();
  // Tokens per expert and dropped slots: with TP > 1 each TP rank's MoE layers route its own
  // sequence slice, so the counts add up over tp x dp x cp (over dp x cp without TP), and over
  // the pipeline stages' layers (the whole world then).
  if (groups_ != nullptr && groups_->world_size() > 1) {
    ScopedPhase phase(Phase::Communication);
    load_.back() = m.dropped_tokens;
    (groups_->degrees().pp > 1 ? groups_->world() : groups_->group(parallel::GroupKind::TpDpCp))
        .communicator()
        .all_reduce(load_);
    m.dropped_tokens = load_.back();
  }
  // Megatron reports the lm loss over the global batch's counted tokens (the gradients use
  // each micro-batch's own mean): the two agree unless --eod-mask-loss leaves micro-batches
  // with different counts.
  double loss_sum = 0, counted = 0;
  for (int64_t mb = 0; mb < n_global; ++mb) {
    loss_sum += all_values_[mb * mb_width_];
    counted += all_values_[mb * mb_width_ + 1];
    if (const double layers = all_values_[mb * mb_width_ + 4]; layers > 0) {
      m.aux_loss += all_values_[mb * mb_width_ + 2] / layers / n_global;
      m.z_loss += all_values_[mb * mb_width_ + 3] / layers / n_global;
    }
  }
  m.lm_loss = counted > 0 ? loss_sum / counted : 0.0;
  // Megatron's mtp_k loss: each micro-batch's mean, averaged over the micro-batches and the
  // data-parallel ranks (MTPLossLoggingHelper).
  for (int64_t j = 0; j < model_cfg_.mtp_num_layers; ++j) {
    for (int64_t mb = 0; mb < n_global; ++mb) {
      const double* v = &all_values_[mb * mb_width_ + kMbValues + 2 * j];
      if (v[1] > 0) m.mtp_loss[j] += v[0] / v[1] / n_global;
    }
  }
  if (moe_layers) {
    const size_t n_experts = load_.size() - 1;
    double sum = 0, mx = 0;
    for (size_t e = 0; e < n_experts; ++e) {
      sum += load_[e];
      mx = std::max(mx, static_cast<double>(load_[e]));
    }
    m.max_over_mean_load = sum > 0 ? mx / (sum / n_experts) : 0;
  }
  step_phase.reset();
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int p = 0; p < kNumPhases; ++p) m.phase_seconds[p] = profiler_.seconds(static_cast<Phase>(p));
  // Throughput of the whole job: the global batch.
  const double tokens = static_cast<double>(cfg_.global_batch * S);
  m.tokens_per_s = tokens / m.seconds;
  m.tflops = flops_.train_flops_per_token() * m.tokens_per_s / 1e12;
  m.mfu = m.tflops * 1e3 / job_peak_gflops();
  m.peak_mem_bytes = peak_rss_bytes();
  for (int k = 0; k < static_cast<int>(MemKind::Count); ++k) {
    const MemKind kind = static_cast<MemKind>(k);
    m.mem_bytes[k] = static_cast<int64_t>(model_->arena().bytes_of(kind) +
                                          optimizer_->state_bytes(kind));
  }
  const Arena& ma = model_->arena();
  m.mem_planned_bytes = static_cast<int64_t>(ma.planned_bytes()) + optimizer_->planned_bytes();
  m.mem_shared_saved_bytes = static_cast<int64_t>(sharing_saving_bytes(ma));
  m.mem_recompute_saved_bytes = static_cast<int64_t>(ma.recompute_saving_bytes());
  memory_per_param(m);
  return m;
}

// The terms of state_bytes_formula for this registry: the value buffers held whole per
// parameter of each kind (the master values when held here; under --bf16 the compute copy,
// bf16 or the widened-bf16 GEMM path's f32, and the native path's f32 copies of the bf16 values
// of the parameters f32 kernels read), as numbers and as text, and the sharded bytes per
// parameter (Adam's m and v; the fp32 master weights when the optimizer's shards hold them).
struct StateBytesTerms {
  double replicated[2] = {0, 0};
  std::string text;
  double sharded = 8;
};
static StateBytesTerms state_bytes_terms(const ParamRegistry& p) {
  StateBytesTerms t;
  const double master = p.holds_master() ? static_cast<double>(dtype_size(p.dtype())) : 0;
  const double copy = !p.has_bf16_copies() ? 0 : p.bf16_widened() ? 4 : 2;
  int64_t n32 = 0, n = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const int i = static_cast<int>(k);
    const int64_t own32 = p.values32_numel(k);
    t.replicated[i] = master + copy +
                      (p.numel(k) > 0 ? 4.0 * static_cast<double>(own32) / p.numel(k) : 0.0);
    n32 += own32;
    n += p.numel(k);
  }
  for (double part : {master, copy, n > 0 ? 4.0 * static_cast<double>(n32) / n : 0.0}) {
    if (part > 0) t.text += fmt::format("{}{:.3g}", t.text.empty() ? "" : " + ", part);
  }
  t.sharded = p.holds_master() ? 8 : 12;
  return t;
}

template <typename T>
void BasicTrainer<T>::memory_per_param(StepMetrics& m) const {
  const ParamRegistry& p = model_->params();
  const Arena& ma = model_->arena();
  const int64_t numel[2] = {p.numel(ParamKind::Dense), p.numel(ParamKind::Expert)};
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    m.optim_shard_degree[static_cast<int>(k)] = buckets_->shard_degree(k);
  }
  const double n = static_cast<double>(numel[0] + numel[1]);
  // The weights' bytes hold the parameters' value buffers and a few router buffers (expert
  // bias, quantile beta): the measurement is a little above the formula.
  const double held = static_cast<double>(ma.bytes_of(MemKind::Weights) +
                                          ma.bytes_of(MemKind::Grads) +
                                          optimizer_->state_bytes(MemKind::OptimizerState));
  m.state_bytes_per_param = n > 0 ? held / n : 0;
  const StateBytesTerms t = state_bytes_terms(p);
  m.state_bytes_per_param_formula =
      state_bytes_formula(numel, m.optim_shard_degree.data(), t.replicated,
                          static_cast<double>(dtype_size(p.dtype())), t.sharded);
}

template <typename T>
void BasicTrainer<T>::undo_step_counters() {
  // The update was skipped on the device (weights, moments); the host's counters advanced with
  // the calls: Adam's step (bias correction, the LR schedule) and the routers' (jitter).
  optimizer_->set_steps_taken(optimizer_->steps_taken() - 1);
  for (moe::Router<T>* r : model_->routers()) r->set_steps_finished(r->steps_finished() - 1);
}

template <typename T>
void BasicTrainer<T>::print_header(std::ostream& log) const {
  const auto& p = model_->params();
  const Arena& ma = model_->arena();

  constexpr double kMiB = 1024.0 * 1024.0;
  fmt::print(log, "[train] data: {}\n", data_->describe());
  for (int s = 1; s < data::kNumSplits; ++s) {
    if (splits_.split[s]) {
      fmt::print(log, "[train] {} data: {}\n", data::split_name(static_cast<data::Split>(s)),
                 splits_.split[s]->describe());
    }
  }
  for (const std::string& n : splits_.notes) fmt::print(log, "{}\n", n);
  if (!std::isnan(entropy_floor())) {
    fmt::print(log, "[train] entropy floor (best achievable lm loss): {:.4f} nats/token\n",
               entropy_floor());
  }
  if (groups_ != nullptr) {
    const parallel::Degrees& d = groups_->degrees();
    int64_t dense_buckets = 0;
    for (const auto& b : buckets_->buckets()) dense_buckets += b.kind == ParamKind::Dense;
    const bool sp = groups_->layout().config.sequence_parallel && d.tp > 1;
    fmt::print(log, "[train] parallel: {} ranks; data parallel {} (each rank {} micro-batches of "
                    "{}){}, tensor parallel {}{}, pipeline parallel {}{}, expert parallel {} x "
                    "expert tensor parallel {} x expert data parallel {}; gradient buckets: {} "
                    "dense over dp_cp, {} expert over expt_dp, {}{}{}\n",
               d.world, dp_size_, n_micro_, cfg_.micro_batch,
               d.cp > 1 ? fmt::format(", context parallel {} ({} of {} positions a rank, "
                                      "--cp-comm-type {})",
                                      d.cp, cp_split_.local_length(), cp_split_.S,
                                      fmt::join(groups_->layout().config.cp_comm_type, " "))
                        : "",
               d.tp,
               sp ? " with sequence parallelism" : "", d.pp,
               layout_.vp > 1 ? fmt::format(" x {} virtual stages", layout_.vp) : "", d.ep, d.etp,
               d.edp, dense_buckets,
               buckets_->buckets().size() - dense_buckets,
               cfg_.ddp.overlap ? "overlapped with the backward (--overlap-grad-reduce)"
                                : "reduced after the backward",
               !buckets_->sharded() ? ""
               : buckets_->defers_gathers()
                   ? "; parameters all-gathered during the next forward (--overlap-param-gather)"
                   : "; parameters all-gathered after the optimizer step",
               buckets_->tp_group(ParamKind::Dense) != nullptr ||
                       buckets_->tp_group(ParamKind::Expert) != nullptr
                   ? "; partial gradients of replicated parameters summed over tp / expt_tp first"
                   : "");
  }
  if (runner_->pipelined()) {
    // Where every layer is, and the schedule (a rank's order: `moecore plan --print-schedule`).
    std::istringstream stages(layout_.describe());
    for (std::string line; std::getline(stages, line);) fmt::print(log, "[pipeline] {}\n", line);
    const pipeline::ScheduleConfig& sc = runner_->schedule_config();
    fmt::print(log,
               "[pipeline] schedule: {} over {} micro-batches{}; a stage keeps the inputs of its "
               "micro-batches in flight (rank 0: {}) and recomputes a forward before its "
               "backward unless it ran just before; boundary buffers {:.2f} MiB\n",
               sc.vp > 1 ? "interleaved 1F1B" : "1F1B", sc.num_microbatches,
               sc.vp > 1 ? fmt::format(" in groups of {}", sc.group_size > 0 ? sc.group_size
                                                                              : sc.pp)
                         : "",
               fmt::join(runner_->in_flight(), ", "), runner_->planned_bytes() / kMiB);
  }
  {
    const ModelConfig& mc = model_cfg_;
    fmt::print(log,
               "[train] model: {} layers, hidden {}, {} heads ({} query groups); {} MLPs{}; {}; "
               "positions {}; hidden dropout {}, attention dropout {} (training only){}\n",
               mc.num_layers, mc.hidden, mc.num_heads, mc.num_query_groups,
               ops::activation_name(mc.activation),
               mc.add_mlp_bias || mc.add_qkv_bias || mc.add_attention_output_bias
                   ? fmt::format(", biases on {}{}{}", mc.add_qkv_bias ? "QKV " : "",
                                 mc.add_attention_output_bias ? "attention-output " : "",
                                 mc.add_mlp_bias ? "MLP" : "")
                   : "",
               mc.normalization == Normalization::LayerNorm
                   ? (mc.layernorm_1p ? "LayerNorm (1p)" : "LayerNorm")
                   : "RMSNorm",
               mc.position_embedding == PositionEmbedding::Rope            ? "rope"
               : mc.position_embedding == PositionEmbedding::LearnedAbsolute ? "learned_absolute"
                                                                             : "none",
               mc.hidden_dropout, mc.attention_dropout,
               mc.mtp_num_layers > 0
                   ? fmt::format("; {} multi-token prediction depth{} ({} layers), loss factor {}",
                                 mc.mtp_num_layers, mc.mtp_num_layers > 1 ? "s" : "",
                                 mc.mtp_is_moe() ? "MoE" : "dense", mc.mtp_loss_scaling_factor)
                   : "");
  }
  fmt::print(log, "[train] parameters{}: {} ({} dense, {} expert); active matmul parameters per "
                  "token: {:.0f}\n",
             groups_ != nullptr && groups_->world_size() > 1 ? " on this rank" : "",
             p.numel(ParamKind::Dense) + p.numel(ParamKind::Expert), p.numel(ParamKind::Dense),
             p.numel(ParamKind::Expert), flops_.active_matmul_params);
  fmt::print(log, "[train] memory plan (MiB): weights {:.2f}, grads {:.2f}, optimizer {:.2f}, "
                  "activations kept {:.2f}, recomputed {:.2f}, state {:.2f}, workspace {:.2f}; "
                  "planned {:.2f} after sharing per-layer workspace across layers (saves {:.2f})"
                  "{}\n",
             ma.bytes_of(MemKind::Weights) / kMiB, ma.bytes_of(MemKind::Grads) / kMiB,
             optimizer_->state_bytes(MemKind::OptimizerState) / kMiB,
             ma.bytes_of(MemKind::Activations) / kMiB, ma.bytes_of(MemKind::Recomputed) / kMiB,
             ma.bytes_of(MemKind::State) / kMiB, ma.bytes_of(MemKind::Workspace) / kMiB,
             (ma.planned_bytes() + optimizer_->planned_bytes()) / kMiB,
             sharing_saving_bytes(ma) / kMiB,
             model_cfg_.recompute.granularity == RecomputeGranularity::None
                 ? std::string()
                 : fmt::format(", activation recomputation saves {:.2f}",
                               ma.recompute_saving_bytes() / kMiB));
  {
    StepMetrics m;
    memory_per_param(m);
    const double esize = static_cast<double>(dtype_size(p.dtype()));
    const StateBytesTerms t = state_bytes_terms(p);
    const bool sharded = m.optim_shard_degree[0] > 1 || m.optim_shard_degree[1] > 1;
    fmt::print(log,
               "[train] memory per parameter: weights + grads + optimizer state {:.3f} B "
               "(formula {} = {:.3f} B); Adam state {}\n",
               m.state_bytes_per_param,
               state_bytes_formula_text(m.optim_shard_degree.data(), t.text, esize, t.sharded),
               m.state_bytes_per_param_formula,
               sharded ? fmt::format("sharded over dp_cp {} (dense) and expt_dp {} (expert) "
                                     "(--use-distributed-optimizer){}",
                                     m.optim_shard_degree[0], m.optim_shard_degree[1],
                                     p.has_bf16_copies() ? ", fp32 master weights too" : "")
                       : std::string("whole on every rank"));
  }
  // What decides the bitwise results on this CPU (the golden digests are kept per class).
  if (exec_.on_cpu()) fmt::print(log, "[train] numerics class: {}\n", ops::numerics_class());
  // Until a GPU run is recorded in bench/RESULTS.md (docs/gpu.md, "Status").
  if (!exec_.on_cpu()) {
    fmt::print(log, "[train] --device {}: this backend has not yet run on a real GPU; it is "
                    "verified on the CPU, its kernels through the grid emulator (docs/gpu.md)\n",
               cfg_.device);
  }
  if (cfg_.cuda_graph_impl == "full_iteration") {
    if (exec_.on_cpu()) {
      fmt::print(log,
                 "[cuda-graph] --cuda-graph-impl full_iteration on --device cpu: no effect "
                 "(the CPU backend runs each op when it is called: there is no stream to "
                 "capture); the steps are the same computation with or without it\n");
    } else {
      fmt::print(log,
                 "[cuda-graph] --cuda-graph-impl full_iteration: steps 1-{} of this process "
                 "eager (warm-up), the next captures the forward and backward of every "
                 "micro-batch and the gradient reduction as one CUDA graph, replayed on each "
                 "step after; the optimizer step, the inputs' upload and the report stay "
                 "outside it, evaluation is eager; the replayed region is timed as "
                 "\"other\"\n",
                 cfg_.cuda_graph_warmup_steps);
    }
  }
  if (model_cfg_.bf16) fmt::print(log, "{}\n", ops::bf16_gemm_path_line());
  // The f32 GEMMs' arithmetic (--fp32-matmul-precision): TF32 on or off, and why.
  if (const std::string line = ops::f32_gemm_line(exec_.device); !line.empty())
    fmt::print(log, "{}\n", line);
  // The attention path and why (the probe of cuDNN's fused attention, once per process).
  if (!exec_.on_cpu())
    fmt::print(log, "{}\n",
               ops::attention_path_line(exec_, model_cfg_.bf16, model_cfg_.attention_dropout));
  // The grouped GEMMs' path and why (device tables or host-read sizes; ops/gemm.h): their fixed
  // dims are the hidden size and each MLP's ffn width (this rank's share) and fc1's width.
  if (!exec_.on_cpu()) {
    const int64_t tp = groups_ != nullptr ? groups_->degrees().tp : 1;
    const int64_t etp = groups_ != nullptr ? groups_->degrees().etp : 1;
    std::vector<int64_t> dims{model_cfg_.hidden};
    const auto add_mlp = [&](ops::Activation act, int64_t F) {
      if (F <= 0) return;
      dims.push_back(F);
      dims.push_back(ops::activation_fc1_width(act, F));
    };
    if (model_cfg_.has_dense_layer()) add_mlp(model_cfg_.activation, model_cfg_.ffn_hidden / tp);
    if (model_cfg_.num_experts > 0) {
      add_mlp(model_cfg_.activation, model_cfg_.moe.ffn_hidden / etp);
      add_mlp(model_cfg_.activation, model_cfg_.moe.shared_ffn_hidden / tp);
    }
    const ops::desc::GemmTypes types = model_cfg_.bf16 && !std::is_same_v<T, double>
                                           ? ops::desc::GemmTypes::Bf16F32
                                           : ops::grouped_gemm_types<T>(exec_);  // TF32 under high
    fmt::print(log, "{}\n", ops::grouped_gemm_path_line(exec_, types, dims));
  }
  fmt::print(log, "[train] MFU = (6 * active matmul params + 3 * attention fwd FLOPs) * tokens/s "
                  "/ (ranks x peak per rank); peak {} GEMM {}: {:.1f} GFLOP/s per rank\n",
             model_cfg_.bf16
                 ? fmt::format("bf16 ({})", ops::bf16_gemm_path_name(ops::bf16_gemm_path()))
                 : std::string("fp32"),
             cfg_.peak_gflops > 0 ? "(given)"
                                  : "(measured at the model's GEMM shapes, best of fwd/bwd)",
             peak_gflops_);
}

template <typename T>
std::vector<StepMetrics> BasicTrainer<T>::run(std::ostream& log) {
  print_header(log);
  const CheckpointConfig& ck = cfg_.ckpt;
  // Before any step: a --save that cannot be written stops now, not at the first save.
  if (!ck.save.empty()) {
    ckpt::check_save_dir(ck.save, fmt::format("rank{}", groups_ != nullptr ? groups_->rank() : 0));
  }
  recover_checkpoint_dirs(log);
  std::optional<int64_t> loaded;
  if (!ck.load.empty()) loaded = resume(log);
  ExitConditions exits(ck, world_comm());
  int64_t saved = loaded && ck.save == ck.load ? *loaded : -1;  // the iteration on disk there
  const auto finished = [&](int64_t it) {                       // a background save completed
    if (it >= 0 && logging_rank()) {
      fmt::print(log, "[checkpoint] saved iteration {} to {} (written in the background)\n", it,
                 ckpt::iteration_dir(ck.save, it).string());
    }
  };
  const auto save = [&] {
    if (ck.async_save) finished(finish_pending_save());  // one save at a time
    const auto t0 = std::chrono::steady_clock::now();
    fault::sleep_point("save", groups_ != nullptr ? groups_->rank() : 0);  // a slow save
    save_checkpoint(ck.save, ck.save_optim, ck.save_rng, ck.async_save);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    saved = iteration_;
    if (logging_rank()) {
      fmt::print(log, "[checkpoint] {} iteration {} to {} ({:.3f} s{})\n",
                 ck.async_save ? "saving" : "saved", iteration_,
                 ckpt::iteration_dir(ck.save, iteration_).string(), waited,
                 ck.async_save ? " to copy it to host memory; the files are written in the "
                                 "background"
                               : "");
    }
  };
  MetricsFile metrics(logging_rank() ? cfg_.metrics_file : std::string(),
                      static_cast<int>(model_cfg_.mtp_num_layers));  // rank 0 writes
  ProgressLine progress(log, cfg_.live_progress, cfg_.train_iters);
  std::vector<StepMetrics> all;
  StepMetrics acc;  // sums over the log interval
  int64_t in_interval = 0;
  double elapsed = 0;
  std::string stop;  // why the run stops before --train-iters
  while (iteration_ < cfg_.train_iters && stop.empty()) {
    StepMetrics m;
    try {
      m = train_step();
    } catch (const NumericFault& f) {
      progress.clear();
      if (logging_rank()) {
        fmt::print(log, "{}\n", f.summary());
        log.flush();
      }
      finished(finish_pending_save());  // an earlier iteration's save completes: it is valid
      buckets_->wait_params();  // every rank stops here together (the guard's combine)
      throw;
    }
    all.push_back(m);
    if (!graph_note_.empty()) {
      if (logging_rank()) fmt::print(log, "{}\n", graph_note_);
      graph_note_.clear();
    }
    // A skipped iteration of --iterations-to-skip computed nothing: no values for the means.
    const bool computed = !m.skipped || guard_->skipped_iteration() == m.iteration;
    if (m.skipped && logging_rank()) {
      if (computed) {
        fmt::print(log, "{}\n", guard_->skipped_summary());
      } else {
        fmt::print(log, "[train] iteration {} skipped (--iterations-to-skip): its batch is "
                        "consumed, nothing is updated\n", m.iteration);
      }
    }
    if (computed) {
      elapsed += m.seconds;
      acc.lm_loss += m.lm_loss;
      for (int64_t j = 0; j < model_cfg_.mtp_num_layers; ++j) acc.mtp_loss[j] += m.mtp_loss[j];
      acc.aux_loss += m.aux_loss;
      acc.z_loss += m.z_loss;
      acc.seconds += m.seconds;
      for (int p = 0; p < kNumPhases; ++p) acc.phase_seconds[p] += m.phase_seconds[p];
      ++in_interval;
    }
    progress.update(m.iteration, elapsed, m.lm_loss);
    stop = exits.check(m.iteration);
    if ((m.iteration % cfg_.log_interval == 0 || m.iteration == cfg_.train_iters ||
         !stop.empty()) && in_interval > 0) {
      log_interval_means(log, metrics, progress, acc, in_interval, m);
    }
    if (cfg_.eval_interval > 0 && m.iteration % cfg_.eval_interval == 0 &&
        has_eval_data(data::Split::Valid)) {
      evaluate_and_print(log, data::Split::Valid, "", metrics);
    }
    if (!ck.save.empty() && ck.save_interval > 0 && m.iteration % ck.save_interval == 0) save();
    finished(finish_pending_save(/*only_if_written=*/true));
  }
  progress.clear();
  buckets_->wait_params();  // the weights are whole when training ends (--overlap-param-gather)
  // Megatron saves when training ends or stops early, unless that iteration is saved already.
  if (!ck.save.empty() && saved != iteration_) save();
  finished(finish_pending_save());
  print_summary(log, all);
  if (!stop.empty()) {
    if (logging_rank()) {
      fmt::print(log, "[exit] stopping after iteration {}: {}\n", iteration_, stop);
    }
  } else {
    // Megatron evaluates once more after training, on the validation and the test split.
    for (data::Split s : {data::Split::Valid, data::Split::Test}) {
      if (has_eval_data(s)) {
        evaluate_and_print(log, s, s == data::Split::Valid ? " on validation set" : " on test set",
                           metrics);
      }
    }
  }
  stopped_early_ = !stop.empty();
  const uint64_t digest = weights_digest();
  if (logging_rank()) {
    fmt::print(log, "[train] weights digest {:016x} (of the final master weights; the same for "
                    "bitwise equal models in any layout)\n", digest);
  }
  return all;
}

template <typename T>
void BasicTrainer<T>::log_interval_means(std::ostream& log, MetricsFile& metrics,
                                         ProgressLine& progress, StepMetrics& acc,
                                         int64_t& in_interval, const StepMetrics& m) {
  // Megatron logs interval means of the losses and the iteration time.
  StepMetrics logged = m;
  logged.lm_loss = acc.lm_loss / in_interval;
  std::string mtp;  // Megatron's "mtp_k loss" beside the lm loss
  for (int64_t j = 0; j < model_cfg_.mtp_num_layers; ++j) {
    logged.mtp_loss[j] = acc.mtp_loss[j] / in_interval;
    mtp += fmt::format(" mtp_{} loss: {:.6E} |", j + 1, logged.mtp_loss[j]);
  }
  logged.aux_loss = acc.aux_loss / in_interval;
  logged.z_loss = acc.z_loss / in_interval;
  logged.seconds = acc.seconds / in_interval;
  for (int p = 0; p < kNumPhases; ++p) logged.phase_seconds[p] = acc.phase_seconds[p] / in_interval;
  logged.tokens_per_s = cfg_.global_batch * model_cfg_.seq_length / logged.seconds;
  logged.tflops = flops_.train_flops_per_token() * logged.tokens_per_s / 1e12;
  logged.mfu = mfu_report(logged.tflops * 1e12, 1.0, job_peak_gflops()).mfu;
  acc = StepMetrics{};
  in_interval = 0;
  progress.clear();
  fmt::print(log,
             " iteration {:>6}/{:<6} | consumed samples: {:>9} | elapsed time per iteration "
             "(ms): {:.1f} | learning rate: {:.6E} | global batch size: {:>4} | lm loss: "
             "{:.6E} |{} load_balancing_loss: {:.6E} | z_loss: {:.6E} | grad norm: {:.4f} | "
             "tokens/s: {:.0f} | TFLOP/s: {:.4f} | MFU: {:.1f}% | max/mean expert load: {:.3f} "
             "| dropped tokens: {} | peak mem (MiB): {:.1f}\n",
             logged.iteration, cfg_.train_iters, logged.iteration * cfg_.global_batch,
             logged.seconds * 1e3, logged.lr, cfg_.global_batch, logged.lm_loss, mtp,
             logged.aux_loss, logged.z_loss, logged.grad_norm, logged.tokens_per_s, logged.tflops,
             logged.mfu * 100, logged.max_over_mean_load, logged.dropped_tokens,
             logged.peak_mem_bytes / (1024.0 * 1024.0));
  // Last micro-batch, per MoE layer: every pipeline stage's layers (gathered over pp).
  const model::MoeStats st = model_->moe_stats();
  constexpr int kStat = 7;  // present, max/mean, dropped, bias min / max, beta min / max
  // The decoder's layers, then the MTP depths' (layer L + j).
  const int64_t n_layers = model_cfg_.num_layers + model_cfg_.mtp_num_layers;
  std::vector<double> layers(static_cast<size_t>(n_layers * kStat), 0.0);
  for (const auto& l : st.layers) {
    double* v = &layers[static_cast<size_t>(l.layer * kStat)];
    v[0] = 1;
    v[1] = l.router.max_over_mean_load;
    v[2] = static_cast<double>(l.router.dropped);
    v[3] = l.router.bias_min;
    v[4] = l.router.bias_max;
    v[5] = l.router.beta_min;
    v[6] = l.router.beta_max;
  }
  sum_over_pipeline(layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    const double* v = &layers[static_cast<size_t>(l * kStat)];
    if (v[0] == 0) continue;
    const int64_t L = model_cfg_.num_layers;
    fmt::print(log,
               "   [router] {}: max/mean load {:.3f} | dropped {} | expert bias "
               "[{:.4f}, {:.4f}] | quantile beta [{:.4f}, {:.4f}]\n",
               l < L ? fmt::format("layer {}", l) : fmt::format("mtp layer {}", l - L), v[1],
               static_cast<int64_t>(v[2]), v[3], v[4], v[5], v[6]);
  }
  log.flush();
  metrics.write(logged);
}

template <typename T>
std::optional<int64_t> BasicTrainer<T>::resume(std::ostream& log) {
  const CheckpointConfig& ck = cfg_.ckpt;
  LoadOptions opt;
  opt.optim = ck.load_optim;
  opt.rng = ck.load_rng;
  opt.finetune = ck.finetune;
  opt.upcycle = ck.upcycling;
  opt.iteration = ck.ckpt_step;
  const std::optional<int64_t> loaded = load_checkpoint(ck.load, opt);
  if (!loaded.has_value()) {
    MOE_CHECK(!ck.exit_on_missing_checkpoint,
              "[checkpoint] --load '{}' holds no checkpoint (no {}) and "
              "--exit-on-missing-checkpoint is set: give the --save directory of an earlier run",
              ck.load, ckpt::kTrackerFile);
    if (logging_rank()) {
      fmt::print(log,
                 "[checkpoint] --load {}: no checkpoint there yet ({} missing): training "
                 "from the start\n",
                 ck.load, ckpt::kTrackerFile);
    }
    return loaded;
  }
  if (logging_rank()) {
    fmt::print(log,
               "[checkpoint] loaded iteration {} from {}{}: continuing at iteration {}, "
               "consumed samples {}\n",
               *loaded, ckpt::iteration_dir(ck.load, *loaded).string(),
               ck.upcycling  ? " (--moe-use-upcycling: every expert a copy of the dense MLP)"
               : ck.finetune ? " (--finetune: the weights only)"
                             : (!ck.load_optim ? " (--no-load-optim: without the optimizer)" : ""),
               iteration_, consumed_train_samples());
  }
  return loaded;
}

template <typename T>
uint64_t BasicTrainer<T>::weights_digest() const {
  buckets_->wait_params();  // --overlap-param-gather: the last step's gathers complete first
  const ParamRegistry& p = model_->params();
  // The digests of disjoint pieces add up (mod 2^64) over a group to the whole's.
  const auto sum_over = [this](uint64_t d, parallel::GroupKind g) {
    if (groups_ == nullptr || groups_->group(g).size() == 1) return d;
    std::vector<int64_t> sum{std::bit_cast<int64_t>(d)};
    groups_->group(g).communicator().all_reduce(sum);
    return std::bit_cast<uint64_t>(sum[0]);
  };
  std::function<bool(const Param&)> counted;
  if (buckets_->skips_some()) {
    counted = [this](const Param& q) { return buckets_->counted_once(q); };
  }
  uint64_t dense = 0, experts = 0;
  if (p.holds_master()) {
    // Dense parameters are whole on every rank; expert parameters are split over the EP group
    // (and replicated over expert-data-parallel ranks, which hold the same slices).
    dense = p.digest(ParamKind::Dense, counted);
    experts = p.digest(ParamKind::Expert, counted);
  } else {
    // The master weights are the distributed optimizer's shards: dense ones over dp x cp,
    // expert ones over expt_dp.
    dense = sum_over(optimizer_->dense().owned_master_digest(counted), parallel::GroupKind::DpCp);
    experts =
        sum_over(optimizer_->expert().owned_master_digest(counted), parallel::GroupKind::ExptDp);
  }
  // TP slices add up over tp (dense) and expt_tp (expert); replicated parameters count on TP
  // rank 0 only.
  // Pipeline stages hold disjoint layers (the last stage's copy of a tied table is not counted).
  return sum_over(sum_over(dense, parallel::GroupKind::Tp) + sum_over(experts, expert_model_group()),
                  parallel::GroupKind::Pp);
}

template <typename T>
typename pipeline::PipelineRunner<T>::Hooks BasicTrainer<T>::pipeline_hooks() {
  typename pipeline::PipelineRunner<T>::Hooks h;
  h.io = [this](int64_t mb, int chunk) { return step_->io(mb, chunk); };
  h.after_loss_forward = [this](int64_t mb, int chunk) {
    guard_->check_loss(mb,
                       member_ptr(step_->io(mb, chunk).report, &ops::MicroBatchReport::lm_loss_sum));
  };
  h.arm = [this] { buckets_->arm(); };
  h.stage_done = [this](int stage) { buckets_->stage_done(stage); };
  return h;
}

template <typename T>
int64_t BasicTrainer<T>::gather_micro_batch_values() {
  const int loss_chunk = model_->num_chunks() - 1;  // its report holds the loss, if any here
  const bool has_loss = model_->chunk(loss_chunk).loss;
  int64_t dropped = 0;
  for (int64_t mb = 0; mb < n_micro_; ++mb) {
    double* v = &mb_values_[mb * mb_width_];
    std::fill(v, v + mb_width_, 0.0);
    if (has_loss) {
      const ops::MicroBatchReport& r = step_->report(mb, loss_chunk);
      v[0] = r.lm_loss_sum;
      v[1] = static_cast<double>(r.counted);
      for (int64_t j = 0; j < model_cfg_.mtp_num_layers; ++j) {
        v[kMbValues + 2 * j] = r.mtp_loss_sum[j];
        v[kMbValues + 2 * j + 1] = static_cast<double>(r.mtp_counted[j]);
      }
    }
    for (int c = 0; c < model_->num_chunks(); ++c) {
      const ops::MicroBatchReport& r = step_->report(mb, c);
      if (r.moe_layers == 0) continue;
      v[2] += r.aux_value;
      v[3] += r.z_value;
      v[4] += static_cast<double>(r.moe_layers);
      dropped += r.dropped;
      const int64_t* tokens = step_->tokens_per_expert(mb, c);
      for (size_t e = 0; e + 1 < load_.size(); ++e) load_[e] += tokens[e];
    }
  }
  // Pipeline stages: the loss is the last stage's, the MoE layers' values are every stage's.
  sum_over_pipeline(mb_values_);
  // Every micro-batch of the global batch, for sums in global order (the same arithmetic as
  // one rank).
  // The cp ranks of a group report the same values (the model sums the loss over cp, the
  // routers their aux and z values over tp x cp): gathered over dp.
  if (dp_size_ > 1) {
    ScopedPhase phase(Phase::Communication);
    groups_->group(parallel::GroupKind::Dp).communicator().all_gather(mb_values_, all_values_);
  } else {
    all_values_ = mb_values_;
  }
  return dropped;
}

template <typename T>
void BasicTrainer<T>::sum_over_pipeline(std::vector<double>& values) const {
  if (groups_ == nullptr || groups_->degrees().pp == 1) return;
  ScopedPhase phase(Phase::Communication);
  groups_->group(parallel::GroupKind::Pp).communicator().all_reduce(values);
}

template <typename T>
bool BasicTrainer<T>::has_eval_data(data::Split split) const {
  return cfg_.eval_iters > 0 && eval_streams_[static_cast<int>(split)] != nullptr;
}

template <typename T>
int64_t BasicTrainer<T>::consumed_valid_samples() const {
  const auto& s = eval_streams_[static_cast<int>(data::Split::Valid)];
  return s ? s->consumed_samples() : 0;
}

template <typename T>
void BasicTrainer<T>::set_consumed_valid_samples(int64_t n) {
  const auto& s = eval_streams_[static_cast<int>(data::Split::Valid)];
  MOE_CHECK(s != nullptr || n == 0, "[train] no validation split to resume at sample {}", n);
  if (s) s->set_consumed_samples(n);
}

template <typename T>
EvalMetrics BasicTrainer<T>::evaluate(data::Split split) {
  data::SampleStream* stream = eval_streams_[static_cast<int>(split)].get();
  MOE_CHECK(stream != nullptr && cfg_.eval_iters > 0, "[train] no {} data to evaluate on",
            data::split_name(split));
  const int64_t n_global = n_micro_ * dp_size_;
  buckets_->wait_params();  // --overlap-param-gather: whole weights before any eval forward
  EvalMetrics r;
  r.iteration = iteration_;
  r.split = data::split_name(split);
  model_->set_training(false);
  double sum = 0, counted = 0;
  for (int64_t it = 0; it < cfg_.eval_iters; ++it) {
    fill_inputs(*stream);
    runner_->forward_only(pipeline_hooks());
    step_->download();
    gather_micro_batch_values();  // the report, after the iteration's forwards
    // The token mean over every evaluated micro-batch, as Megatron's evaluate(), summed in
    // global order (the same arithmetic at any data-parallel size).
    for (int64_t mb = 0; mb < n_global; ++mb) {
      sum += all_values_[mb * mb_width_];
      counted += all_values_[mb * mb_width_ + 1];
    }
    stream->advance();
    r.samples += cfg_.global_batch;
  }
  model_->set_training(true);
  r.lm_loss = counted > 0 ? sum / counted : 0.0;
  r.ppl = std::exp(std::min(20.0, r.lm_loss));
  evals_.push_back(r);
  return r;
}

template <typename T>
void BasicTrainer<T>::evaluate_and_print(std::ostream& log, data::Split split,
                                         const char* where, MetricsFile& metrics) {
  const EvalMetrics r = evaluate(split);
  // Megatron's evaluate_and_print_results line, framed by dashes.
  const std::string line = fmt::format(
      " validation loss at iteration {}{} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ",
      r.iteration, where, r.lm_loss, r.ppl);
  const std::string dashes(line.size() + 1, '-');
  fmt::print(log, "{}\n{}\n{}\n", dashes, line, dashes);
  log.flush();
  metrics.write(r);
}

template <typename T>
void BasicTrainer<T>::print_summary(std::ostream& log, const std::vector<StepMetrics>& all) const {
  if (all.empty()) {  // resumed at --train-iters already
    if (logging_rank()) fmt::print(log, "[train] no iterations run: at --train-iters already\n");
    return;
  }
  // Steady state: the first iterations (thread pools, page faults) are left out when possible.
  const size_t skip = all.size() > 4 ? 2 : 0;
  double seconds = 0;
  std::array<double, kNumPhases> phases{};
  for (size_t i = skip; i < all.size(); ++i) {
    seconds += all[i].seconds;
    for (int p = 0; p < kNumPhases; ++p) phases[p] += all[i].phase_seconds[p];
  }
  const double iters = static_cast<double>(all.size() - skip);
  const double tokens_per_s = iters * cfg_.global_batch * model_cfg_.seq_length / seconds;
  const MfuReport mfu =
      mfu_report(flops_.train_flops_per_token() * tokens_per_s, 1.0, job_peak_gflops());
  const double gflops = mfu.achieved_gflops;
  std::string breakdown;
  for (int p = 0; p < kNumPhases; ++p) {
    breakdown += fmt::format("{}{} {:.1f} ms ({:.0f}%)", p ? ", " : "",
                             phase_name(static_cast<Phase>(p)), phases[p] / iters * 1e3,
                             100.0 * phases[p] / seconds);
  }
  fmt::print(log,
             "[summary] {:.0f} tokens/s | {:.1f} GFLOP/s | MFU {:.1f}% of {:.1f} GFLOP/s {} GEMM "
             "peak{} | step {:.1f} ms: {} | peak mem {:.1f} MiB\n",
             tokens_per_s, gflops, 100.0 * mfu.mfu, mfu.peak_gflops,
             model_cfg_.bf16 ? "bf16" : "fp32",
             mfu.peak_raised
                 ? fmt::format(" (raised to the achieved rate: the {} peak of {:.1f} GFLOP/s was "
                               "under-measured)",
                               cfg_.peak_gflops > 0 ? "given" : "probed", job_peak_gflops())
                 : ranks() > 1 ? fmt::format(" ({} ranks x {:.1f})", ranks(), peak_gflops_)
                               : std::string(),
             seconds / iters * 1e3, breakdown, all.back().peak_mem_bytes / (1024.0 * 1024.0));
  if (cfg_.sync_audit && iters > 1) {
    const SyncAudit& audit = SyncAudit::instance();
    std::string counted;
    for (const auto& [what, n] : audit.documented_syncs()) {
      counted += fmt::format("{}{} x{}", counted.empty() ? ": " : "; ", what, n);
    }
    fmt::print(log,
               "[sync-audit] steps 2-{} audited: {} allocations, {} undocumented host syncs; "
               "counted in the last step{}\n",
               iteration_, audit.allocations(), audit.violations().size(),
               counted.empty() ? ": nothing" : counted);
  }
}

template class BasicTrainer<float>;
template class BasicTrainer<double>;

}  // namespace moecore::train
