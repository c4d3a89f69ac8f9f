#include "pipeline/pipeline_runner.h"

#include <algorithm>
#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/add.h"
#include "ops/cast.h"
#include "ops/memory.h"
#include "parallel/process_groups.h"

namespace moecore::pipeline {

namespace {
// MPI guarantees tags up to 32767; the shared table's exchange takes the last two (the partial
// sums along its holders, the whole sum back).
constexpr int kMaxTag = 32767;
constexpr int kTiedTag = kMaxTag;
constexpr int kTiedSumTag = kMaxTag - 1;
}  // namespace

template <typename T>
std::vector<ChunkBoundary> chunk_boundaries(const model::GPTModel<T>& model) {
  std::vector<ChunkBoundary> out;
  const bool resid16 = std::is_same_v<T, float> && model.config().bf16_residual();
  const int64_t one = model.boundary_elems();
  for (int c = 0; c < model.num_chunks(); ++c) {
    ChunkBoundary b{model.chunk(c).embedding, model.input_elems(c), model.output_elems(c)};
    b.input_bf16 = resid16 && !b.embedding && b.input_elems == one;
    b.output_bf16 = resid16 && b.output_elems == one;
    out.push_back(b);
  }
  return out;
}
template std::vector<ChunkBoundary> chunk_boundaries(const model::GPTModel<float>&);
template std::vector<ChunkBoundary> chunk_boundaries(const model::GPTModel<double>&);

namespace {
std::vector<int> table_ranks_of(const ModelConfig& mc, const parallel::ProcessGroups& g) {
  return parallel::word_table_ranks(
      parallel::pipeline_layout(g.layout().config, mc.num_layers, mc.mtp_num_layers),
      mc.tie_embeddings);
}
}  // namespace

template <typename T>
int64_t exchanged_table_elems(const model::GPTModel<T>& model,
                              const parallel::ProcessGroups* groups) {
  const Param* table = model.shared_embedding();
  if (table == nullptr || groups == nullptr || groups->group(parallel::GroupKind::Pp).size() <= 1)
    return 0;
  return table_ranks_of(model.config(), *groups).size() > 1 ? table->local_numel() : 0;
}
template int64_t exchanged_table_elems(const model::GPTModel<float>&,
                                       const parallel::ProcessGroups*);
template int64_t exchanged_table_elems(const model::GPTModel<double>&,
                                       const parallel::ProcessGroups*);

PipelineBufferSizes pipeline_buffer_sizes(const ScheduleConfig& c,
                                          const std::vector<ChunkBoundary>& chunks,
                                          int64_t tied_table_elems) {
  MOE_CHECK(static_cast<int>(chunks.size()) == c.vp,
            "[pipeline] {} chunks gave their boundaries, for {} virtual stages", chunks.size(),
            c.vp);
  validate_schedule(c);
  PipelineBufferSizes s;
  for (const ChunkBoundary& b : chunks) {
    s.boundary_elems = std::max({s.boundary_elems, b.input_elems, b.output_elems});
    s.input_elems.push_back(b.input_elems);
  }
  s.stash_slots.assign(c.vp, 0);
  s.input_bf16.assign(c.vp, false);
  if (c.pp <= 1) return s;  // the plain loop: nothing crosses a stage
  const std::vector<int64_t> in_flight = in_flight_per_chunk(c);
  // The receive plans of the step and of eval (recv_plan): the activations each chunk holds at
  // once (the micro-batches in flight, and those received ahead in their sender's order) and
  // the gradients received before their backward.
  ScheduleConfig eval = c;
  eval.forward_only = true;
  const RecvPlan train = recv_plan(c), ev = recv_plan(eval);
  int64_t most = 1;
  for (int ch = 0; ch < c.vp; ++ch) {
    most = std::max(most, in_flight[ch]);
    // The embedding's chunk reads the token ids: nothing to keep.
    if (!chunks[ch].embedding) s.stash_slots[ch] = std::max(train.stash_slots[ch], ev.stash_slots[ch]);
    s.stash_elems += s.stash_slots[ch] * chunks[ch].input_elems;
    s.input_bf16[ch] = chunks[ch].input_bf16 && s.stash_slots[ch] > 0;
  }
  // A send slot carries any activation or gradient of the rank, a gradient slot any output's
  // gradient (one even on the last stage of 1F1B, which receives none).
  s.grad_in_elems = s.boundary_elems;
  s.grad_in_slots = std::max<int64_t>(1, train.grad_slots);
  s.send_slots_per_pool = c.vp * most + 1;
  s.send_elems = 2 * s.send_slots_per_pool * s.boundary_elems;
  s.tied_elems = tied_table_elems;
  return s;
}

int64_t PipelineBufferSizes::bytes(size_t elem_size) const {
  const auto buffer = [&](int64_t elems, size_t size = 0) {
    const size_t b = static_cast<size_t>(elems) * (size > 0 ? size : elem_size);
    return static_cast<int64_t>((b + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign);
  };
  int64_t total = 0;
  for (size_t c = 0; c < stash_slots.size(); ++c) {
    const bool b16 = c < input_bf16.size() && input_bf16[c];
    total += stash_slots[c] * buffer(input_elems[c], b16 ? sizeof(bf16) : 0);
  }
  if (grad_in_elems > 0) total += grad_in_slots * buffer(grad_in_elems);
  total += 2 * send_slots_per_pool * buffer(boundary_elems);
  if (tied_elems > 0) total += buffer(tied_elems);
  return total;
}

template <typename T>
PipelineRunner<T>::PipelineRunner(model::GPTModel<T>& model,
                                  const parallel::ProcessGroups* groups, int64_t num_microbatches,
                                  int64_t group_size, const Exec& ex)
    : model_(model), arena_(ex) {
  cfg_.vp = model.num_chunks();
  cfg_.num_microbatches = num_microbatches;
  cfg_.group_size = group_size;
  if (groups != nullptr && groups->group(parallel::GroupKind::Pp).size() > 1) {
    const parallel::ProcessGroup& g = groups->group(parallel::GroupKind::Pp);
    pp_ = &g.device_communicator();  // activations and gradients: the context's memory
    cfg_.pp = g.size();
    cfg_.rank = g.rank;
  }
  validate_schedule(cfg_);
  in_flight_ = in_flight_per_chunk(cfg_);
  const int vp = cfg_.vp;
  stash_.assign(vp, {});
  stash16_.assign(vp, {});
  stash_recv_.resize(vp);
  const Param* table = model.shared_embedding();
  boundaries_ = chunk_boundaries(model);
  const PipelineBufferSizes sizes =
      pipeline_buffer_sizes(cfg_, boundaries_, exchanged_table_elems(model, groups));
  elems_ = sizes.boundary_elems;
  if (pipelined()) {
    // The embedding group from the placement every rank computes alike (no communication).
    const ModelConfig& mc = model.config();
    table_ranks_ = table_ranks_of(mc, *groups);
    const bool listed =
        std::find(table_ranks_.begin(), table_ranks_.end(), cfg_.rank) != table_ranks_.end();
    MOE_CHECK(listed == (table != nullptr),
              "[pipeline] internal: pp rank {} {} the shared word table but the placement says "
              "it does{}",
              cfg_.rank, table != nullptr ? "holds" : "does not hold", listed ? "" : " not");
  }
  arena_.plan([&](Arena& a) {
    if (!pipelined()) return;
    for (int c = 0; c < vp; ++c) {
      stash_[c].clear();
      stash16_[c].clear();
      for (int64_t s = 0; s < sizes.stash_slots[c]; ++s) {
        if (sizes.input_bf16[c]) {
          stash_[c].push_back(nullptr);
          stash16_[c].push_back(
              a.alloc<bf16>(sizes.input_elems[c], "pipeline.stash_bf16", MemKind::Activations));
        } else {
          stash_[c].push_back(
              a.alloc<T>(sizes.input_elems[c], "pipeline.stash", MemKind::Activations));
        }
      }
    }
    grad_in_.clear();
    for (int64_t s = 0; s < sizes.grad_in_slots; ++s)
      grad_in_.push_back(a.alloc<T>(sizes.grad_in_elems, "pipeline.grad_in", MemKind::Workspace));
    // Sends complete once the neighbour posts the receive; a pool per direction as deep as
    // the micro-batches in flight lets a stage run ahead without waiting on them.
    for (SendPool& p : send_) {
      p.buf.clear();
      for (int64_t s = 0; s < sizes.send_slots_per_pool; ++s)
        p.buf.push_back(a.alloc<T>(elems_, "pipeline.send", MemKind::Workspace));
    }
    if (sizes.tied_elems > 0) {
      tied_recv_ = a.alloc<T>(sizes.tied_elems, "pipeline.tied_grad", MemKind::Workspace);
    }
  });
  for (int c = 0; c < vp; ++c) stash_recv_[c].resize(stash_[c].size());
  grad_recv_.resize(grad_in_.size());
  for (SendPool& p : send_) p.handle.resize(p.buf.size());
  if (!table_ranks_.empty()) table_sends_.resize(table_ranks_.size() - 1);
  ScheduleConfig c = cfg_;
  train_order_ = schedule(c);
  train_recvs_ = recv_plan(c);
  c.forward_only = true;
  eval_order_ = schedule(c);
  eval_recvs_ = recv_plan(c);
  if (pipelined()) {
    // The plan's messages follow from the first and last virtual stages (recv_plan).
    for (int ch = 0; ch < vp; ++ch) {
      const parallel::VirtualStage& st = model.chunk(ch);
      MOE_CHECK(st.embedding == (cfg_.rank == 0 && ch == 0) &&
                    st.loss == (cfg_.rank == cfg_.pp - 1 && ch == vp - 1),
                "[pipeline] internal: chunk {} of pp rank {} {} the embedding and {} the loss, "
                "which only the first and the last virtual stage hold",
                ch, cfg_.rank, st.embedding ? "holds" : "does not hold",
                st.loss ? "holds" : "does not hold");
    }
  }
  backwards_.assign(vp, 0);
  pending_.reserve(2);
  model_.set_grad_ready_hook([this](int stage) { this->stage_done(stage); });
}

template <typename T>
void PipelineRunner<T>::stage_done(int stage) {
  const int L = static_cast<int>(model_.config().num_layers);
  if (hooks_ == nullptr || !final_backward_ || (exchange_ && stage == L + 1)) return;
  if (hooks_->stage_done) hooks_->stage_done(stage);
}

template <typename T>
int PipelineRunner<T>::prev_rank(int c) const {
  if (cfg_.rank == 0 && c == 0) return -1;
  return (cfg_.rank + cfg_.pp - 1) % cfg_.pp;
}

template <typename T>
int PipelineRunner<T>::next_rank(int c) const {
  if (cfg_.rank == cfg_.pp - 1 && c == cfg_.vp - 1) return -1;
  return (cfg_.rank + 1) % cfg_.pp;
}

template <typename T>
int PipelineRunner<T>::tag(int64_t mb, int receiver_chunk, bool gradient) const {
  return static_cast<int>(((mb * cfg_.vp + receiver_chunk) * 2 + (gradient ? 1 : 0)) % kTiedSumTag);
}

template <typename T>
DevPtr<T> PipelineRunner<T>::send_slot(bool gradient, parallel::CommHandle** handle) {
  SendPool& p = send_[gradient ? 1 : 0];
  const size_t i = p.next;
  p.next = (p.next + 1) % p.buf.size();
  p.handle[i].wait_on(arena_.exec());  // its previous send has left (the buffer is written next)
  *handle = &p.handle[i];
  return p.buf[i];
}

template <typename T>
DevPtr<const T> PipelineRunner<T>::stash_input(int c, int s) {
  if (!boundaries_[c].input_bf16) return stash_[c][s];
  const DevPtr<T> x = model_.chunk_input(c);
  if constexpr (std::is_same_v<T, float>) {
    ops::cast_bf16_to_f32(arena_.exec(), x, DevPtr<const bf16>(stash16_[c][s]),
                          model_.input_elems(c));
  }
  return x;
}

template <typename T>
void PipelineRunner<T>::train(double loss_grad_scale, const Hooks& hooks) {
  run(train_order_, train_recvs_, loss_grad_scale, hooks, false);
}

template <typename T>
void PipelineRunner<T>::forward_only(const Hooks& hooks) {
  run(eval_order_, eval_recvs_, 0.0, hooks, true);
}

template <typename T>
void PipelineRunner<T>::run(const std::vector<Work>& order, const RecvPlan& recvs,
                            double loss_grad_scale, const Hooks& hooks, bool forward_only) {
  const Exec& ex = arena_.exec();
  const DType dt = DTypeOf<T>::value;
  const int64_t M = cfg_.num_microbatches;
  const int L = static_cast<int>(model_.config().num_layers);
  // The shared table's gradient (the tied head's, MTP's) is final only once the other stage's
  // part is added: its stage reports after the exchange.
  exchange_ = !forward_only && tied_recv_ != nullptr;
  std::fill(backwards_.begin(), backwards_.end(), 0);
  bool armed = false;
  hooks_ = &hooks;
  replays_ = 0;

  // Before each step, its receives in their senders' order (recv_plan): NCCL pairs a
  // neighbour's messages with the receives in the order both post them (the tags name them for
  // MPI).
  const auto post_receives = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) {
      const RecvPost& r = recvs.posts[k];
      const int64_t mb = r.msg.microbatch;
      const int ch = r.msg.chunk;
      if (r.msg.gradient) {
        grad_recv_[r.slot] = pp_->recv_async(grad_in_[r.slot], model_.output_elems(ch), dt,
                                             r.peer, tag(mb, ch, true));
      } else {
        // --bf16: the stream's bf16 values, kept as bf16 (widened for each forward).
        const bool b16 = boundaries_[ch].input_bf16;
        stash_recv_[ch][r.slot] =
            b16 ? pp_->recv_async(stash16_[ch][r.slot], model_.input_elems(ch), DType::BF16,
                                  r.peer, tag(mb, ch, false))
                : pp_->recv_async(stash_[ch][r.slot], model_.input_elems(ch), dt, r.peer,
                                  tag(mb, ch, false));
      }
    }
  };
  // The interleaved schedule's exchanges (recv_plan, pipeline/lockstep.h): the outputs of the
  // last iteration, copied into send slots as each step ends, go out with the round's receives
  // as one group, and the whole group is waited before the next step, as Megatron's batched
  // exchange: each group's partners are in the neighbours' groups of the same round, so the
  // groups of all ranks finish round by round (no two can wait on each other).
  const bool lockstep = pipelined() && cfg_.vp > 1;
  size_t next_exchange = 0;
  std::vector<PendingSend>& pending = pending_;
  pending.clear();
  const auto exchange_before = [&](size_t step) {
    ScopedPhase phase(Phase::Communication);
    for (; next_exchange < recvs.exchanges.size() && recvs.exchanges[next_exchange].before == step;
         ++next_exchange) {
      const Exchange& e = recvs.exchanges[next_exchange];
      MOE_CHECK(e.sends.size() == pending.size(),
                "[pipeline] internal: pp rank {}'s exchange before step {} sends {} outputs, {} "
                "are waiting",
                cfg_.rank, step, e.sends.size(), pending.size());
      for (PendingSend& ps : pending)
        *ps.handle = pp_->send_async(ps.buf, ps.elems, ps.dt, ps.peer, ps.tag);
      post_receives(e.first_post, e.end_post);
      // The first wait issues the group (NcclP2pBatch); the others complete with it.
      for (PendingSend& ps : pending) ps.handle->wait_on(ex);
      for (size_t k = e.first_post; k < e.end_post; ++k) {
        const RecvPost& r = recvs.posts[k];
        (r.msg.gradient ? grad_recv_[r.slot] : stash_recv_[r.msg.chunk][r.slot]).wait_on(ex);
      }
      pending.clear();
    }
  };
  // A step's output to a neighbour: sent now (1F1B: with the next receive's group), or with the
  // next exchange (the interleaved schedule).
  // bf16: an activation of bf16 values (ChunkBoundary::output_bf16), cast exactly into the
  // slot's first half and sent as bf16.
  const auto send = [&](bool gradient, DevPtr<const T> data, int64_t n, int peer, int msg_tag,
                        bool bf16_values) {
    parallel::CommHandle* h = nullptr;
    DevPtr<T> buf;
    {
      ScopedPhase phase(Phase::Communication);
      buf = send_slot(gradient, &h);
    }
    DType wire = dt;
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_values) {
        ops::cast_f32_to_bf16(ex, dev_ptr_cast<bf16>(buf), data, n);
        wire = DType::BF16;
      }
    }
    if (wire == dt) ops::copy(ex, buf, data, n);
    if (lockstep) {
      pending.push_back(PendingSend{buf, n, wire, peer, msg_tag, h});
    } else {
      *h = pp_->send_async(buf, n, wire, peer, msg_tag);
    }
  };

  bool have_last = false;
  Work last{Pass::Forward, -1, -1};
  for (size_t i = 0; i < order.size(); ++i) {
    const Work& w = order[i];
    const int ch = w.chunk;
    const int64_t mb = w.microbatch;
    const parallel::VirtualStage& st = model_.chunk(ch);
    int slot = -1;  // the kept input's stash slot (chunks without the embedding)
    if (lockstep) {
      exchange_before(i);
    } else if (pipelined()) {
      post_receives(recvs.first[i], recvs.first[i + 1]);
    }
    if (pipelined() && !st.embedding) {
      const int s = recvs.input_slot[i];
      if (w.pass == Pass::Forward && !lockstep) {
        ScopedPhase phase(Phase::Communication);
        stash_recv_[ch][s].wait_on(ex);
      }
      slot = s;
    }
    // The forward's input (widened from bf16 when kept so), read only by the forward.
    const auto input = [&]() {
      return slot >= 0 ? stash_input(ch, slot) : DevPtr<const T>(nullptr);
    };
    if (w.pass == Pass::Forward) {
      model_.forward_chunk(ch, hooks.io(mb, ch), input(), mb);
      if (st.loss) {
        if (hooks.after_loss_forward) hooks.after_loss_forward(mb, ch);
      } else if (pipelined()) {
        send(false, model_.chunk_output(ch), model_.output_elems(ch), next_rank(ch),
             tag(mb, next_chunk(ch), false), boundaries_[ch].output_bf16);
      }
    } else {
      // The activations are the last forward's: any other forward since, and the chunk reruns
      // this micro-batch's from its kept input.
      if (!have_last || last.pass != Pass::Forward || last.microbatch != mb || last.chunk != ch) {
        model_.forward_chunk(ch, hooks.io(mb, ch), input(), mb, /*replay=*/true);
        ++replays_;
      }
      DevPtr<const T> dout = nullptr;
      if (!st.loss) {
        const int g = recvs.grad_slot[i];
        if (!lockstep) {
          ScopedPhase phase(Phase::Communication);
          grad_recv_[g].wait_on(ex);
        }
        dout = grad_in_[g];
      }
      final_backward_ = backwards_[ch] == M - 1;
      if (final_backward_ && !armed) {
        if (hooks.arm) hooks.arm();
        armed = true;
      }
      model_.backward_chunk(ch, loss_grad_scale, dout, mb);
      final_backward_ = false;
      ++backwards_[ch];
      if (pipelined() && !st.embedding) {
        send(true, model_.input_grad(), model_.input_elems(ch), prev_rank(ch),
             tag(mb, prev_chunk(ch), true), /*bf16_values=*/false);
      }
    }
    have_last = true;
    last = w;
  }
  if (lockstep) exchange_before(order.size());
  if (pipelined()) {
    ScopedPhase phase(Phase::Communication);
    for (SendPool& p : send_) {
      for (parallel::CommHandle& h : p.handle) h.wait_on(ex);
    }
  }
  if (exchange_) {
    exchange_tied_gradient();
    if (hooks.stage_done) hooks.stage_done(L + 1);
  }
  hooks_ = nullptr;
}

