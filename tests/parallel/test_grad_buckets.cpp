// Gradient buckets on one process: the model's backward stages (every parameter once, the hook
// fires stage by stage), buckets that tile the flat gradient buffers in backward order (one per
// stage by default, by size with --ddp-bucket-size), and no communication for groups of one.
// --overlap-param-gather's waiting logic runs against a scripted two-rank communicator: the
// gathers start in forward order and each forward stage finds its parameters gathered.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstring>
#include <set>
#include <vector>

#include "common/testing.h"
#include "model/gpt_model.h"
#include "parallel/grad_buckets.h"
#include "common/tiny_train_flags.h"
#include "cli/train_flags.h"

namespace moecore::parallel {
namespace {

cli::TrainFlags tiny_flags(bool untie) {
  cli::TrainFlags f = cli::tiny_train_flags();
  f.vocab_size = 64;
  f.make_vocab_size_divisible_by = 64;
  f.model.hidden = 16;
  f.model.num_heads = 2;
  f.model.seq_length = 8;
  f.model.num_layers = 3;
  f.model.ffn_hidden = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 8;
  f.model.moe.shared_ffn_hidden = 8;
  f.moe_layer_freq = "[1,0,1]";
  f.untie_embeddings = untie;
  f.train.micro_batch = 2;
  f.train.global_batch = 2;
  cli::finalize_train_flags(f);
  return f;
}

TEST(GradStages, EveryParameterOnceAndTheHookFiresInOrder) {
  for (bool untie : {false, true}) {
    cli::TrainFlags f = tiny_flags(untie);
    model::GPTModel<double> m(f.model, 2, 7);
    const auto& stages = m.grad_stages();
    ASSERT_EQ(stages.size(), 3u + 2u);
    std::set<const Param*> seen;
    for (const auto& s : stages) {
      for (const Param* p : s) EXPECT_TRUE(seen.insert(p).second) << p->name() << " twice";
    }
    EXPECT_EQ(seen.size(), m.params().params().size());
    EXPECT_EQ(stages.front().front()->name(), "decoder.final_layernorm.weight");
    EXPECT_EQ(stages.front().size(), untie ? 2u : 1u);
    EXPECT_EQ(stages.back().size(), 1u);
    EXPECT_EQ(stages.back().front()->name(), "embedding.word_embeddings.weight");
    // Stage 1 is the last block.
    for (const Param* p : stages[1]) EXPECT_EQ(p->name().rfind("decoder.layers.2.", 0), 0u);
    for (const Param* p : stages[3]) EXPECT_EQ(p->name().rfind("decoder.layers.0.", 0), 0u);

    std::vector<int> fired;
    m.set_grad_ready_hook([&](int s) { fired.push_back(s); });
    std::vector<int32_t> ids(16), targets(16);
    for (int i = 0; i < 16; ++i) {
      ids[i] = i % 64;
      targets[i] = (i * 7) % 64;
    }
    m.forward(ids.data(), targets.data());
    m.backward(1.0);
    EXPECT_EQ(fired, (std::vector<int>{0, 1, 2, 3, 4}));
  }
}

// Buckets tile each kind's flat buffer exactly, in launch order by ready stage.
void expect_tiling(const GradBuckets& b, const ParamRegistry& params) {
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const GradBucket& bk : b.buckets()) {
      if (bk.kind == k) ranges.push_back({bk.offset, bk.count});
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t at = 0;
    for (auto [off, n] : ranges) {
      EXPECT_EQ(off, at);
      at += n;
    }
    EXPECT_EQ(at, params.numel(k));
  }
  for (size_t i = 1; i < b.buckets().size(); ++i) {
    EXPECT_LE(b.buckets()[i - 1].ready_stage, b.buckets()[i].ready_stage);
  }
}

TEST(GradBuckets, OnePerStageByDefault) {
  cli::TrainFlags f = tiny_flags(true);
  model::GPTModel<float> m(f.model, 2, 7);
  GradBuckets b(m.params(), m.grad_stages(), nullptr, nullptr, GradReduceConfig{});
  expect_tiling(b, m.params());
  // Dense: head + final norm, three blocks, embedding; expert: the two MoE layers.
  int dense = 0, expert = 0;
  for (const GradBucket& bk : b.buckets()) {
    (bk.kind == ParamKind::Dense ? dense : expert)++;
    // Every parameter of a bucket belongs to its ready stage.
    for (const std::string& name : bk.params) {
      const auto& stage = m.grad_stages()[bk.ready_stage];
      EXPECT_TRUE(std::any_of(stage.begin(), stage.end(),
                              [&](const Param* p) { return p->name() == name; }))
          << name << " in a bucket of stage " << bk.ready_stage;
    }
  }
  EXPECT_EQ(dense, 5);
  EXPECT_EQ(expert, 2);
  EXPECT_EQ(b.buckets().front().ready_stage, 0);
  EXPECT_EQ(b.buckets().front().params,
            (std::vector<std::string>{"output_layer.weight", "decoder.final_layernorm.weight"}));
  EXPECT_FALSE(b.communicates());
}

TEST(GradBuckets, BySizeAcrossStages) {
  cli::TrainFlags f = tiny_flags(false);
  model::GPTModel<float> m(f.model, 2, 7);
  GradReduceConfig big;
  big.bucket_size = int64_t{1} << 40;
  GradBuckets one(m.params(), m.grad_stages(), nullptr, nullptr, big);
  expect_tiling(one, m.params());
  ASSERT_EQ(one.buckets().size(), 2u);  // one dense, one expert
  EXPECT_EQ(one.buckets()[0].ready_stage, 3);  // the expert bucket completes with layer 0
  EXPECT_EQ(one.buckets()[1].ready_stage, 4);  // the dense one with the (tied) embedding

  GradReduceConfig small;
  small.bucket_size = 300;
  GradBuckets many(m.params(), m.grad_stages(), nullptr, nullptr, small);
  expect_tiling(many, m.params());
  EXPECT_GT(many.buckets().size(), 7u);
  // Full buckets except each kind's last one.
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    std::vector<int64_t> counts;
    for (const GradBucket& bk : many.buckets()) {
      if (bk.kind == k) counts.push_back(bk.count);
    }
    for (size_t i = 0; i + 1 < counts.size(); ++i) EXPECT_GE(counts[i], 300);
  }
  GradReduceConfig bad;
  bad.bucket_size = -1;
  EXPECT_THROW(GradBuckets(m.params(), m.grad_stages(), nullptr, nullptr, bad), Error);
}

