// The AlltoAll dispatcher (--moe-token-dispatcher-type alltoall): tokens travel only to the EP
// ranks holding their experts. plan: permute locally over all E experts (expert-major, so the
// rows for EP rank j are contiguous), all-gather the counts per expert over EP (skipped when
// padded: capacity rows per expert per source, static), derive the splits; dispatch:
// all-to-all-v of rows and probs, then sort chunks from [source rank][local expert] to
// [local expert][source rank]; combine and both backwards are the same steps reversed.
// Expert tensor parallelism (ETP > 1): the counts are all-gathered over EP, then over ETP; after
// the all-to-all (within this rank's ETP slice) the rows are all-gathered over ETP, so every
// ETP rank of an EP rank holds the rows of all of them, sorted from [etp][ep][local expert] to
// [local expert][etp][ep]; the experts' partial outputs (F/ETP each) are reduce-scattered over
// ETP before the all-to-all back. Each phase also runs as start (up to and including starting
// its all-to-all) and finish (from its wait on), so that the MoE layer can compute the shared
// expert while the all-to-all is in flight (--moe-shared-expert-overlap). The all-to-all's
// receive buffers hold this rank's ETP slice only (at most R T K rows dropless, R L capacity
// padded: N / P), the gathered ones all N.
// Legend: T tokens, H hidden, K top-k, E experts, L = E/R local experts, R EP ranks, P ETP
// ranks, S rows this rank sends, N rows for the local experts (all P slices).
#pragma once

#include <memory>
#include <vector>

#include "moe/dispatcher.h"
#include "parallel/communicator.h"

namespace moecore::moe {

template <typename T>
class AlltoAllDispatcher final : public TokenDispatcher<T> {
 public:
  // ep: the EP group (ETP = 1). budget.pad_capacity_factor > 0: plans may be padded to
  // expert_capacity(T, K, E, factor) rows per expert; every EP rank must then pass the same
  // pad_to_rows to plan() (same micro-batch shape), as the splits are not exchanged.
  // etp: the expert tensor-parallel group (null: ETP = 1). ep and etp move the context's memory
  // (rows, probs); ep_host and etp_host, the same groups' communicators of host memory, carry
  // the counts per expert the host sizes the all-to-all from (null: ep / etp carry both, as on
  // the CPU backend).
  AlltoAllDispatcher(int64_t num_experts, int64_t topk, int64_t hidden, const EpRowBudget& budget,
                     parallel::Communicator& ep, parallel::Communicator* etp = nullptr,
                     parallel::Communicator* ep_host = nullptr,
                     parallel::Communicator* etp_host = nullptr);

  int64_t num_local_experts() const override { return L_; }
  int64_t first_local_expert() const override { return me_ * L_; }
  // ep_max_rows under the budget: dropless R * T * K (every token of every EP rank picks only my
  // experts) or the rank capacity factor's bound; padded exactly R * L * capacity.
  int64_t max_rows(int64_t max_tokens) const override;
  // The rows this rank's all-to-all receives at most: its ETP slice's, every token of each of
  // its R sources to this rank's experts (R T K dropless, R L capacity padded), never more than
  // max_rows: N / P under the worst case and padding, what the receive buffers are planned for
  // (the gathered buffers hold all N).
  int64_t recv_max_rows(int64_t max_tokens) const;
  void allocate(Arena& arena, int64_t max_tokens) override;