// Megatron's embedding group: every holder of the word table (the first stage's embedding, a
// standalone MTP stage's copy, the tied head's copy: table_ranks_, in pp rank order) gets the sum
// of all their gradients before the data-parallel reduction, so every copy takes the same update.
// The sum runs along the holders in rank order (each adds its own gradient to the partial sum it
// receives: ((g_0 + g_1) + g_2) ...) and the last holder sends it back to the others: bitwise the
// same everywhere (with two holders g_0 + g_1, as a + b = b + a).
template <typename T>
void PipelineRunner<T>::exchange_tied_gradient() {
  ScopedPhase phase(Phase::Communication);
  const Exec& ex = arena_.exec();
  Param* table = model_.shared_embedding();
  const int64_t n = table->local_numel();
  const DType dt = DTypeOf<T>::value;
  const DevPtr<T> grad = table->template grad_as<T>();
  const size_t k = table_ranks_.size();
  const size_t me = static_cast<size_t>(
      std::find(table_ranks_.begin(), table_ranks_.end(), cfg_.rank) - table_ranks_.begin());
  if (me > 0) {
    pp_->recv_async(tied_recv_, n, dt, table_ranks_[me - 1], kTiedTag).wait_on(ex);
    ops::add(ex, grad, DevPtr<const T>(tied_recv_), DevPtr<const T>(grad), n);
  }
  if (me + 1 < k) {
    pp_->send_async(grad, n, dt, table_ranks_[me + 1], kTiedTag).wait_on(ex);
    // The whole sum, from the last holder.
    pp_->recv_async(grad, n, dt, table_ranks_[k - 1], kTiedSumTag).wait_on(ex);
    return;
  }
  for (size_t i = 0; i + 1 < k; ++i)
    table_sends_[i] = pp_->send_async(grad, n, dt, table_ranks_[i], kTiedSumTag);
  for (parallel::CommHandle& h : table_sends_) h.wait_on(ex);
}

template class PipelineRunner<float>;
template class PipelineRunner<double>;

}  // namespace moecore::pipeline