TEST(GradBuckets, GroupsOfOneDoNotCommunicate) {
  cli::TrainFlags f = tiny_flags(false);
  model::GPTModel<float> m(f.model, 2, 7);
  ParallelConfig cfg;
  // Not connected: a group of one must never touch its communicator (it would throw).
  ProcessGroups groups(make_layout(cfg, 1), 0);
  GradReduceConfig c;
  c.overlap = true;
  GradBuckets b(m.params(), m.grad_stages(), &groups.dp_cp(), &groups.expt_dp(), c);
  EXPECT_FALSE(b.communicates());
  b.arm();
  for (int s = 0; s < 5; ++s) b.stage_done(s);
  b.finish();
  EXPECT_EQ(b.launched_during_backward(), 0);
}

// Two ranks, scripted: this process is rank 0; an all-gather completes when it is waited for
// (or on its second test) and then writes rank 1's piece as the value kRemote. Nothing else
// is expected of it.
class ScriptedGatherComm final : public Communicator {
 public:
  struct Op {
    char* recv = nullptr;
    int64_t skip = 0, count = 0;  // rank 1's piece: elements [skip, skip + count) of recv
    bool done = false;
    int tests = 0;
    void complete() {
      if (done) return;
      float* r = reinterpret_cast<float*>(recv);
      for (int64_t i = 0; i < count; ++i) r[skip + i] = kRemote;
      done = true;
    }
  };
  static constexpr float kRemote = 7.0f;
  std::vector<Op> ops;  // in start order
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }

 protected:
  CommHandle start_all_gather_v(const void*, void* recv, std::span<const int64_t> counts, bool,
                                DType dt) override {
    EXPECT_EQ(dt, DType::F32);
    ops.reserve(64);  // the requests keep pointers into it
    ops.push_back(Op{static_cast<char*>(recv), counts[0], counts[1]});
    return CommHandle(CommRequestPtr(new Request(&ops.back())));
  }
  CommHandle start_all_reduce(void*, int64_t, DType, ReduceOp) override { return unexpected(); }
  CommHandle start_reduce_scatter_v(const void*, void*, std::span<const int64_t>, bool, DType,
                                    ReduceOp) override {
    return unexpected();
  }
  CommHandle start_all_to_all_v(const void*, std::span<const int64_t>, void*,
                                std::span<const int64_t>, DType) override {
    return unexpected();
  }
  CommHandle start_broadcast(void*, int64_t, DType, int) override { return unexpected(); }
  CommHandle start_send(const void*, int64_t, DType, int, int) override { return unexpected(); }
  CommHandle start_recv(void*, int64_t, DType, int, int) override { return unexpected(); }
  CommHandle start_barrier() override { return unexpected(); }

 private:
  struct Request final : CommRequest {
    explicit Request(Op* op) : op(op) {}
    bool test() override {
      if (++op->tests >= 2) op->complete();
      return op->done;
    }
    void wait() override { op->complete(); }
    Op* op;
  };
  static CommHandle unexpected() {
    ADD_FAILURE() << "only all-gathers are expected";
    return CommHandle();
  }
  std::string name_ = "scripted";
  std::vector<int> ranks_ = {0, 1};
};

