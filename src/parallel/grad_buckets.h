// Data-parallel gradient reduction: the registry's flat gradient buffers cut into contiguous
// buckets, dense buckets all-reduced (sum) over dp x cp, expert buckets over expt_dp. With
// --overlap-grad-reduce a bucket's all-reduce starts, non-blocking, as soon as the backward stage
// that finishes its gradients is done, while the rest of the backward runs; without it the same
// buckets are reduced after the backward. Both issue identical collectives (same buckets, same
// order), so both give bitwise-identical gradients. The 1/|dp x cp| mean scale is not applied
// here: the trainer folds it into the backward's loss-gradient scale (docs/parallel.md).
// With --use-distributed-optimizer each bucket is reduce-scattered instead, in place: rank r of
// the group receives the sum of its shard r (parallel/bucket_shards.h) at the shard's own place
// in the flat gradient buffer (no second gradient buffer), and gather_params() all-gathers the
// updated shards of the values after the optimizer step. With --overlap-param-gather those
// gathers only start there, non-blocking, in forward order; the next forward waits for each
// bucket's gather just before its first stage that reads the bucket (params_needed), and
// everything else that reads the values calls wait_params() first.
// Tensor parallelism: the gradients of ReplicatedPartialGrad parameters (TpRole: each TP rank's
// gradient is a partial sum) are summed over their TP group (dense: the attention grid's tp,
// expert: expt_tp) before their bucket's data-parallel reduction, so that reduction and the
// optimizer see whole gradients. One all-reduce per bucket covers all of them (Megatron
// coalesces them the same way): a bucket's partial-gradient ranges are packed into a staging
// buffer planned at construction (summed in place when there is one range), all-reduced
// non-blocking when the bucket is launched, and unpacked once it completes; the bucket's
// data-parallel reduction starts only then, and those start in bucket order (the same on every
// rank, as collectives on one communicator must). With --overlap-grad-reduce the sums run
// during the backward (each stage's hook launches its buckets, tests the ones in flight and
// starts the reductions whose sums have arrived); without it finish() starts every bucket's sum
// at once, then the reductions in order. With TP groups of one rank nothing of this runs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "parallel/bucket_shards.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

struct GradReduceConfig {
  bool overlap = false;     // --overlap-grad-reduce
  int64_t bucket_size = 0;  // --ddp-bucket-size in elements; 0: one bucket per backward stage
  bool distributed_optimizer = false;  // --use-distributed-optimizer: reduce-scatter, gather
  // --overlap-param-gather: the gathers after the step overlap the next forward. Megatron's
  // requirements: --use-distributed-optimizer and --overlap-grad-reduce.
  bool overlap_param_gather = false;
  void validate() const;
};

struct GradBucket {
  ParamKind kind = ParamKind::Dense;
  int64_t offset = 0;  // element range [offset, offset + count) of the kind's flat grad buffer
  int64_t count = 0;
  int ready_stage = 0;  // the backward stage after which every gradient in it is final
  std::vector<std::string> params;  // names, for messages and tests
};

class GradBuckets {
 public:
  // stages: the parameters in the order their gradients become final (GPTModel::grad_stages()).
  // dense_group / expert_group: where each kind reduces (dp_cp, expt_dp); null or size 1: no
  // communication for that kind.
  // dense_tp / expert_tp: the TP groups of the kinds (tp, expt_tp) over which the gradients of
  // ReplicatedPartialGrad parameters are summed first; null or size 1: no TP sum.
  GradBuckets(const ParamRegistry& params, const std::vector<std::vector<const Param*>>& stages,
              const ProcessGroup* dense_group, const ProcessGroup* expert_group,
              const GradReduceConfig& cfg, const ProcessGroup* dense_tp = nullptr,
              const ProcessGroup* expert_tp = nullptr);

  // Before the backward of the step's last micro-batch: from now on stage_done may launch.
  void arm();
  // The model's grad-ready hook. With overlap: starts the buckets this stage completed and
  // lets the earlier ones progress. Without overlap (or not armed): nothing.
  void stage_done(int stage);
  // Starts every bucket not started yet (in bucket order) and waits for all of them. After it,
  // every rank of a group holds the same summed gradients.
  void finish();

