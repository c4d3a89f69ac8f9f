// The token dispatcher interface: plan (from the routing decisions), dispatch (tokens to the
// rows of the local experts, expert-major), combine (expert outputs back to token order,
// summing the K copies). The plan is the handle that combine and both backwards reuse:
// dispatch's gradient runs combine's data path and vice versa. The local dispatcher (one
// rank, no communication) is the reference the EP dispatchers are tested against; the EP ones
// (alltoall_dispatcher.h, allgather_dispatcher.h) come from make_dispatcher.
// Legend: T tokens, H hidden, K top-k, N rows for the local experts, L local experts, R EP ranks.
#pragma once

#include <cstdint>
#include <memory>

#include "core/arena.h"
#include "core/dtype.h"
#include "moe/config.h"

namespace moecore::parallel {
class ProcessGroups;
}

namespace moecore::moe {

// Under expert parallelism (R > 1) the rows of a local expert are ordered by (source EP rank,
// token index on that rank); with padding each source contributes exactly `capacity` rows
// per expert (its real rows, then pad rows), so rows_per_expert = R * capacity.
struct DispatchPlan {
  int64_t n_tok = 0;
  int64_t topk = 0;
  // N: the rows dispatched, a size the host knows without reading the routing: T * K (the
  // local dispatcher without padding: the dropped slots' rows are zero rows past the kept
  // ones), E * capacity (padded), or the received total (EP, after its count exchange). The
  // experts' GEMMs take their group sizes from tokens_per_expert_L in memory.
  int64_t n_rows = 0;
  int64_t rows_per_expert = 0;  // > 0: padded, every local expert has exactly this
  // In memory: the rows padding added (zero input, prob 0). EP + padding: the pad rows this
  // rank sent (the splits are static, so the receivers' real counts are never exchanged).
  DevPtr<const int64_t> pad_rows = nullptr;
  DevPtr<int64_t> tokens_per_expert_L = nullptr;  // rows of each local expert (pad rows included)
  // Local dispatcher only (null under EP, where rows come from other ranks):
  DevPtr<int32_t> row_token_N = nullptr;  // source token of each row, -1 for a pad row
  DevPtr<int32_t> row_slot_N = nullptr;   // top-k slot of each row, -1 for a pad row
  // Row of each (token, slot), -1 if dropped: the expert row (local), the row in this rank's
  // send order (alltoall), null (allgather).
  DevPtr<int32_t> token_rows_TK = nullptr;
  // EP: rows this rank sends to / receives from each EP rank ([R] in host memory: the host's
  // split arithmetic after the count exchange; null for the local one).
  int64_t ep_size = 1;
  const int64_t* send_rows_R = nullptr;
  const int64_t* recv_rows_R = nullptr;
};

template <typename T>
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;

  virtual int64_t num_local_experts() const = 0;
  // Global index of the first local expert: ep_rank * L (0 on one rank).
  virtual int64_t first_local_expert() const { return 0; }
  // Worst-case rows the local experts can receive when every rank has `max_tokens` tokens
  // (memory planning); plan() fails loudly rather than exceed it.
  virtual int64_t max_rows(int64_t max_tokens) const = 0;
  virtual void allocate(Arena& arena, int64_t max_tokens) = 0;