ProcessGroup scripted_group(const std::string& name, ScriptedGatherComm** comm) {
  ProcessGroup g;
  g.name = name;
  g.ranks = {0, 1};
  g.rank = 0;
  auto c = std::make_unique<ScriptedGatherComm>();
  *comm = c.get();
  g.comm = std::move(c);
  return g;
}

TEST(GradBuckets, OverlapParamGatherNeedsTheDistributedOptimizerAndGradOverlap) {
  GradReduceConfig c;
  c.overlap_param_gather = true;
  c.overlap = true;
  EXPECT_THROW(c.validate(), Error);  // no --use-distributed-optimizer
  c.distributed_optimizer = true;
  c.overlap = false;
  EXPECT_THROW(c.validate(), Error);  // no --overlap-grad-reduce
  c.overlap = true;
  EXPECT_NO_THROW(c.validate());
}

// The deferred gathers start in forward order (the last bucket first), nothing waits at the
// step; before each forward stage exactly the buckets holding a parameter of it or of an
// earlier forward stage are complete, each stage's own values are whole (rank 1's pieces
// arrived) before it runs, and --bf16 copies follow each bucket's gather. The outstanding
// ones are tested at every stage (Open MPI progresses them only inside MPI calls).
TEST(GradBuckets, OverlapParamGatherWaitsForEachBucketBeforeItsForwardStage) {
  for (int64_t bucket_size : {int64_t{0}, int64_t{300}}) {
    cli::TrainFlags f = tiny_flags(true);
    f.model.bf16 = true;
    model::GPTModel<float> m(f.model, 2, 7);
    ASSERT_TRUE(m.params().has_bf16_copies());
    ScriptedGatherComm *dense_comm = nullptr, *expert_comm = nullptr;
    ProcessGroup dense = scripted_group("dp_cp", &dense_comm);
    ProcessGroup expert = scripted_group("expt_dp", &expert_comm);
    GradReduceConfig c;
    c.overlap = true;
    c.distributed_optimizer = true;
    c.overlap_param_gather = true;
    c.bucket_size = bucket_size;
    GradBuckets b(m.params(), m.grad_stages(), &dense, &expert, c);
    ASSERT_TRUE(b.defers_gathers());
    const std::vector<GradBucket>& bk = b.buckets();
    ASSERT_GT(bk.size(), 3u);
    std::vector<size_t> refreshed;
    b.set_after_gather([&](size_t i) {
      refreshed.push_back(i);
      m.params().refresh_bf16(bk[i].kind, bk[i].offset, bk[i].count);
    });
    // Every value 0, every bf16 copy 0: a gathered bucket's rank-1 piece becomes 7 in both.
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      std::memset(testing::host(m.params().flat_data(k)), 0, m.params().numel(k) * sizeof(float));
    }
    m.params().refresh_bf16();

    b.gather_params();
    EXPECT_TRUE(b.gathers_pending());
    for (size_t i = 0; i < bk.size(); ++i) EXPECT_TRUE(b.gather_pending(i)) << i;
    // Started in forward order: ready stage descending. op_of[i]: bucket i's gather.
    std::vector<const ScriptedGatherComm::Op*> op_of(bk.size(), nullptr);
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      ScriptedGatherComm* comm = k == ParamKind::Dense ? dense_comm : expert_comm;
      size_t j = 0;
      for (size_t i = bk.size(); i-- > 0;) {
        if (bk[i].kind != k) continue;
        ASSERT_LT(j, comm->ops.size());
        EXPECT_EQ(comm->ops[j].recv, static_cast<char*>(testing::host(m.params().flat_data(k))) +
                                         bk[i].offset * sizeof(float))
            << "gather " << j << " of kind " << static_cast<int>(k) << " is not bucket " << i;
        op_of[i] = &comm->ops[j++];
      }
      EXPECT_EQ(j, comm->ops.size());
    }
    EXPECT_THROW(b.gather_params(), Error);  // the last step's gathers are still pending

    const int L = static_cast<int>(m.grad_stages().size()) - 2;
    std::vector<int> stages_seen;
    m.set_params_needed_hook([&](int stage) {
      stages_seen.push_back(stage);
      b.params_needed(stage);
      for (size_t i = 0; i < bk.size(); ++i) {
        EXPECT_EQ(b.gather_pending(i), bk[i].ready_stage < stage)
            << "bucket " << i << " (ready stage " << bk[i].ready_stage << ") before forward stage "
            << stage;
        if (bk[i].ready_stage < stage) continue;
        // Waited for: rank 1's piece is in place, and its bf16 copies follow.
        const ScriptedGatherComm::Op& op = *op_of[i];
        ASSERT_TRUE(op.done) << "bucket " << i;
        const float* v = reinterpret_cast<const float*>(op.recv);
        for (int64_t e = 0; e < op.count; ++e) ASSERT_EQ(v[op.skip + e], 7.0f) << "bucket " << i;
      }
      // The stage's own parameters: whole, and their bf16 copies equal to them.
      for (const Param* p : m.grad_stages()[stage]) {
        const float* v = testing::host(p->data_as<float>());
        for (int64_t e = 0; e < p->local_numel(); ++e) {
          const float copy = p->has_data16w ? testing::host(p->data16w)[e]
                             : p->has_data16 ? bf16_to_float(testing::host(p->data16)[e])
                                             : v[e];
          ASSERT_EQ(copy, v[e]) << p->name() << "[" << e << "]";
        }
      }
    });
    std::vector<int32_t> ids(16, 1), targets(16, 2);
    m.forward(ids.data(), targets.data());
    std::vector<int> want;
    for (int s = L + 1; s >= 0; --s) want.push_back(s);
    EXPECT_EQ(stages_seen, want);
    EXPECT_FALSE(b.gathers_pending());
    EXPECT_EQ(b.waited_in_forward(), static_cast<int64_t>(bk.size()));
    // Completed in forward order, each once; every rank-1 piece arrived.
    std::vector<size_t> want_refreshed;
    for (size_t i = bk.size(); i-- > 0;) want_refreshed.push_back(i);
    EXPECT_EQ(refreshed, want_refreshed);
    for (ScriptedGatherComm* comm : {dense_comm, expert_comm}) {
      for (const auto& op : comm->ops) {
        EXPECT_TRUE(op.done);
        const float* r = reinterpret_cast<const float*>(op.recv);
        for (int64_t i = 0; i < op.count; ++i) ASSERT_EQ(r[op.skip + i], 7.0f);
      }
    }
    // The bucket the forward needs last was tested while the earlier stages ran (progress).
    EXPECT_GT(op_of[0]->tests, 0);

    // The next step: wait_params completes everything at once, in the same order.
    refreshed.clear();
    b.gather_params();
    b.wait_params();
    EXPECT_FALSE(b.gathers_pending());
    EXPECT_EQ(refreshed, want_refreshed);
    EXPECT_EQ(b.waited_in_forward(), static_cast<int64_t>(bk.size()));  // none more
    m.params().refresh_bf16();  // nothing deferred was marked: a plain refresh
  }
}

