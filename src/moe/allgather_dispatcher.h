// The AllGather dispatcher (--moe-token-dispatcher-type allgather, Megatron's default): every
// EP rank all-gathers the tokens, probs and routing map of the whole EP group, keeps the rows
// for its local experts, and after the experts scatters each token's local copies (summed in
// slot order) into a [group tokens, H] buffer that a reduce-scatter sums back to the owners.
// More traffic than alltoall (every token goes everywhere), no count exchange beyond the token
// counts, and the same rows in the same order for the experts.
// Legend: T tokens on this rank, G tokens of the EP group, H hidden, K top-k, E experts,
// L = E/R local experts, R EP ranks, N rows for the local experts.
#pragma once

#include "moe/dispatcher.h"
#include "parallel/communicator.h"

namespace moecore::moe {

template <typename T>
class AllGatherDispatcher final : public TokenDispatcher<T> {
 public:
  AllGatherDispatcher(int64_t num_experts, int64_t topk, int64_t hidden, double pad_capacity_factor,
                      parallel::Communicator& ep);

  int64_t num_local_experts() const override { return L_; }
  int64_t first_local_expert() const override { return me_ * L_; }
  int64_t max_rows(int64_t max_tokens) const override;  // as AlltoAllDispatcher
  void allocate(Arena& arena, int64_t max_tokens) override;

  const DispatchPlan& plan(const int32_t* idx_TK, int64_t n_tok, int64_t pad_to_rows = 0) override;
  void dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) override;
  void combine(T* y_TH, const T* y_NH) override;
  void combine_backward(T* dy_NH, const T* dy_TH) override;
  void dispatch_backward(T* dx_TH, T* dprobs_TK, const T* dx_NH, const T* dp_N) override;

 private:
  const Exec* ex_ = &cpu_exec();                       // the arena's, from allocate()
  void gather_rows(T* out_NH, const T* all_GH) const;  // pad rows zero
  void scatter_rows(T* all_GH, const T* in_NH) const;  // sum of each token's local copies

  int64_t E_, K_, H_, L_, R_, me_;
  double pad_capacity_factor_;
  parallel::Communicator& ep_;
  int64_t max_tokens_ = 0;
  int64_t n_group_ = 0;  // G
  DispatchPlan plan_;
  int64_t* meta_R2_ = nullptr;        // (tokens, pad_to_rows) of each EP rank
  int64_t* tok_off_R_ = nullptr;      // first group token of each EP rank
  int64_t* tok_elems_R_ = nullptr;    // tokens * H of each rank (x, y)
  int64_t* slot_elems_R_ = nullptr;   // tokens * K of each rank (idx, probs)
  int64_t* cnt_LR_ = nullptr;         // rows for local expert l from rank r
  int64_t* cap_R_ = nullptr;          // rows per expert rank r pads to (0: dropless)
  int64_t* pads_ = nullptr;           // pad rows in this rank's blocks
  int32_t* idx_GK_ = nullptr;         // the group's routing map
  int32_t* group_rows_GK_ = nullptr;  // row of each group (token, slot), -1: not mine / dropped
  int32_t* row_token_N_ = nullptr;    // group token of each row, -1 for a pad row
  int32_t* row_slot_N_ = nullptr;
  int64_t* send_rows_R_ = nullptr;  // bytes accounting: rows leaving / arriving per rank
  int64_t* recv_rows_R_ = nullptr;
  // Workspace, reused by every phase.
  T* all_GH_ = nullptr;  // gathered tokens; then the partial outputs / input gradients
  T* all_GK_ = nullptr;  // gathered probs; then the prob gradients
};

}  // namespace moecore::moe