  // idx < 0 marks a (token, slot) dropped by capacity. pad_to_rows > 0
  // (--moe-pad-expert-input-to-capacity): every local expert gets exactly that many rows, the
  // missing ones pad rows with zero input and prob 0 (static shapes); the router guarantees no
  // expert has more. Under EP every rank of the EP group calls plan (and each later phase) in
  // the same order: they are collectives.
  virtual const DispatchPlan& plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                                   int64_t pad_to_rows = 0) = 0;
  // x [T, H], probs [T, K] -> x_NH expert-major, p_N the prob of each row.
  virtual void dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                        DevPtr<const T> probs_TK) = 0;
  // y_NH -> y_TH (assigned): the sum of each token's K expert outputs.
  virtual void combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) = 0;
  // Gradients: dy_TH -> dy_NH (dispatch's data path) and dx_NH, dp_N -> dx_TH, dprobs_TK
  // (combine's data path); all assigned.
  virtual void combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) = 0;
  virtual void dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                                 DevPtr<const T> dp_N) = 0;

  // Each of the four phases in two halves, so that the MoE layer can compute what depends on
  // none of them (the shared expert, --moe-shared-expert-overlap) while the phase's collective
  // is in flight: *_start does the work before the collective and starts it non-blocking,
  // *_finish waits for it (stream-ordered where the backend can: wait_on) and does the rest.
  // start then finish runs exactly the one-call form's ops in its order, so the results are
  // bitwise the same; between the two the caller must not touch the phase's arguments. A
  // dispatcher whose phase has no non-blocking collective does it all in start.
  virtual void dispatch_start(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                              DevPtr<const T> probs_TK) {
    dispatch(x_NH, p_N, x_TH, probs_TK);
  }
  virtual void dispatch_finish() {}
  virtual void combine_start(DevPtr<T> y_TH, DevPtr<const T> y_NH) { combine(y_TH, y_NH); }
  virtual void combine_finish() {}
  virtual void combine_backward_start(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) {
    combine_backward(dy_NH, dy_TH);
  }
  virtual void combine_backward_finish() {}
  virtual void dispatch_backward_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                                       DevPtr<const T> dp_N) {
    dispatch_backward(dx_TH, dprobs_TK, dx_NH, dp_N);
  }
  virtual void dispatch_backward_finish() {}
  // --bf16 (T = float): the rows that feed nothing but the experts' bf16 GEMMs move as bf16: the
  // tokens (dispatch) and, without MLP biases, the output gradient (combine's backward). The
  // caller casts them once in token order; a cast commutes with moving rows, so the expert rows
  // are bitwise the cast of the T forms' rows, and the permutation, the all-to-all and the ETP
  // gather move half the bytes. The probs stay T. Each has the T form's start / finish split
  // and shares its finish (dispatch_finish, combine_backward_finish).
  virtual void dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                                DevPtr<const T> probs_TK) = 0;
  virtual void combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) = 0;
  void dispatch16(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                  DevPtr<const T> probs_TK) {
    dispatch16_start(x_NH, p_N, x_TH, probs_TK);
    dispatch_finish();
  }
  void combine_backward16(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) {
    combine_backward16_start(dy_NH, dy_TH);
    combine_backward_finish();
  }
  // The way back as bf16 (T = float): the experts' T output rows (combine) and input-gradient
  // rows (the dispatch's backward) are rounded once to bf16 into the caller's [N, H] workspace
  // (y16_NH, dx16_NH), which the all-to-all back then sends as bf16; each token sums its rows
  // widened, in f32, in k order into the T output (ops::unpermute_rows on bf16 rows). Where the
  // rows are partial sums over expert TP, the ETP reduce-scatter sums them in T first and the sum
  // is rounded once (as one rank rounds the whole row: the same value up to summation order);
  // the allgather dispatcher under expert TP, whose one reduce-scatter sums the partials and the
  // K rows together, keeps the T way back. The probs' gradient stays T. Each shares its T form's
  // finish (combine_finish, dispatch_backward_finish).
  virtual void combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH, DevPtr<bf16> y16_NH) = 0;
  virtual void dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                         DevPtr<const T> dx_NH, DevPtr<bf16> dx16_NH,
                                         DevPtr<const T> dp_N) = 0;
  void combine16(DevPtr<T> y_TH, DevPtr<const T> y_NH, DevPtr<bf16> y16_NH) {
    combine16_start(y_TH, y_NH, y16_NH);
    combine_finish();
  }
  void dispatch_backward16(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                           DevPtr<bf16> dx16_NH, DevPtr<const T> dp_N) {
    dispatch_backward16_start(dx_TH, dprobs_TK, dx_NH, dx16_NH, dp_N);
    dispatch_backward_finish();
  }
  // True between a *_start that left a collective in flight and its *_finish: the MoE layer
  // counts the shared-expert work that ran in that window (MoELayer::shared_expert_overlaps).
  virtual bool in_flight() const { return false; }
};

