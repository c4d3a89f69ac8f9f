// The AlltoAll dispatcher (--moe-token-dispatcher-type alltoall): tokens travel only to the EP
// ranks holding their experts. plan: permute locally over all E experts (expert-major, so the
// rows for EP rank j are contiguous), all-gather the counts per expert over EP (skipped when
// padded: capacity rows per expert per source, static), derive the splits; dispatch:
// all-to-all-v of rows and probs, then sort chunks from [source rank][local expert] to
// [local expert][source rank]; combine and both backwards are the same steps reversed.
// Legend: T tokens, H hidden, K top-k, E experts, L = E/R local experts, R EP ranks,
// S rows this rank sends, N rows for the local experts.
#pragma once

#include "moe/dispatcher.h"
#include "parallel/communicator.h"

namespace moecore::moe {

template <typename T>
class AlltoAllDispatcher final : public TokenDispatcher<T> {
 public:
  // ep: the EP group (ETP = 1). pad_capacity_factor > 0: plans may be padded to
  // expert_capacity(T, K, E, factor) rows per expert; every EP rank must then pass the same
  // pad_to_rows to plan() (same micro-batch shape), as the splits are not exchanged.
  AlltoAllDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                     double pad_capacity_factor, parallel::Communicator& ep);

  int64_t num_local_experts() const override { return L_; }
  int64_t first_local_expert() const override { return me_ * L_; }
  // Dropless: R * T * K (every token of every EP rank picks only my experts); padded: at least
  // R * L * capacity.
  int64_t max_rows(int64_t max_tokens) const override;
  void allocate(Arena& arena, int64_t max_tokens) override;

  const DispatchPlan& plan(const int32_t* idx_TK, int64_t n_tok, int64_t pad_to_rows = 0) override;
  void dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) override;
  void combine(T* y_TH, const T* y_NH) override;
  void combine_backward(T* dy_NH, const T* dy_TH) override;
  void dispatch_backward(T* dx_TH, T* dprobs_TK, const T* dx_NH, const T* dp_N) override;

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // Counts per EP rank in elements: rows (x H) for tokens, rows for probs. Forward (dispatch)
  // sends with send_*, receives with recv_*; backward (combine) swaps them.
  parallel::CommHandle start_a2a(const T* send, const int64_t* send_counts, T* recv,
                                 const int64_t* recv_counts);
  void sort_chunks(T* out_NW, const T* recv_W, int64_t W) const;    // [r][l] -> [l][r]
  void unsort_chunks(T* recv_W, const T* in_NW, int64_t W) const;  // [l][r] -> [r][l]

  int64_t E_, K_, H_, L_, R_, me_;
  double pad_capacity_factor_;
  parallel::Communicator& ep_;
  LocalDispatcher<T> local_;  // this rank's permutation over all E experts (the send side)
  int64_t max_tokens_ = 0;
  DispatchPlan plan_;
  int64_t* counts_RE_ = nullptr;    // rows each EP rank sends to each expert
  int64_t* chunk_RL_ = nullptr;     // rows from source r for local expert l
  int64_t* recv_off_RL_ = nullptr;  // where that chunk lands in the all-to-all output
  int64_t* sort_off_RL_ = nullptr;  // where it goes in expert order
  int64_t* send_rows_R_ = nullptr;
  int64_t* recv_rows_R_ = nullptr;
  int64_t* send_elems_R_ = nullptr;  // rows * H
  int64_t* recv_elems_R_ = nullptr;
  // Workspace, reused by every phase: send-side rows and probs, all-to-all output rows and probs.
  T* send_SH_ = nullptr;
  T* send_p_S_ = nullptr;
  T* recv_NH_ = nullptr;
  T* recv_p_N_ = nullptr;
};

}  // namespace moecore::moe