// Tensor parallelism, scripted on one process: a "tp" / "expt_tp" communicator adds the other
// TP rank's partial gradient (kTpRemote) to what it all-reduces, a "dp" / "expt_dp" one doubles
// (the other data-parallel rank's equal gradient) or, with the distributed optimizer,
// reduce-scatters (this rank's slot doubled). Both log what they reduce, so the tests see that
// exactly the ReplicatedPartialGrad parameters are TP-summed, once a step, each before its
// bucket's data-parallel reduction: with it first a partial gradient g ends as (g + 100) * 2.
// With `deferred`, a TP all-reduce completes only when the test says so (complete()) or when
// it is waited for: the sums are in flight while the backward goes on.
class ScriptedSumComm final : public Communicator {
 public:
  struct Event {
    std::string group;
    int64_t offset = 0;  // elements from the log's base
    int64_t count = 0;
    const float* data = nullptr;
  };
  struct Pending {
    float* data = nullptr;
    int64_t count = 0;
    bool done = false;
    void complete() {
      if (done) return;
      for (int64_t i = 0; i < count; ++i) data[i] += kTpRemote;
      done = true;
    }
  };
  std::vector<Pending> pending;  // deferred TP all-reduces, in start order
  bool deferred = false;
  static constexpr float kTpRemote = 100.0f;
  ScriptedSumComm(std::string name, std::vector<Event>* log, const float* const* base)
      : name_(std::move(name)), log_(log), base_(base) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }

 protected:
  CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) override {
    EXPECT_EQ(dt, DType::F32);
    EXPECT_EQ(op, ReduceOp::Sum);
    float* x = static_cast<float*>(data);
    log_->push_back(Event{name_, x - *base_, count, x});
    const bool tp = name_.find("tp") != std::string::npos;
    if (tp && deferred) {
      pending.reserve(64);  // the requests keep pointers into it
      pending.push_back(Pending{x, count});
      return CommHandle(CommRequestPtr(new Request(&pending.back())));
    }
    for (int64_t i = 0; i < count; ++i) x[i] = tp ? x[i] + kTpRemote : 2 * x[i];
    return CommHandle();
  }
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool, DType dt, ReduceOp) override {
    EXPECT_EQ(dt, DType::F32);
    EXPECT_EQ(name_.find("tp"), std::string::npos) << "TP sums are all-reduces";
    const float* x = static_cast<const float*>(send);
    float* y = static_cast<float*>(recv);
    EXPECT_EQ(y, x) << "rank 0's slot (the first), in place";
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    log_->push_back(Event{name_, x - *base_, total, x});
    for (int64_t i = 0; i < counts[0]; ++i) y[i] = 2 * y[i];
    return CommHandle();
  }
  CommHandle start_all_gather_v(const void*, void*, std::span<const int64_t>, bool,
                                DType) override {
    return unexpected();
  }
  CommHandle start_all_to_all_v(const void*, std::span<const int64_t>, void*,
                                std::span<const int64_t>, DType) override {
    return unexpected();
  }
  CommHandle start_broadcast(void*, int64_t, DType, int) override { return unexpected(); }
  CommHandle start_send(const void*, int64_t, DType, int, int) override { return unexpected(); }
  CommHandle start_recv(void*, int64_t, DType, int, int) override { return unexpected(); }
  CommHandle start_barrier() override { return unexpected(); }

 private:
  struct Request final : CommRequest {
    explicit Request(Pending* p) : p(p) {}
    bool test() override { return p->done; }
    void wait() override { p->complete(); }
    Pending* p;
  };
  static CommHandle unexpected() {
    ADD_FAILURE() << "only all-reduces and reduce-scatters are expected";
    return CommHandle();
  }
  std::string name_;
  std::vector<Event>* log_;
  const float* const* base_;  // the flat gradient buffer of the group's kind
  std::vector<int> ranks_ = {0, 1};
};

