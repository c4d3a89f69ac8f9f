// The training loop: the global batch of each iteration from a token source, each data-parallel
// rank taking its contiguous share, split into micro-batches with gradient accumulation;
// gradients reduced over the data-parallel groups in buckets (overlapped with the backward under
// --overlap-grad-reduce); the ChainedOptimizer (dense and expert AdamW, one global norm, one clip
// coefficient) with the LR schedule; log lines every --log-interval (Megatron's format plus
// throughput, MFU, expert load, memory; rank 0 prints and writes the metrics file), a live
// progress line on terminals and an optional JSON-lines metrics file. A template over the model
// dtype so that tests can train the f64 model with the same loop.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/stream_graph.h"
#include "data/data_pipeline.h"
#include "data/sample_stream.h"
#include "data/token_source.h"
#include "model/config.h"
#include "model/gpt_model.h"
#include "moe/routing_replay.h"
#include "optim/chained_optimizer.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "parallel/grad_buckets.h"
#include "parallel/parallel_config.h"
#include "parallel/pipeline_layout.h"
#include "parallel/process_groups.h"
#include "pipeline/pipeline_runner.h"
#include "train/checkpoint_config.h"
#include "train/metrics.h"
#include "train/numeric_guard.h"
#include "train/progress.h"
#include "train/save_in_flight.h"
#include "train/step_buffers.h"

namespace moecore::train {

struct TrainConfig {
  int64_t micro_batch = 8;    // --micro-batch-size
  int64_t global_batch = 16;  // --global-batch-size
  int64_t train_iters = 300;  // --train-iters
  int64_t log_interval = 25;  // --log-interval
  int64_t eval_interval = 0;  // --eval-interval (0: only after training)
  int64_t eval_iters = 100;   // --eval-iters: global batches per evaluation (0: none)
  uint64_t seed = 1234;       // --seed
  data::DataConfig data;
  optim::LrSchedule lr;
  optim::AdamWConfig adam;
  std::string metrics_file;   // --metrics-file (JSON lines)
  std::string device = "cpu"; // --device: the backend every op of the step runs on
  // --fp32-matmul-precision (PyTorch's torch.set_float32_matmul_precision names): "highest" (the
  // default: full f32 GEMM products, the reference) or "high" (f32 GEMMs on CUDA may round their
  // inputs to TF32: ops/f32_matmul_precision.h; on the CPU a no-op with a notice).
  std::string fp32_matmul_precision = "highest";
  bool sync_audit = false;    // --sync-audit: every step proves it allocates and syncs nothing
  // --cuda-graph-impl (Megatron's): "none", or "full_iteration": on a device, the forward and
  // backward of every micro-batch (the gradient reduction included, the optimizer step not)
  // captured as one CUDA graph after --cuda-graph-warmup-steps eager steps and replayed each
  // step after (docs/gpu.md, "CUDA graphs"). The CLI refuses Megatron's per-layer "local" and
  // "transformer_engine" before step 0.
  std::string cuda_graph_impl = "none";
  int64_t cuda_graph_warmup_steps = 3;  // --cuda-graph-warmup-steps (Megatron's default)
  double peak_gflops = 0;     // --peak-tflops * 1000; 0: measured at start-up
  bool live_progress = false; // a redrawn progress line (set when stdout is a terminal)
  parallel::GradReduceConfig ddp;  // --overlap-grad-reduce, --ddp-bucket-size
  CheckpointConfig ckpt;           // --save, --load, --exit-*, ...
  NumericGuardConfig guard;        // --check-for-nan-in-loss-and-grad, --check-for-spiky-loss, ...
  // --iterations-to-skip (Megatron): these 1-based iterations consume their batch and change
  // nothing else (no forward, backward or update).
  std::vector<int64_t> iterations_to_skip;
  // Routing replay (moe/routing_replay.h; no flag): a store in Record mode receives every MoE
  // layer's routing of every training iteration (each rank's store: its layers' whole tables,
  // merged over TP x DP x CP); one in Replay mode routes each iteration's tokens to what it
  // holds. Its global batch, sequence length and top-k must be the run's.
  std::shared_ptr<moe::RoutingReplay> routing_replay;
  // Checks every value; dp is the data-parallel size (the global batch splits over it).
  void validate(int dp = 1) const;
};

// The global batch splits into whole micro-batches per data-parallel rank (TrainConfig::validate
// and `moecore plan`: one message for both).
void check_batch_split(int64_t global_batch, int64_t micro_batch, int dp);

// What `moecore train` refuses of a layout before step 0, naming the flags: context parallelism
// combined with what it is not built or tested with yet (quantile balancing, MTP with learned
// absolute positions). The layout's own rules (degrees,
// divisibility, --cp-comm-type) are parallel::validate_layout's.
void check_parallel_support(const parallel::ParallelConfig& cfg, const ModelConfig& model);

// What `moecore train --device <device>` (not the CPU) refuses of a layout before step 0, naming
// it: more than one process in a build without NCCL (the device's collectives run on NCCL, one
// communicator per distinct group).
void check_device_parallel_support(const std::string& device, const parallel::ParallelConfig& cfg,
                                   const parallel::Degrees& degrees, const ModelConfig& model);

// How the gradient norm's sums of squares combine over the ranks of these groups (null: one
// rank) for these buckets (MOE_SEMANTICS "Gradients and the optimizer"): every element counted
// once (replicated parameters on TP rank 0 only: GradBuckets::counted_once), the distributed
// optimizer's owned sums over dp x cp / expt_dp, then the dense sum over tp and the expert sum
// over tp_ep (ep without expert tensor parallelism).
optim::GradNormSync grad_norm_sync(const parallel::ProcessGroups* groups,
                                   const parallel::GradBuckets& buckets, const Exec& ex);

template <typename T>
class BasicTrainer {
 public:
  // groups: this rank's process groups (null: one rank). Collective over the world when given:
  // every rank constructs its trainer with the same configs.
  BasicTrainer(const ModelConfig& model_cfg, const TrainConfig& cfg,
               const parallel::ProcessGroups* groups = nullptr);

