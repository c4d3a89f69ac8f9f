// Runs one global batch's micro-batches through this rank's model chunks in its pipeline
// schedule (pipeline/schedule.h): the forwards and backwards in Megatron's order, the activations
// and their gradients to and from the neighbouring virtual stages (point-to-point on the pipeline
// group, non-blocking, through parallel::Communicator; the receives posted as recv_plan says: in
// each sender's order, which NCCL's posting-order matching needs, and under the interleaved
// schedule in lockstep rounds of batched exchanges, pipeline/lockstep.h), the gradients'
// readiness for the data-parallel reduction, and the shared embedding table's gradient (the tied
// head's, MTP's) summed over the ranks that hold it (Megatron's embedding group:
// parallel::word_table_ranks).
// Each chunk's boundary is the stage's own (GPTModel::input_elems / output_elems): from a
// standalone MTP stage on, 1 + --mtp-num-layers activations. Without pipeline parallelism it is the plain loop
// (each micro-batch's forward then its backward) with no communication.
//
// Memory: each chunk keeps the input of every micro-batch in flight (the schedule's peak, planned
// up front), not its activations: a backward that does not directly follow its own forward first
// recomputes that forward from the kept input (the values are bitwise the same: every random
// stream is keyed by the micro-batch, not by the order), so a stage holds one micro-batch's
// activations per chunk whatever the warm-up depth.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/gpt_model.h"
#include "parallel/communicator.h"
#include "pipeline/schedule.h"

namespace moecore::parallel {
class ProcessGroups;
}

namespace moecore::pipeline {

// The runner's buffers for one rank's schedule, as counts (the planner sizes a stage with them
// without building a runner; the runner allocates exactly these). Each slot is one buffer of the
// runner's arena (Arena::kAlign-rounded there, as bytes() rounds it).
struct PipelineBufferSizes {
  int64_t boundary_elems = 0;             // the rank's largest boundary (a send or grad_in slot)
  std::vector<int64_t> stash_slots;       // per chunk: kept inputs (0 for the embedding's chunk)
  std::vector<int64_t> input_elems;       // per chunk: one kept input
  int64_t send_slots_per_pool = 0;        // activations forward and gradients backward, each
  int64_t stash_elems = 0;                // all chunks' kept inputs
  int64_t grad_in_elems = 0;              // one received output gradient (a gradient slot)
  int64_t grad_in_slots = 0;              // gradients received before their backward, at most
  int64_t send_elems = 0;                 // both send pools
  int64_t tied_elems = 0;                 // the other stage's tied-table gradient
  // --bf16 (ChunkBoundary::input_bf16): per chunk whether its kept inputs are bf16 (2 bytes an
  // element, whatever elem_size; a forward widens one into the model's input buffer).
  std::vector<bool> input_bf16;
  // The arena bytes of these buffers at elem_size bytes per element (the runner's planned bytes).
  int64_t bytes(size_t elem_size) const;
};

// One chunk's boundaries (GPTModel::input_elems / output_elems).
struct ChunkBoundary {
  bool embedding = false;   // it reads the token ids: nothing received
  int64_t input_elems = 0;  // one activation it receives (its gradient it sends back)
  int64_t output_elems = 0;  // one activation it sends (its gradient it receives)
  // --bf16 with the bf16 residual stream (ModelConfig::bf16_residual, an f32 model): a boundary
  // of one activation is the stream, which holds bf16 values (its producer rounded them), so it
  // moves as bf16 (Megatron-Core's bf16 p2p): cast exactly, sent, kept and widened exactly.
  // Wider boundaries (an MTP stage's, with the depths' eh_proj outputs) and every gradient stay
  // f32.
  bool input_bf16 = false;
  bool output_bf16 = false;
};
// A model's chunks' boundaries.
template <typename T>
std::vector<ChunkBoundary> chunk_boundaries(const model::GPTModel<T>& model);

// The local elements of the shared word table whose gradient this rank sums with other pp
// ranks' (0: it holds none, or no other rank does); groups: the trainer's (null or pp 1: 0).
template <typename T>
int64_t exchanged_table_elems(const model::GPTModel<T>& model,
                              const parallel::ProcessGroups* groups);

// What PipelineRunner plans for schedule `c` (pp 1: nothing): per chunk without the embedding
// the stash slots of its input recv_plan counts (in_flight_per_chunk(c), and those received
// ahead in their sender's order), its gradient slots (at least one), two send pools of
// vp x max(in flight) + 1 slots (the slots of the rank's largest boundary), and with
// tied_table_elems > 0 (the shared table's local size on a stage that holds it) its receive
// buffer.
PipelineBufferSizes pipeline_buffer_sizes(const ScheduleConfig& c,
                                          const std::vector<ChunkBoundary>& chunks,
                                          int64_t tied_table_elems);

template <typename T>
class PipelineRunner {
 public:
  // What the runner asks its owner (the trainer) for, and tells it.
  struct Hooks {
    // Micro-batch mb's inputs and the report slot of its forward in chunk c.
    std::function<model::MicroBatchIO(int64_t mb, int chunk)> io;
    // After the forward with the loss of micro-batch mb (the numeric guards' loss check).
    std::function<void(int64_t mb, int chunk)> after_loss_forward;
    // Once, before the first backward that finalises a gradient (the step's last micro-batch of
    // some chunk): the data-parallel buckets may launch from then on.
    std::function<void()> arm;
    // A backward stage's gradients are final for the step (GPTModel::grad_stages numbering).
    std::function<void(int stage)> stage_done;
  };

