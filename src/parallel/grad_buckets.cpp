#include "parallel/grad_buckets.h"

#include <algorithm>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/memory.h"

namespace moecore::parallel {

void GradReduceConfig::validate() const {
  MOE_CHECK(bucket_size >= 0,
            "[ddp] --ddp-bucket-size {} must be >= 0 (elements per gradient bucket; 0: one "
            "bucket per layer)",
            bucket_size);
  MOE_CHECK(!overlap_param_gather || (distributed_optimizer && overlap),
            "[ddp] --overlap-param-gather needs --use-distributed-optimizer and "
            "--overlap-grad-reduce (Megatron's requirements; given: --use-distributed-optimizer "
            "{}, --overlap-grad-reduce {}): add the missing flag or drop --overlap-param-gather",
            distributed_optimizer ? "yes" : "no", overlap ? "yes" : "no");
}

GradBuckets::GradBuckets(const ParamRegistry& params,
                         const std::vector<std::vector<const Param*>>& stages,
                         const ProcessGroup* dense_group, const ProcessGroup* expert_group,
                         const GradReduceConfig& cfg, const ProcessGroup* dense_tp,
                         const ProcessGroup* expert_tp)
    : params_(params), cfg_(cfg), tp_arena_(params.exec()) {
  cfg_.validate();
  groups_[0] = dense_group;
  groups_[1] = expert_group;
  tp_groups_[0] = dense_tp;
  tp_groups_[1] = expert_tp;
  for (int k = 0; k < 2; ++k) communicates_[k] = groups_[k] != nullptr && groups_[k]->size() > 1;

  // Walk the parameters in the order their gradients become final; a bucket grows downwards
  // through its kind's flat buffer while the next parameter sits right below it and the bucket
  // is not full (one stage per bucket when no size is given).
  std::vector<GradBucket> open(2);
  std::vector<char> has_open(2, 0);
  std::vector<GradBucket> closed;
  for (size_t s = 0; s < stages.size(); ++s) {
    for (int k = 0; k < 2; ++k) {
      std::vector<const Param*> ps;
      for (const Param* p : stages[s]) {
        if (static_cast<int>(p->spec.kind) == k) ps.push_back(p);
      }
      std::sort(ps.begin(), ps.end(),
                [](const Param* a, const Param* b) { return a->offset > b->offset; });
      for (const Param* p : ps) {
        const int64_t n = p->local_numel();
        GradBucket& cur = open[k];
        const bool extend =
            has_open[k] && p->offset + n == cur.offset &&
            (cfg_.bucket_size == 0 ? cur.ready_stage == static_cast<int>(s)
                                   : cur.count < cfg_.bucket_size);
        if (extend) {
          cur.offset = p->offset;
          cur.count += n;
          cur.ready_stage = static_cast<int>(s);
          cur.params.push_back(p->name());
          continue;
        }
        if (has_open[k]) closed.push_back(std::move(cur));
        cur = GradBucket{static_cast<ParamKind>(k), p->offset, n, static_cast<int>(s), {p->name()}};
        has_open[k] = 1;
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    if (has_open[k]) closed.push_back(std::move(open[k]));
  }
  // Launch order = bucket order: by ready stage, dense before expert, then as formed. The same
  // on every rank of a group, as collectives on one communicator must be.
  std::stable_sort(closed.begin(), closed.end(), [](const GradBucket& a, const GradBucket& b) {
    if (a.ready_stage != b.ready_stage) return a.ready_stage < b.ready_stage;
    return a.kind < b.kind;
  });
  buckets_ = std::move(closed);

  int64_t covered[2] = {0, 0};
  for (const GradBucket& b : buckets_) covered[static_cast<int>(b.kind)] += b.count;
  for (int k = 0; k < 2; ++k) {
    MOE_CHECK(covered[k] == params_.numel(static_cast<ParamKind>(k)),
              "[ddp] gradient buckets cover {} of the {} {} gradient elements: a parameter is "
              "missing from the model's backward stages",
              covered[k], params_.numel(static_cast<ParamKind>(k)), k == 0 ? "dense" : "expert");
  }
  handles_.resize(buckets_.size());
  tp_handles_.resize(buckets_.size());
  tp_unpacked_.assign(buckets_.size(), 0);
  gathers_.resize(buckets_.size());
  gather_pending_.assign(buckets_.size(), 0);
  launched_.assign(buckets_.size(), 0);
  if (sharded()) plan_shards();
  plan_tp_sums();
}

bool GradBuckets::counted_once(const Param& p) const {
  if (p.spec.pipeline_copy) return false;  // counted by the stage with the embedding
  if (p.spec.tp_role == TpRole::Sharded) return true;
  const ProcessGroup* g = tp_group(p.spec.kind);
  return g == nullptr || g->rank == 0;
}

void GradBuckets::plan_tp_sums() {
  tp_ranges_.assign(buckets_.size(), {});
  for (const Param& p : params_.params()) skips_some_ |= !counted_once(p);
  if (tp_group(ParamKind::Dense) == nullptr && tp_group(ParamKind::Expert) == nullptr) return;
  // The partial-gradient parameters in flat order, each in the bucket that holds it.
  std::vector<const Param*> partial;
  for (const Param& p : params_.params()) {
    if (p.spec.tp_role == TpRole::ReplicatedPartialGrad && tp_group(p.spec.kind) != nullptr &&
        p.local_numel() > 0) {
      partial.push_back(&p);
    }
  }
  std::sort(partial.begin(), partial.end(),
            [](const Param* a, const Param* b) { return a->offset < b->offset; });
  for (const Param* p : partial) {
    size_t b = 0;
    while (b < buckets_.size() &&
           !(buckets_[b].kind == p->spec.kind && p->offset >= buckets_[b].offset &&
             p->offset + p->local_numel() <= buckets_[b].offset + buckets_[b].count)) {
      ++b;
    }
    MOE_CHECK(b < buckets_.size(), "[ddp] '{}' lies in no gradient bucket", p->name());
    std::vector<Range>& rs = tp_ranges_[b];
    if (!rs.empty() && rs.back().offset + rs.back().count == p->offset) {
      rs.back().count += p->local_numel();
    } else {
      rs.push_back(Range{p->offset, p->local_numel()});
    }
    has_tp_sums_ = true;
  }
  // One all-reduce per bucket: a bucket with several ranges is packed into its slice of the
  // staging buffer (one range is summed where it lies).
  tp_count_.assign(buckets_.size(), 0);
  tp_staging_offset_.assign(buckets_.size(), -1);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (const Range& r : tp_ranges_[b]) tp_count_[b] += r.count;
    if (tp_ranges_[b].size() > 1) {
      tp_staging_offset_[b] = tp_staging_numel_;
      tp_staging_numel_ += tp_count_[b];
    }
  }
  // Only for a registry whose buffers exist (the planner's sizing pass builds buckets over an
  // unallocated one, and allocates nothing).
  const bool allocated = params_.flat_grad(ParamKind::Dense) != nullptr ||
                         params_.flat_grad(ParamKind::Expert) != nullptr;
  if (tp_staging_numel_ > 0 && allocated) {
    const size_t bytes = static_cast<size_t>(tp_staging_numel_) * dtype_size(params_.dtype());
    tp_arena_.plan([&](Arena& a) {
      tp_staging_ = a.alloc_bytes(bytes, "ddp.tp_sum_staging", MemKind::Workspace);
    });
  }
}

void GradBuckets::start_tp_sum(size_t b) {
  const std::vector<Range>& rs = tp_ranges_[b];
  tp_unpacked_[b] = rs.empty() ? 1 : 0;
  if (rs.empty()) return;
  const ProcessGroup* g = tp_group(buckets_[b].kind);
  const size_t esize = dtype_size(params_.dtype());
  DevPtr<char> flat = dev_ptr_cast<char>(params_.flat_grad(buckets_[b].kind));
  DevPtr<char> buf = flat + rs[0].offset * esize;
  if (tp_staging_offset_[b] >= 0) {
    MOE_CHECK(tp_staging_ != nullptr,
              "[ddp] the TP sums' staging buffer was not allocated (the parameter registry had "
              "no buffers when the gradient buckets were built)");
    buf = dev_ptr_cast<char>(tp_staging_) + tp_staging_offset_[b] * esize;
    int64_t at = 0;
    for (const Range& r : rs) {
      ops::copy<char>(params_.exec(), buf + at * esize,
                      DevPtr<const char>(flat + r.offset * esize), r.count * esize);
      at += r.count;
    }
  }
  tp_handles_[b] = g->device_communicator().all_reduce_async(DevPtr<void>(buf), tp_count_[b],
                                                      params_.dtype(), ReduceOp::Sum);
}

bool GradBuckets::finish_tp_sum(size_t b, bool wait) {
  if (tp_unpacked_[b]) return true;
  CommHandle& h = tp_handles_[b];
  if (!h.done()) {
    if (wait) {
      h.wait_on(params_.exec());  // the unpacking copies, then the reduction, read the sums
    } else if (!h.test()) {
      return false;
    }
  }
  if (tp_staging_offset_[b] >= 0) {
    const size_t esize = dtype_size(params_.dtype());
    DevPtr<char> flat = dev_ptr_cast<char>(params_.flat_grad(buckets_[b].kind));
    DevPtr<const char> buf = dev_ptr_cast<char>(tp_staging_) + tp_staging_offset_[b] * esize;
    int64_t at = 0;
    for (const Range& r : tp_ranges_[b]) {
      ops::copy<char>(params_.exec(), flat + r.offset * esize, buf + at * esize, r.count * esize);
      at += r.count;
    }
  }
  tp_unpacked_[b] = 1;
  return true;
}

void GradBuckets::start_ready_reductions(bool wait) {
  while (next_reduction_ < buckets_.size() && launched_[next_reduction_]) {
    if (!finish_tp_sum(next_reduction_, wait)) return;
    start_reduction(next_reduction_);
    ++next_reduction_;
  }
}

void GradBuckets::plan_shards() {
  shards_.resize(buckets_.size());
  for (int k = 0; k < 2; ++k) {
    const int d = communicates_[k] ? groups_[k]->size() : 1;
    const int r = communicates_[k] ? groups_[k]->rank : 0;
    std::vector<size_t> of_kind;
    std::vector<int64_t> offsets, counts;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (static_cast<int>(buckets_[b].kind) != k) continue;
      of_kind.push_back(b);
      offsets.push_back(buckets_[b].offset);
      counts.push_back(buckets_[b].count);
    }
    std::vector<BucketShard> s = shard_buckets(offsets, counts, d, r, &owned_numel_[k]);
    for (size_t i = 0; i < of_kind.size(); ++i) shards_[of_kind[i]] = std::move(s[i]);
  }
}

void GradBuckets::arm() {
  armed_ = true;
  launched_early_ = 0;
  next_reduction_ = 0;
  std::fill(launched_.begin(), launched_.end(), 0);
}

void GradBuckets::launch(size_t b) {
  launched_[b] = 1;
  if (before_reduce_) before_reduce_(b);
  start_tp_sum(b);  // the TP sum of partial gradients first, then the data-parallel reduction
}

void GradBuckets::start_reduction(size_t b) {
  const GradBucket& bk = buckets_[b];
  const int k = static_cast<int>(bk.kind);
  if (!communicates_[k]) return;
  const size_t esize = dtype_size(params_.dtype());
  DevPtr<void> ptr = dev_ptr_cast<char>(params_.flat_grad(bk.kind)) + bk.offset * esize;
  if (sharded()) {
    // In place: the summed shard lands where it lies in the flat buffer.
    const BucketShard& s = shards_[b];
    DevPtr<void> mine = dev_ptr_cast<char>(ptr) + (s.begin - bk.offset) * esize;
    handles_[b] = groups_[k]->device_communicator().reduce_scatter_v_async(ptr, mine, s.counts,
                                                                    params_.dtype(), ReduceOp::Sum);
    return;
  }
  handles_[b] = groups_[k]->device_communicator().all_reduce_async(ptr, bk.count, params_.dtype(),
                                                            ReduceOp::Sum);
}

void GradBuckets::start_gather(size_t b) {
  const GradBucket& bk = buckets_[b];
  const int k = static_cast<int>(bk.kind);
  // The master values, or under --bf16 with the master weights in the optimizer's shards the
  // bf16 values (Megatron gathers the bf16 parameters: half the bytes).
  const ParamRegistry::Gathered g = params_.gathered_values(bk.kind);
  const size_t esize = dtype_size(g.dtype);
  DevPtr<char> flat = dev_ptr_cast<char>(g.data);
  // Own slot of the receive buffer as the send buffer: gathered in place.
  gathers_[b] = groups_[k]->device_communicator().all_gather_v_async(
      flat + shards_[b].begin * esize, flat + bk.offset * esize, shards_[b].counts, g.dtype);
}

void GradBuckets::gather_params() {
  if (!sharded()) return;
  MOE_CHECK(pending_gathers_ == 0,
            "[ddp] gather_params with {} parameter gathers of the last step still pending: the "
            "forward (params_needed) or wait_params must complete them first",
            pending_gathers_);
  ScopedPhase phase(Phase::Communication);
  if (defers_gathers()) {
    // Forward order: the buckets were formed in backward order, so the first forward stages
    // read the last buckets. The forward waits for them first; the rest transfer meanwhile.
    for (size_t b = buckets_.size(); b-- > 0;) {
      if (!communicates_[static_cast<int>(buckets_[b].kind)]) continue;
      start_gather(b);
      gather_pending_[b] = 1;
      ++pending_gathers_;
    }
    return;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (communicates_[static_cast<int>(buckets_[b].kind)]) start_gather(b);
  }
  for (CommHandle& h : gathers_) {
    if (!h.done()) h.wait_on(params_.exec());
  }
}

void GradBuckets::wait_gather(size_t b) {
  gathers_[b].wait_on(params_.exec());  // the forward's ops read the values next
  gather_pending_[b] = 0;
  --pending_gathers_;
  if (after_gather_) after_gather_(b);
}

void GradBuckets::params_needed(int stage) {
  if (pending_gathers_ == 0) return;
  ScopedPhase phase(Phase::Communication);
  for (size_t b = buckets_.size(); b-- > 0;) {
    if (gather_pending_[b] && buckets_[b].ready_stage >= stage) {
      wait_gather(b);
      ++waited_in_forward_;
    }
  }
  // Open MPI progresses non-blocking collectives only inside MPI calls.
  for (size_t b = buckets_.size(); b-- > 0;) {
    if (gather_pending_[b]) gathers_[b].test();
  }
}

void GradBuckets::wait_params() {
  if (pending_gathers_ == 0) return;
  ScopedPhase phase(Phase::Communication);
  for (size_t b = buckets_.size(); b-- > 0;) {
    if (gather_pending_[b]) wait_gather(b);
  }
}

void GradBuckets::stage_done(int stage) {
  if (!armed_ || !cfg_.overlap || !reduces()) return;
  ScopedPhase phase(Phase::Communication);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (launched_[b] || buckets_[b].ready_stage != stage) continue;
    launch(b);
    ++launched_early_;
  }
  // The reductions whose TP sums are in (without waiting for the others), then a test of
  // everything in flight: Open MPI progresses non-blocking collectives only inside MPI calls.
  start_ready_reductions(/*wait=*/false);
  for (CommHandle& h : tp_handles_) {
    if (!h.done()) h.test();
  }
  for (CommHandle& h : handles_) {
    if (!h.done()) h.test();
  }
}

void GradBuckets::finish() {
  armed_ = false;
  if (!reduces()) {
    // Nothing to reduce; the hook still sees every bucket.
    if (before_reduce_) {
      for (size_t b = 0; b < buckets_.size(); ++b) before_reduce_(b);
    }
    return;
  }
  ScopedPhase phase(Phase::Communication);
  // Every TP sum first (they run concurrently), then the reductions in bucket order, each
  // after its bucket's sum.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!launched_[b]) launch(b);
  }
  start_ready_reductions(/*wait=*/true);
  for (CommHandle& h : handles_) h.wait_on(params_.exec());  // the optimizer's ops read them
}

}  // namespace moecore::parallel