// A one-dimensional parameter of n ones with its TP role.
const Param* add_tp_param(ParamRegistry& params, const char* name, int64_t n, ParamKind kind,
                          TpRole role) {
  ParamSpec s{name, {n}, ParamInit::Ones, 0, kind, true, {}};
  s.tp_role = role;
  return &params.add(s);
}

// Dense: col [4] Sharded, norm [3] and router [2] ReplicatedPartialGrad, bias [2] Replicated;
// expert: fc1 [4] Sharded, fc2_bias [2] ReplicatedPartialGrad. Stage 0 completes router, bias
// and the expert parameters, stage 1 col and norm.
struct TpFixture {
  ParamRegistry params{DType::F32};
  Arena arena;
  std::vector<std::vector<const Param*>> stages;
  TpFixture() {
    const auto add = [&](const char* name, int64_t n, ParamKind kind, TpRole role) {
      return add_tp_param(params, name, n, kind, role);
    };
    const Param* col = add("col", 4, ParamKind::Dense, TpRole::Sharded);
    const Param* norm = add("norm", 3, ParamKind::Dense, TpRole::ReplicatedPartialGrad);
    const Param* bias = add("bias", 2, ParamKind::Dense, TpRole::Replicated);
    const Param* router = add("router", 2, ParamKind::Dense, TpRole::ReplicatedPartialGrad);
    const Param* fc1 = add("fc1", 4, ParamKind::Expert, TpRole::Sharded);
    const Param* fc2_bias = add("fc2_bias", 2, ParamKind::Expert, TpRole::ReplicatedPartialGrad);
    arena.plan([&](Arena& a) { params.allocate(a); });
    params.init(0);
    stages = {{router, bias, fc2_bias, fc1}, {norm, col}};
  }
  float* grad(ParamKind k) { return static_cast<float*>(testing::host(params.flat_grad(k))); }
  void fill_grads() {
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      for (int64_t i = 0; i < params.numel(k); ++i) grad(k)[i] = 1.0f + static_cast<float>(i);
    }
  }
  bool partial(ParamKind k, int64_t i) const {
    for (const Param& p : params.params()) {
      if (p.spec.kind == k && i >= p.offset && i < p.offset + p.local_numel()) {
        return p.spec.tp_role == TpRole::ReplicatedPartialGrad;
      }
    }
    ADD_FAILURE() << i << " in no parameter";
    return false;
  }
};

ProcessGroup sum_group(const std::string& name, std::vector<ScriptedSumComm::Event>* log,
                       const float* const* base) {
  ProcessGroup g;
  g.name = name;
  g.ranks = {0, 1};
  g.rank = 0;
  g.comm = std::make_unique<ScriptedSumComm>(name, log, base);
  return g;
}