  // Runs the iterations up to train_iters, logging to `log`, and returns the metrics of every
  // iteration run (global values: the same on every rank). With cfg.ckpt: first resumes from
  // --load, saves every --save-interval and at the end, and stops early (after saving) on the
  // --exit-* conditions; stopped_early() then says so. A numeric guard's stop throws
  // NumericFault on every rank at the same iteration, saving nothing.
  std::vector<StepMetrics> run(std::ostream& log);
  bool stopped_early() const { return stopped_early_; }
  // One iteration. Throws NumericFault when a guard stops the run (the update was skipped on
  // every rank); StepMetrics::skipped says the iteration was skipped (--iterations-to-skip,
  // --skip-spiky-steps).
  StepMetrics train_step();
  const NumericGuard& numeric_guard() const { return *guard_; }

  // Evaluates the model on the next --eval-iters global batches of the validation (or test)
  // split: forward only, in eval mode (no router jitter, no balancing counts). Collective over
  // the data-parallel group. Requires has_eval_data(split).
  EvalMetrics evaluate(data::Split split);
  bool has_eval_data(data::Split split) const;
  const std::vector<EvalMetrics>& eval_results() const { return evals_; }
  // Scores token sequences (`moecore eval --tokens-json`): each alone in row 0 of a micro-batch,
  // padded to --seq-length after its end (causal attention never lets it see the padding, whose
  // targets are ignored), through the evaluation's forward in any layout (the pipeline's stages,
  // the context-parallel chunks, the device's memory), the step's micro-batches of every
  // data-parallel rank at once. Returns each sequence's cross entropy summed over its
  // predictions (0 for one of fewer than 2 tokens), on every rank. Collective over the world;
  // each sequence holds at most --seq-length token ids below the vocabulary's size.
  std::vector<double> score_sequences(const std::vector<std::vector<int32_t>>& seqs);