  // model: this rank's chunks; groups: null or pp == 1 for no pipelining. group_size:
  // --microbatch-group-size-per-virtual-pipeline-stage (0: pp). Plans the boundary buffers for
  // the schedule of num_microbatches (the training and the eval schedule have the same count).
  PipelineRunner(model::GPTModel<T>& model, const parallel::ProcessGroups* groups,
                 int64_t num_microbatches, int64_t group_size, const Exec& ex);

  // The training step's forwards and backwards of every micro-batch (loss_grad_scale for each
  // backward), the tied table's gradient exchanged, every stage reported done.
  void train(double loss_grad_scale, const Hooks& hooks);
  // Every micro-batch's forward (eval): the forward-only schedule.
  void forward_only(const Hooks& hooks);

  const ScheduleConfig& schedule_config() const { return cfg_; }
  // Micro-batches whose input each chunk keeps at most (the stash), and the planned bytes.
  const std::vector<int64_t>& in_flight() const { return in_flight_; }
  size_t planned_bytes() const { return arena_.planned_bytes(); }
  // Forwards recomputed before their backward in the last train() (0 without pipelining).
  int64_t replays() const { return replays_; }
  bool pipelined() const { return cfg_.pp > 1; }

 private:
  // Where a chunk's neighbours are: the virtual stage before / after (pp rank, chunk); -1 when
  // it is the first / last.
  int prev_rank(int c) const;
  int next_rank(int c) const;
  int prev_chunk(int c) const { return cfg_.rank == 0 ? c - 1 : c; }
  int next_chunk(int c) const { return cfg_.rank == cfg_.pp - 1 ? c + 1 : c; }
  // The message tags of micro-batch mb's activation entering chunk c of the receiving rank,
  // and of the gradient leaving it.
  int tag(int64_t mb, int receiver_chunk, bool gradient) const;
  void run(const std::vector<Work>& order, const RecvPlan& recvs, double loss_grad_scale,
           const Hooks& hooks, bool forward_only);
  // The model's grad-ready hook (set once): a stage goes to hooks_->stage_done when the running
  // backward finalises it (its chunk's last micro-batch), the tied table's after the exchange.
  void stage_done(int stage);
  // A send buffer of the direction's pool, waiting for its previous send to complete.
  DevPtr<T> send_slot(bool gradient, parallel::CommHandle** handle);
  // Chunk c's kept input in stash slot s as the forward reads it (when kept in bf16, widened
  // into the model's own input buffer, GPTModel::chunk_input).
  DevPtr<const T> stash_input(int c, int s);
  void exchange_tied_gradient();

  model::GPTModel<T>& model_;
  parallel::Communicator* pp_ = nullptr;  // the pipeline group (null: no pipelining)
  ScheduleConfig cfg_;
  std::vector<int64_t> in_flight_;
  int64_t elems_ = 0;  // the largest boundary (a send or grad_in slot)
  // The pp ranks holding the shared table, in rank order (parallel::word_table_ranks).
  std::vector<int> table_ranks_;
  std::vector<parallel::CommHandle> table_sends_;  // the last holder's, of the whole sum
  Arena arena_;
  // Per chunk: the kept inputs of the micro-batches in flight ([stash slots] x [elems]), each
  // slot's receive.
  std::vector<std::vector<DevPtr<T>>> stash_;
  // Per chunk whose input moves as bf16 (ChunkBoundary::input_bf16): its stash slots in bf16
  // (stash_'s entries null).
  std::vector<std::vector<DevPtr<bf16>>> stash16_;
  std::vector<ChunkBoundary> boundaries_;
  std::vector<std::vector<parallel::CommHandle>> stash_recv_;
  // The received output gradients of the next backwards ([gradient slots] x [elems]).
  std::vector<DevPtr<T>> grad_in_;
  std::vector<parallel::CommHandle> grad_recv_;
  struct SendPool {
    std::vector<DevPtr<T>> buf;
    std::vector<parallel::CommHandle> handle;
    size_t next = 0;
  };
  SendPool send_[2];  // [0] activations forward, [1] gradients backward
  // The interleaved schedule: the last iteration's outputs, copied into send slots, waiting for
  // the next exchange (at most a forward's and a backward's).
  struct PendingSend {
    DevPtr<T> buf;
    int64_t elems;
    DType dt;  // the activations' dtype, or bf16 (ChunkBoundary::output_bf16)
    int peer, tag;
    parallel::CommHandle* handle;
  };
  std::vector<PendingSend> pending_;
  DevPtr<T> tied_recv_ = nullptr;  // a partial sum of the shared table's gradient
  int64_t replays_ = 0;
  // Planned once: the schedules, their receives, and the step's counters (a step allocates
  // nothing).
  std::vector<Work> train_order_, eval_order_;
  RecvPlan train_recvs_, eval_recvs_;
  std::vector<int64_t> backwards_;  // per chunk, in the running step
  const Hooks* hooks_ = nullptr;    // the running step's
  bool final_backward_ = false, exchange_ = false;
};

}  // namespace moecore::pipeline