  // Called with a bucket's index when its gradients are final and before its reduction starts
  // (also where nothing is reduced): the numeric guard checks each rank's own gradients there.
  void set_before_reduce(std::function<void(size_t bucket)> hook) {
    before_reduce_ = std::move(hook);
  }

  // --use-distributed-optimizer: after finish(), the flat gradient buffer holds the summed
  // gradients of this rank's shards at [shard(b).begin, + shard(b).count) of every bucket b
  // (owned_numel(kind) elements in all); outside them its contents are undefined (the
  // reduce-scatter's scratch). The owned layout (shard(b).owned_offset) packs the shards back
  // to back for the optimizer's moments. A kind whose group has one rank owns everything.
  bool sharded() const { return cfg_.distributed_optimizer && communicates(); }
  // sharded() of buckets over these groups, known before the registry is built (under --bf16 it
  // decides where the fp32 master weights live: ModelConfig::master_weights_sharded).
  static bool shards(const GradReduceConfig& cfg, const ProcessGroup* dense_group,
                     const ProcessGroup* expert_group) {
    return cfg.distributed_optimizer && ((dense_group != nullptr && dense_group->size() > 1) ||
                                         (expert_group != nullptr && expert_group->size() > 1));
  }
  const BucketShard& shard(size_t bucket) const { return shards_[bucket]; }
  int64_t owned_numel(ParamKind kind) const { return owned_numel_[static_cast<int>(kind)]; }
  // The group size a kind's optimizer state is sharded over (1: not sharded).
  int shard_degree(ParamKind kind) const {
    const int k = static_cast<int>(kind);
    return sharded() && communicates_[k] ? groups_[k]->size() : 1;
  }
  // The group a kind's gradients reduce over (null: none).
  const ProcessGroup* group(ParamKind kind) const { return groups_[static_cast<int>(kind)]; }
  // After the optimizer updated the owned elements: every bucket's shards all-gathered over its
  // group into the flat value buffers (in place), so that every rank holds the whole weights.
  // Collective; the ops that read the values next are ordered after it. With
  // --overlap-param-gather it only starts the gathers (the last bucket's first: forward order)
  // and returns; params_needed / wait_params complete them.
  void gather_params();
  // The forward's params-needed hook (GPTModel::set_params_needed_hook), before the forward
  // stage `stage` (grad_stages' index: the forward runs them from the last to 0): waits for
  // the gather of every bucket a parameter of that stage or a later-read one sits in (the
  // buckets whose ready_stage >= stage), and lets the other gathers progress. Nothing pending:
  // nothing.
  void params_needed(int stage);
  // Waits for every pending gather: before anything other than the forward reads the values
  // (evaluation, checkpoints, digests, the end of training). Collective only in that every
  // rank of a group has the same gathers pending.
  void wait_params();
  // Called with a bucket's index once its gathered values are in place (deferred gathers
  // only): --bf16 refreshes that bucket's compute copies there.
  void set_after_gather(std::function<void(size_t bucket)> hook) {
    after_gather_ = std::move(hook);
  }
  // Whether bucket b's gather is still outstanding; and how many bucket gathers a forward
  // completed (params_needed) since construction: the others went through wait_params (tests).
  bool gather_pending(size_t b) const { return !gather_pending_.empty() && gather_pending_[b]; }
  bool gathers_pending() const { return pending_gathers_ > 0; }
  int64_t waited_in_forward() const { return waited_in_forward_; }
  // True when gather_params defers its gathers to the forward (--overlap-param-gather with
  // sharding).
  bool defers_gathers() const { return cfg_.overlap_param_gather && sharded(); }

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Whether any bucket reduces over a data-parallel group.
  bool communicates() const { return communicates_[0] || communicates_[1]; }
  // The TP group of a kind (null: none or one rank) and the element ranges of a bucket whose
  // gradients are summed over it before the data-parallel reduction (ReplicatedPartialGrad
  // parameters, adjacent ones merged).
  const ProcessGroup* tp_group(ParamKind kind) const {
    const ProcessGroup* g = tp_groups_[static_cast<int>(kind)];
    return g != nullptr && g->size() > 1 ? g : nullptr;
  }
  struct Range {
    int64_t offset = 0;  // in the kind's flat gradient buffer
    int64_t count = 0;
  };
  const std::vector<Range>& tp_sum_ranges(size_t bucket) const { return tp_ranges_[bucket]; }
  // The elements of the bucket's one TP all-reduce (the sum of its ranges' counts; 0: none), and
  // the staging buffer's elements (the buckets with more than one range, packed back to back).
  int64_t tp_sum_count(size_t bucket) const { return tp_count_[bucket]; }
  int64_t tp_staging_numel() const { return tp_staging_numel_; }
  // Whether bucket b's data-parallel reduction has started (its TP sum, if any, complete).
  bool reduction_started(size_t b) const { return b < next_reduction_; }
  // Whether this rank counts parameter p once in the gradient norm and the weights digest, so
  // that the sums over the groups see every element once: a Sharded parameter on every rank of
  // its TP group, a replicated one (Replicated, ReplicatedPartialGrad) on TP rank 0 only; a
  // pipeline stage's copy of a tied table (ParamSpec::pipeline_copy) never (the first stage
  // counts it). Otherwise true with a TP group of one rank.
  bool counted_once(const Param& p) const;
  // Whether any parameter is not counted here (counted_once false for some).
  bool skips_some() const { return skips_some_; }
  int64_t launched_during_backward() const { return launched_early_; }