TEST(GradBuckets, TpSumOfPartialGradientsOnceBeforeTheDataParallelReduction) {
  for (bool distopt : {false, true}) {
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "distopt " << distopt << " overlap " << overlap);
      TpFixture fx;
      const float* dense_base = fx.grad(ParamKind::Dense);
      const float* expert_base = fx.grad(ParamKind::Expert);
      std::vector<ScriptedSumComm::Event> log;
      ProcessGroup dp = sum_group("dp_cp", &log, &dense_base);
      ProcessGroup edp = sum_group("expt_dp", &log, &expert_base);
      ProcessGroup tp = sum_group("tp", &log, &dense_base);
      ProcessGroup etp = sum_group("expt_tp", &log, &expert_base);
      GradReduceConfig c;
      c.overlap = overlap;
      c.distributed_optimizer = distopt;
      GradBuckets b(fx.params, fx.stages, &dp, &edp, c, &tp, &etp);
      // Buckets: stage 0 dense [bias, router] = [7, 11), expert [0, 6); stage 1 dense [0, 7).
      ASSERT_EQ(b.buckets().size(), 3u);
      EXPECT_EQ(b.tp_sum_ranges(0).size(), 1u);  // router
      EXPECT_EQ(b.tp_sum_ranges(0)[0].offset, 9);
      EXPECT_EQ(b.tp_sum_ranges(0)[0].count, 2);
      EXPECT_EQ(b.tp_sum_ranges(1)[0].offset, 4);  // expert: fc2_bias
      EXPECT_EQ(b.tp_sum_ranges(2)[0].offset, 4);  // dense stage 1: norm
      EXPECT_EQ(b.tp_sum_ranges(2)[0].count, 3);
      for (int step = 0; step < 2; ++step) {
        fx.fill_grads();
        log.clear();
        b.arm();
        for (int s = 0; s < 2; ++s) b.stage_done(s);
        b.finish();
        EXPECT_EQ(b.launched_during_backward(), overlap ? 3 : 0);
        // With overlap each stage's buckets start their TP sums, then the reductions whose
        // sums are in (all of them here: the scripted sums complete at once); without it
        // finish() starts every TP sum, then the reductions in bucket order.
        using Want = std::vector<std::pair<std::string, int64_t>>;
        const Want want =
            overlap ? Want{{"tp", 9}, {"expt_tp", 4}, {"dp_cp", 7}, {"expt_dp", 0}, {"tp", 4},
                           {"dp_cp", 0}}
                    : Want{{"tp", 9}, {"expt_tp", 4}, {"tp", 4}, {"dp_cp", 7}, {"expt_dp", 0},
                           {"dp_cp", 0}};
        ASSERT_EQ(log.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ(log[i].group, want[i].first) << i;
          EXPECT_EQ(log[i].offset, want[i].second) << i;
        }
        for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
          for (int64_t i = 0; i < fx.params.numel(k); ++i) {
            const bool owned = [&] {
              if (!distopt) return true;
              for (size_t bi = 0; bi < b.buckets().size(); ++bi) {
                const BucketShard& sh = b.shard(bi);
                if (b.buckets()[bi].kind == k && i >= sh.begin && i < sh.begin + sh.count)
                  return true;
              }
              return false;
            }();
            const float g = 1.0f + static_cast<float>(i);
            const float want_g = fx.partial(k, i) ? (g + ScriptedSumComm::kTpRemote) * 2 : 2 * g;
            if (owned) {
              EXPECT_EQ(fx.grad(k)[i], want_g) << static_cast<int>(k) << " " << i;
            }
          }
        }
      }
    }
  }
}