  // The data position (Megatron's consumed_train_samples / consumed_valid_samples), for
  // checkpoints: a run resumed with the saved values continues the same sample streams.
  int64_t consumed_train_samples() const { return train_stream_->consumed_samples(); }
  void set_consumed_train_samples(int64_t n) { train_stream_->set_consumed_samples(n); }
  int64_t consumed_valid_samples() const;
  int64_t iteration() const { return iteration_; }
  // Checkpoints (docs/checkpoint_format.md). save_checkpoint writes this iteration into
  // <dir>/iter_NNNNNNN: each rank the slices it is the first holder of (weights, with
  // save_optim the AdamW moments, the routers' balancing state), then rank 0 the manifest and,
  // last, the tracker. Collective over the world; a failure on any rank throws on every rank.
  // async (--async-save): returns once the state is copied to host memory; the shards are
  // written in the background and the save completes in finish_pending_save (the next save and
  // the end of run() wait for it).
  void save_checkpoint(const std::filesystem::path& dir, bool save_optim = true,
                       bool save_rng = true, bool async = false);
  // Completes a background save (collective): returns its iteration, -1 when none is pending;
  // with only_if_written, only when every rank has written its shards (else -1, still pending).
  int64_t finish_pending_save(bool only_if_written = false);
  using LoadOptions = train::LoadOptions;
  // Loads a checkpoint of `dir` into this trainer, whatever layout wrote it (each rank reads
  // its own slices): weights, router state, iteration and data position, the optimizer and the
  // random streams as `opt` says. Returns the iteration loaded, nullopt when `dir` holds no
  // checkpoint (no tracker). Refuses a checkpoint of another model naming the flags that differ.
  // Collective over the world.
  std::optional<int64_t> load_checkpoint(const std::filesystem::path& dir,
                                         const LoadOptions& opt = LoadOptions());
  void set_consumed_valid_samples(int64_t n);
  const data::TokenSource& train_data() const { return *data_; }

  double entropy_floor() const { return data_->entropy_floor(); }
  // Digest of the whole model's master weights (ParamRegistry::digest of every parameter, the
  // expert-parallel slices summed over the EP group): a function of the global values alone,
  // whatever the layout. Collective: every rank calls it.
  uint64_t weights_digest() const;
  // One rank's peak (probed at its own threads, or --peak-tflops: per device, as Megatron's
  // TFLOP/s/GPU) and the job's, which MFU divides by: the global batch's FLOPs run on every rank.
  double peak_gflops() const { return peak_gflops_; }
  int ranks() const { return groups_ != nullptr ? groups_->world_size() : 1; }
  double job_peak_gflops() const { return peak_gflops_ * ranks(); }
  model::GPTModel<T>& model() { return *model_; }
  const parallel::GradBuckets& grad_buckets() const { return *buckets_; }
  const optim::ChainedOptimizer& optimizer() const { return *optimizer_; }
  const pipeline::PipelineRunner<T>& pipeline_runner() const { return *runner_; }
  int dp_size() const { return dp_size_; }
  int dp_rank() const { return dp_rank_; }

 private:
  void print_header(std::ostream& log) const;
  // The group an expert's sums over its model-parallel ranks run in: ep, or tp_ep (expt_tp x
  // ep) with expert tensor parallelism.
  parallel::GroupKind expert_model_group() const {
    return groups_ != nullptr && groups_->group(parallel::GroupKind::ExptTp).size() > 1
               ? parallel::GroupKind::TpEp
               : parallel::GroupKind::Ep;
  }
  // The optimizer state's sharding degree per kind and the bytes per parameter of weights +
  // grads + optimizer state, measured from the arenas and by state_bytes_formula, into m.
  void memory_per_param(StepMetrics& m) const;
  // Loads --load as cfg_.ckpt says; prints what it loaded (or that there is nothing yet).
  std::optional<int64_t> resume(std::ostream& log);
  // Startup recovery of --load and --save after a crash in a save (ckpt::recover_checkpoint_dir,
  // on rank 0 before any rank reads them); prints what it did. Collective.
  void recover_checkpoint_dirs(std::ostream& log);
  // The log line of the interval ending at m (the means of acc over in_interval steps), which
  // it then resets.
  void log_interval_means(std::ostream& log, MetricsFile& metrics, ProgressLine& progress,
                          StepMetrics& acc, int64_t& in_interval, const StepMetrics& m);
  void print_summary(std::ostream& log, const std::vector<StepMetrics>& all) const;
  bool logging_rank() const { return groups_ == nullptr || groups_->rank() == 0; }
  // The world's communicator; null for one rank (the checkpoint protocol's and exits' agreement).
  parallel::Communicator* world_comm() const;