 private:
  // Bucket b's gradients are final: the hook, then its TP sum (if any) starts.
  void launch(size_t b);
  void start_tp_sum(size_t b);
  // True once b's TP sum is complete and unpacked into the flat buffer (waits for it with
  // `wait`, else only tests it).
  bool finish_tp_sum(size_t b, bool wait);
  void start_reduction(size_t b);
  // Starts the data-parallel reductions of the launched buckets in bucket order, each once its
  // TP sum is in: up to the first whose sum is still in flight (wait = false), or all of them.
  void start_ready_reductions(bool wait);
  // Whether finishing the buckets does anything beyond the hook (a DP or a TP reduction).
  bool reduces() const { return communicates() || has_tp_sums_; }
  void plan_shards();
  void plan_tp_sums();
  void start_gather(size_t b);
  void wait_gather(size_t b);

  const ParamRegistry& params_;
  GradReduceConfig cfg_;
  const ProcessGroup* groups_[2] = {nullptr, nullptr};
  bool communicates_[2] = {false, false};
  const ProcessGroup* tp_groups_[2] = {nullptr, nullptr};
  std::vector<std::vector<Range>> tp_ranges_;  // per bucket
  std::vector<int64_t> tp_count_;              // per bucket: elements of its TP all-reduce
  std::vector<int64_t> tp_staging_offset_;     // per bucket: in the staging buffer (-1: in place)
  std::vector<CommHandle> tp_handles_;         // per bucket: its TP sum in flight
  std::vector<char> tp_unpacked_;              // per bucket: its TP sum is back in place
  int64_t tp_staging_numel_ = 0;
  Arena tp_arena_;                             // the staging buffer, planned at construction
  DevPtr<void> tp_staging_ = nullptr;
  size_t next_reduction_ = 0;  // the buckets before it have started their reduction
  bool has_tp_sums_ = false;
  bool skips_some_ = false;
  std::vector<GradBucket> buckets_;
  std::vector<CommHandle> handles_;
  std::vector<char> launched_;
  bool armed_ = false;
  int64_t launched_early_ = 0;  // buckets started from stage_done in the last step
  std::function<void(size_t)> before_reduce_;
  std::function<void(size_t)> after_gather_;
  std::vector<CommHandle> gathers_;        // per bucket: the parameter all-gathers
  std::vector<char> gather_pending_;       // per bucket, deferred gathers not waited for yet
  int64_t pending_gathers_ = 0;
  int64_t waited_in_forward_ = 0;       // since construction
  std::vector<BucketShard> shards_;  // per bucket (--use-distributed-optimizer)
  int64_t owned_numel_[2] = {0, 0};
};

}  // namespace moecore::parallel