// Without data-parallel groups the TP sums still run (TP 2 on two ranks: dp 1); with TP groups
// of one rank nothing is summed.
TEST(GradBuckets, TpSumWithoutDataParallelismAndNoneForOneRank) {
  TpFixture fx;
  const float* dense_base = fx.grad(ParamKind::Dense);
  const float* expert_base = fx.grad(ParamKind::Expert);
  std::vector<ScriptedSumComm::Event> log;
  ProcessGroup tp = sum_group("tp", &log, &dense_base);
  ProcessGroup etp = sum_group("expt_tp", &log, &expert_base);
  GradBuckets b(fx.params, fx.stages, nullptr, nullptr, GradReduceConfig{}, &tp, &etp);
  EXPECT_FALSE(b.communicates());
  fx.fill_grads();
  b.arm();
  b.finish();
  EXPECT_EQ(log.size(), 3u);
  EXPECT_EQ(fx.grad(ParamKind::Dense)[9], 10.0f + ScriptedSumComm::kTpRemote);
  EXPECT_EQ(fx.grad(ParamKind::Dense)[7], 8.0f);  // bias: Replicated, not summed
  EXPECT_EQ(fx.grad(ParamKind::Expert)[5], 6.0f + ScriptedSumComm::kTpRemote);
  // Counted once: sharded everywhere, replicated on TP rank 0 (this one) only.
  for (const Param& p : fx.params.params()) EXPECT_TRUE(b.counted_once(p)) << p.name();
  EXPECT_FALSE(b.skips_some());
  tp.rank = 1;
  GradBuckets r1(fx.params, fx.stages, nullptr, nullptr, GradReduceConfig{}, &tp, nullptr);
  EXPECT_TRUE(r1.skips_some());
  EXPECT_TRUE(r1.counted_once(fx.params.get("col")));
  EXPECT_FALSE(r1.counted_once(fx.params.get("norm")));
  EXPECT_FALSE(r1.counted_once(fx.params.get("bias")));
  EXPECT_TRUE(r1.counted_once(fx.params.get("fc2_bias")));  // no expert TP group here

  // One-rank TP groups (unconnected: touching them would throw): no sums, all counted.
  ParallelConfig cfg;
  ProcessGroups groups(make_layout(cfg, 1), 0);
  GradBuckets one(fx.params, fx.stages, nullptr, nullptr, GradReduceConfig{}, &groups.tp(),
                  &groups.expt_tp());
  EXPECT_EQ(one.tp_group(ParamKind::Dense), nullptr);
  for (size_t i = 0; i < one.buckets().size(); ++i) EXPECT_TRUE(one.tp_sum_ranges(i).empty());
  fx.fill_grads();
  one.arm();
  one.finish();
  EXPECT_EQ(fx.grad(ParamKind::Dense)[9], 10.0f);
  EXPECT_FALSE(one.skips_some());
}

// Several partial-gradient parameters in one bucket, not adjacent in the flat buffer: one TP
// all-reduce per bucket, of all of them packed into the staging buffer (not the flat gradient
// buffer), the sums unpacked to their places before the bucket's data-parallel reduction; the
// other elements untouched by TP. Dense: norm_a [3] partial, col [4] Sharded, router [2]
// partial, bias [2] Replicated, norm_b [3] partial, all ready at stage 0; expert: fc2_bias [2]
// partial alone (summed in place, no staging), ready at stage 1.
TEST(GradBuckets, OneCoalescedTpSumPerBucket) {
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "overlap " << overlap);
    ParamRegistry params{DType::F32};
    Arena arena;
    const auto add = [&](const char* name, int64_t n, ParamKind kind, TpRole role) {
      return add_tp_param(params, name, n, kind, role);
    };
    const Param* norm_a = add("norm_a", 3, ParamKind::Dense, TpRole::ReplicatedPartialGrad);
    const Param* col = add("col", 4, ParamKind::Dense, TpRole::Sharded);
    const Param* router = add("router", 2, ParamKind::Dense, TpRole::ReplicatedPartialGrad);
    const Param* bias = add("bias", 2, ParamKind::Dense, TpRole::Replicated);
    const Param* norm_b = add("norm_b", 3, ParamKind::Dense, TpRole::ReplicatedPartialGrad);
    const Param* fc2_bias = add("fc2_bias", 2, ParamKind::Expert, TpRole::ReplicatedPartialGrad);
    arena.plan([&](Arena& a) { params.allocate(a); });
    params.init(0);
    const std::vector<std::vector<const Param*>> stages = {{norm_a, col, router, bias, norm_b},
                                                           {fc2_bias}};
    float* dense = static_cast<float*>(testing::host(params.flat_grad(ParamKind::Dense)));
    float* expert = static_cast<float*>(testing::host(params.flat_grad(ParamKind::Expert)));
    const float* dense_base = dense;
    const float* expert_base = expert;
    std::vector<ScriptedSumComm::Event> log;
    ProcessGroup dp = sum_group("dp_cp", &log, &dense_base);
    ProcessGroup edp = sum_group("expt_dp", &log, &expert_base);
    ProcessGroup tp = sum_group("tp", &log, &dense_base);
    ProcessGroup etp = sum_group("expt_tp", &log, &expert_base);
    GradReduceConfig c;
    c.overlap = overlap;
    GradBuckets b(params, stages, &dp, &edp, c, &tp, &etp);
    ASSERT_EQ(b.buckets().size(), 2u);
    ASSERT_EQ(b.tp_sum_ranges(0).size(), 3u);  // [0, 3), [7, 9), [11, 14)
    EXPECT_EQ(b.tp_sum_count(0), 8);
    EXPECT_EQ(b.tp_sum_count(1), 2);
    EXPECT_EQ(b.tp_staging_numel(), 8);  // the expert bucket's one range is summed in place
    for (int step = 0; step < 2; ++step) {
      for (int64_t i = 0; i < 14; ++i) dense[i] = 1.0f + static_cast<float>(i);
      for (int64_t i = 0; i < 2; ++i) expert[i] = 50.0f + static_cast<float>(i);
      log.clear();
      b.arm();
      b.stage_done(0);
      b.stage_done(1);
      b.finish();
      // tp: one all-reduce of 8 elements outside the flat buffer; expt_tp: one of 2 in place.
      int tp_calls = 0;
      for (const auto& e : log) {
        if (e.group == "tp") {
          ++tp_calls;
          EXPECT_EQ(e.count, 8);
          EXPECT_TRUE(e.data < dense || e.data >= dense + 14) << "packed into the staging buffer";
        }
        if (e.group == "expt_tp") {
          EXPECT_EQ(e.data, expert);
          EXPECT_EQ(e.count, 2);
        }
      }
      EXPECT_EQ(tp_calls, 1);
      ASSERT_EQ(log.size(), 4u);
      for (int64_t i = 0; i < 14; ++i) {
        const bool partial = i < 3 || (i >= 7 && i < 9) || i >= 11;
        const float g = 1.0f + static_cast<float>(i);
        EXPECT_EQ(dense[i], partial ? (g + ScriptedSumComm::kTpRemote) * 2 : 2 * g) << i;
      }
      for (int64_t i = 0; i < 2; ++i) {
        EXPECT_EQ(expert[i], (50.0f + static_cast<float>(i) + ScriptedSumComm::kTpRemote) * 2);
      }
    }
  }
}