  const DispatchPlan& plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                           int64_t pad_to_rows = 0) override;
  void dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                DevPtr<const T> probs_TK) override;
  void combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) override;
  void combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) override;
  void dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                         DevPtr<const T> dp_N) override;
  // The halves (dispatcher.h): each start ends by starting the phase's all-to-all(s) over EP;
  // each finish waits for them, then runs the ETP collective (ETP > 1) and the local
  // permutation that follow. The one-call forms are start then finish.
  void dispatch_start(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                      DevPtr<const T> probs_TK) override;
  void dispatch_finish() override;
  void combine_start(DevPtr<T> y_TH, DevPtr<const T> y_NH) override;
  void combine_finish() override;
  void combine_backward_start(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) override;
  void combine_backward_finish() override;
  void dispatch_backward_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                               DevPtr<const T> dp_N) override;
  void dispatch_backward_finish() override;
  // bf16 rows: sent, received and ETP-gathered as bf16 in the first half of the row workspaces,
  // then sorted as the T rows are.
  void dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                        DevPtr<const T> probs_TK) override;
  void combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) override;
  // The way back as bf16: the expert rows unsorted and (ETP > 1) their partial sums
  // reduce-scattered in T, as the T forms do; this rank's all-to-all rows are then rounded once
  // into the caller's bf16 workspace, which the all-to-all sends back into the first half of the
  // send workspace; the finish sums each token's rows widened into the T output.
  void combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH, DevPtr<bf16> y16_NH) override;
  void dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                                 DevPtr<bf16> dx16_NH, DevPtr<const T> dp_N) override;
  bool in_flight() const override { return !rows_in_flight_.done() || !probs_in_flight_.done(); }

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // Counts per EP rank in elements: rows (x H) for tokens, rows for probs. Forward (dispatch)
  // sends with send_*, receives with recv_*; backward (combine) swaps them.
  template <typename R>
  parallel::CommHandle start_a2a(DevPtr<const R> send, const std::vector<int64_t>& send_counts,
                                 DevPtr<R> recv, const std::vector<int64_t>& recv_counts);
  // [p][r][l] -> [l][p][r] and back (rows of T or bf16).
  template <typename R>
  void sort_chunks(DevPtr<R> out_NW, DevPtr<const R> recv_W, int64_t W) const;
  void unsort_chunks(DevPtr<T> recv_W, DevPtr<const T> in_NW, int64_t W) const;
  // ETP > 1: the all-to-all outputs of the ETP group gathered ([p][r][l]) and the partial sums
  // reduce-scattered back into this rank's all-to-all rows (counts: etp_elems_P_ for rows,
  // etp_rows_P_ for probs). No-ops at ETP = 1.
  template <typename R>
  void etp_gather(DevPtr<R> all_W, DevPtr<const R> mine_W, const std::vector<int64_t>& counts_P);
  void etp_reduce_scatter(DevPtr<T> mine_W, DevPtr<const T> all_W,
                          const std::vector<int64_t>& counts_P);
  // The rows the experts see in [p][r][l] order: the ETP gather's buffer, or the all-to-all's.
  DevPtr<T> rows_NH() const { return P_ > 1 ? gath_NH_ : recv_NH_; }
  // The bf16 rows' views of the row workspaces (their first halves).
  DevPtr<bf16> send16_SH() const { return dev_ptr_cast<bf16>(send_SH_); }
  DevPtr<bf16> recv16_NH() const { return dev_ptr_cast<bf16>(recv_NH_); }
  DevPtr<bf16> rows16_NH() const { return dev_ptr_cast<bf16>(rows_NH()); }
  DevPtr<T> rows_p_N() const { return P_ > 1 ? gath_p_N_ : recv_p_N_; }

  int64_t E_, K_, H_, L_, R_, me_;
  int64_t P_ = 1, pe_ = 0;  // ETP size and rank
  EpRowBudget budget_;
  parallel::Communicator& ep_;
  parallel::Communicator* etp_ = nullptr;
  parallel::Communicator& ep_host_;            // the count exchange (host memory)
  parallel::Communicator* etp_host_ = nullptr;
  LocalDispatcher<T> local_;  // this rank's permutation over all E experts (the send side)
  int64_t max_tokens_ = 0;
  int64_t recv_max_rows_ = 0;  // recv_max_rows(max_tokens_): the receive buffers' rows
  DispatchPlan plan_;
  // The host's split arithmetic (host memory, sized in allocate()): the count exchange's
  // result, the MPI counts and the chunk table, whose copies in memory the chunk sort reads.
  std::vector<int64_t> counts_E_, counts_RE_;  // this rank's rows per expert; its ETP slice's
  std::vector<int64_t> counts_PRE_;            // every ETP slice's (ETP > 1)
  // Chunks [p][r][l] (P = 1: [r][l]), and the rows per local expert: the tables the ops read,
  // copied into memory each plan, so in pinned host memory (one block, tables_): a CUDA graph's
  // copy takes pinned or device memory (--cuda-graph-impl full_iteration captures the padded
  // all-to-all's plan; its values are static, so each replay's copies read the same).
  struct PinnedFree {
    const Exec* ex = nullptr;
    void operator()(int64_t* p) const { exec_free(*ex, MemSpace::PinnedHost, p); }
  };
  std::unique_ptr<int64_t[], PinnedFree> tables_;
  std::vector<int64_t> tables_host_;  // the same block on the CPU and in sizing passes
  int64_t* chunk_RL_ = nullptr;                // rows from source (p, r) for local expert l
  int64_t* recv_off_RL_ = nullptr;             // where that chunk lands in the gathered rows
  int64_t* sort_off_RL_ = nullptr;             // where it goes in expert order
  int64_t* rows_L_ = nullptr;                  // rows per local expert
  std::vector<int64_t> etp_rows_P_, etp_elems_P_;  // all-to-all rows of each ETP rank (x H)
  std::vector<int64_t> send_rows_R_, recv_rows_R_;
  std::vector<int64_t> send_elems_R_, recv_elems_R_;  // rows * H
  // The chunk table in memory (uploaded after the arithmetic): what copy_row_chunks reads.
  DevPtr<int64_t> chunk_dev_RL_ = nullptr;
  DevPtr<int64_t> recv_off_dev_RL_ = nullptr;
  DevPtr<int64_t> sort_off_dev_RL_ = nullptr;
  // Workspace, reused by every phase: send-side rows and probs [S], all-to-all output rows and
  // probs [recv_max_rows_], the ETP gather's [N].
  DevPtr<T> send_SH_ = nullptr;
  DevPtr<T> send_p_S_ = nullptr;
  DevPtr<T> recv_NH_ = nullptr;
  DevPtr<T> recv_p_N_ = nullptr;
  DevPtr<T> gath_NH_ = nullptr;  // ETP > 1: the ETP group's all-to-all rows and probs
  DevPtr<T> gath_p_N_ = nullptr;
  // Between a phase's start and its finish: its all-to-alls in flight (rows; probs in the
  // dispatch and its backward) and where the finish puts its result.
  parallel::CommHandle rows_in_flight_, probs_in_flight_;
  DevPtr<T> out_rows_ = nullptr;   // x_NH, y_TH, dy_NH or dx_TH
  DevPtr<bf16> out_rows16_ = nullptr;  // x_NH or dy_NH of a bf16 phase (else null)
  DevPtr<T> out_probs_ = nullptr;  // p_N or dprobs_TK
  bool back16_ = false;  // the combine or the dispatch's backward in flight moves bf16 rows
  // The phase started and not finished (a finish without its start, or a second start, is a
  // sequencing bug: the MoE layer's, not the data's).
  enum class Pending : uint8_t { None, Dispatch, Combine, CombineBackward, DispatchBackward };
  Pending pending_ = Pending::None;
  static const char* pending_name(Pending p);
  void begin(Pending phase);
  void end(Pending phase);
  void wait_in_flight();
};

}  // namespace moecore::moe