  ModelConfig model_cfg_;
  TrainConfig cfg_;
  // The groups every component is given: the caller's, or on a device their copy with the
  // device communicators (device_groups_).
  const parallel::ProcessGroups* groups_ = nullptr;
  Exec exec_;  // from --device, before anything is built
  // On a device: the caller's groups with NCCL communicators on exec_'s stream (made once, here,
  // before the model; after exec_ and before everything holding a communicator, so destroyed
  // after them and before the context).
  std::unique_ptr<parallel::ProcessGroups> device_groups_;
  // The data-parallel ranks that read different samples (dp; the cp ranks of a group read the
  // same ones), and this rank's context-parallel share of each sequence.
  int dp_size_ = 1, dp_rank_ = 0;
  parallel::ContextSplit cp_split_;
  int64_t n_micro_ = 1;  // micro-batches per dp rank and step
  void evaluate_and_print(std::ostream& log, data::Split split, const char* where,
                          MetricsFile& metrics);

  data::DataSplits splits_;      // train (the synthetic language when no data is given), valid, test
  data::TokenSource* data_ = nullptr;  // the training split
  std::unique_ptr<data::SampleStream> train_stream_;
  std::array<std::unique_ptr<data::SampleStream>, data::kNumSplits> eval_streams_;
  std::vector<EvalMetrics> evals_;
  std::unique_ptr<model::GPTModel<T>> model_;
  std::unique_ptr<parallel::GradBuckets> buckets_;
  std::unique_ptr<optim::ChainedOptimizer> optimizer_;
  std::unique_ptr<NumericGuard> guard_;
  // A --skip-spiky-steps skip: the step counters the update and the routers advanced go back.
  void undo_step_counters();
  moe::RouterStepSync router_sync_;
  std::unique_ptr<StepBuffers> step_;  // the step's inputs and report, one slot per micro-batch
  FlopsModel flops_;
  double peak_gflops_ = 0;
  std::vector<int32_t> scratch_;  // the data loader's, sized once before step 0
  // Context parallelism: one micro-batch's whole sequences [B, S], before the split.
  std::vector<int32_t> global_ids_, global_targets_;
  std::vector<int32_t> rolled_ids_, rolled_targets_;  // an MTP depth's, before the split
  std::vector<int64_t> load_;
  // Fills this rank's share of the inputs of every micro-batch of the step (or of one eval
  // iteration) from `stream`.
  void fill_inputs(data::SampleStream& stream);
  // Context parallelism: micro-batch mb's inputs from its whole sequences [B, S] (host): this
  // rank's chunks of them, and of MTP's tokens rolled on them, into the step's staging.
  void split_inputs(int64_t mb, const int32_t* ids_BS, const int32_t* targets_BS);
  // Routing replay (train/routing_replay_step.cpp): the checks and the model's mode before it is
  // built; micro-batch mb's tables staged (replay: the store's rows of its samples; record: -1);
  // after the step, the recorded tables merged over TP x DP x CP into the store.
  void check_routing_replay();
  void stage_routing(int64_t mb);
  void record_routing();
  std::vector<std::string> routing_layers_;  // the model's MoE layers, in its tables' order
  std::vector<int32_t> routing_merge_;       // one layer's [global batch, S, K] (record)
  // What the pipeline runner asks the trainer for (inputs, report slots) and tells it (the
  // loss for the guards, gradients ready for the buckets).
  typename pipeline::PipelineRunner<T>::Hooks pipeline_hooks();
  // values summed over the pipeline group (no-op without pipeline parallelism).
  void sum_over_pipeline(std::vector<double>& values) const;
  // After a step's (or an eval iteration's) download: this rank's micro-batch values from the
  // report slots (the loss chunk's loss and count, every chunk's MoE sums; tokens per expert
  // added into load_), summed over the pipeline, gathered over dp x cp into all_values_.
  // Returns the dropped (token, slot) pairs of this rank's MoE layers.
  int64_t gather_micro_batch_values();
  parallel::PipelineLayout layout_;  // pipeline parallelism: where every layer is
  std::unique_ptr<pipeline::PipelineRunner<T>> runner_;
  // Per micro-batch: lm loss sum, counted tokens, aux and z values summed over the MoE layers,
  // the MoE layers (over the pipeline stages once summed), then each MTP depth's loss sum and
  // count: mb_width_ = 5 + 2 x --mtp-num-layers values.
  static constexpr int64_t kMbValues = 5;
  int64_t mb_width_ = kMbValues;
  std::vector<double> mb_values_;  // [n_micro, mb_width_]
  std::vector<double> guard_losses_;  // [n_micro]: this rank's loss sums, for the guards
  int64_t eod_mask_ = -1;           // --eod-mask-loss: the tokenizer's EOD (-1: no masking)
  std::vector<double> all_values_;  // [dp * n_micro, 3]: every micro-batch of the global batch
  int64_t iteration_ = 0;
  bool stopped_early_ = false;
  // --cuda-graph-impl full_iteration (docs/gpu.md, "CUDA graphs"). The step's forward and
  // backward of every micro-batch and the gradient reduction (forward_backward): eager for the
  // warm-up steps, then captured once and replayed. What cannot be captured is refused before
  // step 0 where it is known (check_cuda_graph_support), otherwise by the capture, by name.
  void check_cuda_graph_support();
  void forward_backward(int64_t n_global);
  void graph_region(const std::function<void()>& work);
  bool graphs_ = false;            // full_iteration on a device (a no-op on the CPU)
  int64_t graph_eager_steps_ = 0;  // warm-up steps run so far in this process
  std::unique_ptr<StreamGraph> graph_;
  // The routers' host counts the captured step left (Router::StepCounts), set before each
  // replay's finish_step.
  std::vector<moe::Router<T>*> graph_routers_;
  std::vector<typename moe::Router<T>::StepCounts> graph_router_counts_;
  std::string graph_note_;                      // the capture's log line, printed after its step
  // The traffic the step counts (StepMetrics: alltoall_bytes, tp / expt_tp bytes and calls), as
  // the communicators' host counters have it. A replay moves the captured region's traffic
  // without the host calls that count it, so the region's share, counted while capturing, is
  // added to each replayed step's.
  struct StepComm {
    int64_t alltoall_bytes = 0;
    parallel::CommBytesSent tp_bytes, etp_bytes;
    int64_t tp_calls = 0, etp_calls = 0;
    int64_t pp_bytes = 0;  // the pipeline group's sends
    StepComm operator-(const StepComm& o) const {
      return {alltoall_bytes - o.alltoall_bytes, tp_bytes - o.tp_bytes, etp_bytes - o.etp_bytes,
              tp_calls - o.tp_calls, etp_calls - o.etp_calls, pp_bytes - o.pp_bytes};
    }
    StepComm operator+(const StepComm& o) const {
      const auto sum = [](const parallel::CommBytesSent& a, const parallel::CommBytesSent& b) {
        return parallel::CommBytesSent{a.all_gather + b.all_gather,
                                       a.reduce_scatter + b.reduce_scatter,
                                       a.all_reduce + b.all_reduce, a.all_to_all + b.all_to_all,
                                       a.send + b.send};
      };
      return {alltoall_bytes + o.alltoall_bytes, sum(tp_bytes, o.tp_bytes),
              sum(etp_bytes, o.etp_bytes), tp_calls + o.tp_calls, etp_calls + o.etp_calls,
              pp_bytes + o.pp_bytes};
    }
  };
  StepComm step_comm() const;
  StepComm graph_comm_;          // the captured region's
  bool graph_replayed_ = false;  // this step's region was a replay
  std::unique_ptr<SaveInFlight> pending_save_;  // an --async-save being written
  PhaseProfiler profiler_;
};

using Trainer = BasicTrainer<float>;

}  // namespace moecore::train