// One rank holds every expert: permutation only.
template <typename T>
class LocalDispatcher final : public TokenDispatcher<T> {
 public:
  // pad_capacity_factor > 0: plans may be padded to expert_capacity(T, K, E, factor) rows
  // per expert, which sizes the worst case.
  LocalDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                  double pad_capacity_factor = 0.0);

  int64_t num_local_experts() const override { return E_; }
  int64_t max_rows(int64_t max_tokens) const override;
  void allocate(Arena& arena, int64_t max_tokens) override;

  const DispatchPlan& plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                           int64_t pad_to_rows = 0) override;
  void dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                DevPtr<const T> probs_TK) override;
  void combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) override;
  void combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) override;
  void dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                         DevPtr<const T> dp_N) override;
  void dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                        DevPtr<const T> probs_TK) override;
  void combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) override;
  void combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH, DevPtr<bf16> y16_NH) override;
  void dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                                 DevPtr<bf16> dx16_NH, DevPtr<const T> dp_N) override;
  // The bf16 forms' second halves on rows already rounded (the alltoall dispatcher's finish).
  void unpermute16(DevPtr<T> y_TH, DevPtr<const bf16> y16_NH);
  void dispatch_backward_rows16(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const bf16> dx16_NH,
                                DevPtr<const T> dp_N);

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  int64_t E_, K_, H_;
  double pad_capacity_factor_;
  int64_t max_tokens_ = 0;
  DispatchPlan plan_;
  DevPtr<int64_t> n_kept_ = nullptr;  // kept (token, slot) rows of the last plan (memory)
  DevPtr<int64_t> pads_ = nullptr;    // pad rows of the last plan (memory)
};

// What bounds the rows the local experts of one EP rank receive, so what its buffers are planned
// for (the experts' activations are sized by it):
//   pad_capacity_factor > 0 (--moe-pad-expert-input-to-capacity): every source fills each local
//     expert to exactly its capacity, R * L * capacity rows (static);
//   rank_capacity_factor > 0 (--moe-expert-rank-capacity-factor, dropless): at most
//     ceil(factor * T * K) rows, T * K being the balanced load of a rank (the EP group's R T K
//     rows spread evenly), where a step that routes more to one rank is a hard error naming the
//     rows (Megatron reruns such a step with buffers sized on the spot; moecore plans memory
//     before step 0, so the factor is the declared worst case);
//   neither: the dropless worst case, every token of every EP rank to this rank, R * T * K.
struct EpRowBudget {
  double pad_capacity_factor = 0.0;
  double rank_capacity_factor = 0.0;
};

// Experts per EP rank (checks that EP divides the expert count), and the most rows the local
// experts of one EP rank receive under `budget` when every rank has `max_tokens` tokens.
// Shared by the EP dispatchers. With expert tensor parallelism (etp > 1) the rows come from the
// ETP x EP group: every bound above is etp times larger (each ETP rank of an EP rank computes
// its F/ETP share of all of them).
int64_t experts_per_ep_rank(int64_t num_experts, int64_t ep_size);
int64_t ep_max_rows(int64_t ep_size, int64_t max_tokens, int64_t topk, int64_t num_experts,
                    const EpRowBudget& budget, int64_t etp = 1);
// The error of an EP rank receiving `rows` > `max_rows` (the plan's check in both EP
// dispatchers): the rows, the bound and where it comes from, and the fix.
[[noreturn]] void fail_received_rows(int64_t ep_rank, int64_t rows, int64_t max_rows,
                                     int64_t ep_size, int64_t max_tokens, int64_t topk,
                                     const EpRowBudget& budget);

// The bf16 way back's one rounding: n elements of the experts' T rows to nearest even bf16 (the
// cast of ops/cast.h); T = double, which has no bf16 rows, fails.
template <typename T>
void round_rows_to_bf16(const Exec& ex, DevPtr<bf16> y16, DevPtr<const T> y, int64_t n);

// The dispatcher for a layout: LocalDispatcher without groups or with EP = ETP = 1 (bitwise the
// single-process path), else cfg.moe.dispatcher_type: allgather over the ETP x EP group
// (tp_ep), alltoall over EP with the all-gather / reduce-scatter over expert TP when ETP > 1.
// Throws when EP does not divide the expert count.
template <typename T>
std::unique_ptr<TokenDispatcher<T>> make_dispatcher(const MoeLayerConfig& cfg,
                                                    const parallel::ProcessGroups* groups);

}  // namespace moecore::moe