// --overlap-grad-reduce with TP sums that take a while: the hook only starts them (non-blocking)
// and tests them; a bucket's data-parallel reduction starts once its own sum is in, and the
// reductions start in bucket order even when a later bucket's sum arrives first. Without overlap
// nothing starts before finish(), which starts every TP sum before the first reduction.
TEST(GradBuckets, TpSumsInFlightDuringTheBackwardThenReductionsInOrder) {
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "overlap " << overlap);
    TpFixture fx;
    const float* dense_base = fx.grad(ParamKind::Dense);
    const float* expert_base = fx.grad(ParamKind::Expert);
    std::vector<ScriptedSumComm::Event> log;
    ProcessGroup dp = sum_group("dp_cp", &log, &dense_base);
    ProcessGroup edp = sum_group("expt_dp", &log, &expert_base);
    ProcessGroup tp = sum_group("tp", &log, &dense_base);
    ProcessGroup etp = sum_group("expt_tp", &log, &expert_base);
    auto& tp_comm = static_cast<ScriptedSumComm&>(tp.communicator());
    auto& etp_comm = static_cast<ScriptedSumComm&>(etp.communicator());
    tp_comm.deferred = etp_comm.deferred = true;
    GradReduceConfig c;
    c.overlap = overlap;
    GradBuckets b(fx.params, fx.stages, &dp, &edp, c, &tp, &etp);
    ASSERT_EQ(b.buckets().size(), 3u);  // dense stage 0, expert stage 0, dense stage 1
    fx.fill_grads();
    b.arm();
    b.stage_done(0);
    const auto groups_logged = [&] {
      std::vector<std::string> g;
      for (const auto& e : log) g.push_back(e.group);
      return g;
    };
    using Names = std::vector<std::string>;
    if (overlap) {
      EXPECT_EQ(groups_logged(), (Names{"tp", "expt_tp"}));  // in flight, no reduction yet
      EXPECT_FALSE(b.reduction_started(0));
      etp_comm.pending[0].complete();  // bucket 1's sum arrives before bucket 0's
      b.stage_done(1);
      EXPECT_EQ(groups_logged(), (Names{"tp", "expt_tp", "tp"}));  // bucket 1 waits for bucket 0
      EXPECT_FALSE(b.reduction_started(1));
      tp_comm.pending[0].complete();
      b.stage_done(1);  // a stage's hook again (nothing new to launch): tests and starts
      EXPECT_EQ(groups_logged(), (Names{"tp", "expt_tp", "tp", "dp_cp", "expt_dp"}));
      EXPECT_TRUE(b.reduction_started(1));
      EXPECT_FALSE(b.reduction_started(2));
    } else {
      b.stage_done(1);
      EXPECT_TRUE(log.empty());
    }
    b.finish();
    EXPECT_EQ(groups_logged(), (Names{"tp", "expt_tp", "tp", "dp_cp", "expt_dp", "dp_cp"}));
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      for (int64_t i = 0; i < fx.params.numel(k); ++i) {
        const float g = 1.0f + static_cast<float>(i);
        EXPECT_EQ(fx.grad(k)[i], fx.partial(k, i) ? (g + ScriptedSumComm::kTpRemote) * 2 : 2 * g)
            << static_cast<int>(k) << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace moecore::parallel
