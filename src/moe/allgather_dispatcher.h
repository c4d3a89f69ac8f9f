// The AllGather dispatcher (--moe-token-dispatcher-type allgather, Megatron's default): every
// EP rank all-gathers the tokens, probs and routing map of the whole EP group, keeps the rows
// for its local experts, and after the experts scatters each token's local copies (summed in
// slot order) into a [group tokens, H] buffer that a reduce-scatter sums back to the owners.
// More traffic than alltoall (every token goes everywhere), no count exchange beyond the token
// counts (none at all when padded: every rank's tokens and capacity are known, so the plan has
// no host sync), and the same rows in the same order for the experts.
// With expert tensor parallelism the group is ETP x EP (tp_ep): every rank gathers the tokens of
// the whole tp_ep group, keeps the rows of its EP rank's experts (the ETP ranks of one EP rank
// keep the same rows), its experts produce partial outputs (their F/ETP share), and the
// reduce-scatter over tp_ep sums them together with the other EP ranks' outputs.
// Legend: T tokens on this rank, G tokens of the group, H hidden, K top-k, E experts,
// L = E/EP local experts, R ranks of the group (ETP x EP), N rows for the local experts.
#pragma once

#include <vector>

#include "moe/dispatcher.h"
#include "parallel/communicator.h"

namespace moecore::moe {

template <typename T>
class AllGatherDispatcher final : public TokenDispatcher<T> {
 public:
  // ep: the EP group (ETP = 1), the communicator of the context's memory (rows, probs, the
  // routing map). ep_host: the same group's communicator of host memory, which carries the token
  // counts the host sizes the gathers from (null: ep carries both, as on the CPU backend).
  AllGatherDispatcher(int64_t num_experts, int64_t topk, int64_t hidden, const EpRowBudget& budget,
                      parallel::Communicator& ep, parallel::Communicator* ep_host = nullptr);
  // tp_ep: the ETP x EP group; this rank is EP rank ep_rank of ep_size (its experts
  // [ep_rank * L, (ep_rank + 1) * L)). tp_ep_host as ep_host.
  AllGatherDispatcher(int64_t num_experts, int64_t topk, int64_t hidden, const EpRowBudget& budget,
                      parallel::Communicator& tp_ep, int64_t ep_size, int64_t ep_rank,
                      parallel::Communicator* tp_ep_host = nullptr);

  int64_t num_local_experts() const override { return L_; }
  int64_t first_local_expert() const override { return ep_rank_ * L_; }
  int64_t max_rows(int64_t max_tokens) const override;  // as AlltoAllDispatcher
  void allocate(Arena& arena, int64_t max_tokens) override;

  const DispatchPlan& plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                           int64_t pad_to_rows = 0) override;
  void dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                DevPtr<const T> probs_TK) override;
  void combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) override;
  void combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) override;
  void dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                         DevPtr<const T> dp_N) override;
  // bf16 rows: gathered as bf16 into the first half of the row workspace.
  void dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                        DevPtr<const T> probs_TK) override;
  void combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) override;
  // The way back with bf16 rows (ETP = 1): the rows rounded once into the caller's workspace,
  // each gathered token's local rows summed widened, in f32, into the T row workspace, which the
  // reduce-scatter over the group sums in T as the T forms do (it still moves T). Under expert TP
  // the rows are partial sums, which that one reduce-scatter adds together with the K rows: the T
  // forms (no rounding).
  void combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH, DevPtr<bf16> y16_NH) override;
  void dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK, DevPtr<const T> dx_NH,
                                 DevPtr<bf16> dx16_NH, DevPtr<const T> dp_N) override;

 private:
  const Exec* ex_ = &cpu_exec();                       // the arena's, from allocate()
  template <typename R>
  void gather_rows(DevPtr<R> out_NH, DevPtr<const R> all_GH) const;  // pad rows zero
  // The sum of each token's local copies.
  void scatter_rows(DevPtr<T> all_GH, DevPtr<const T> in_NH) const;
  void scatter_rows16(DevPtr<T> all_GH, DevPtr<const bf16> in_NH) const;
  // The reduce-scatters that end the combine (rows) and the dispatch's backward (rows, probs).
  void reduce_rows(DevPtr<T> y_TH);
  void reduce_rows_and_probs(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK);

  int64_t E_, K_, H_, L_, R_, me_;  // R_, me_: the group's (ETP x EP) size and rank
  int64_t ep_size_, ep_rank_;
  EpRowBudget budget_;
  parallel::Communicator& ep_;
  parallel::Communicator& ep_host_;  // the token counts (host memory)
  int64_t max_tokens_ = 0;
  int64_t n_group_ = 0;  // G
  DispatchPlan plan_;
  // The host's arithmetic over the token counts (host memory, sized in allocate()).
  std::vector<int64_t> meta_R2_;                    // (tokens, pad_to_rows) of each EP rank
  std::vector<int64_t> tok_off_R_;                  // first group token of each EP rank [R + 1]
  std::vector<int64_t> cap_R_;                      // rows per expert rank r pads to (0: dropless)
  std::vector<int64_t> tok_elems_R_;                // tokens * H of each rank (x, y)
  std::vector<int64_t> slot_elems_R_;               // tokens * K of each rank (idx, probs)
  std::vector<int64_t> send_rows_R_, recv_rows_R_;  // bytes accounting: rows leaving / arriving
  // In memory, for the permutation op: copies of tok_off_R_ and cap_R_.
  DevPtr<int64_t> tok_off_dev_R_ = nullptr;
  DevPtr<int64_t> cap_dev_R_ = nullptr;
  DevPtr<int64_t> cnt_LR_ = nullptr;  // rows for local expert l from rank r
  DevPtr<int64_t> pads_ = nullptr;    // pad rows in this rank's blocks
  DevPtr<int32_t> idx_GK_ = nullptr;  // the group's routing map
  // Row of each group (token, slot), -1: not mine / dropped.
  DevPtr<int32_t> group_rows_GK_ = nullptr;
  DevPtr<int32_t> row_token_N_ = nullptr;  // group token of each row, -1 for a pad row
  DevPtr<int32_t> row_slot_N_ = nullptr;
  // Workspace, reused by every phase.
  DevPtr<T> all_GH_ = nullptr;  // gathered tokens; then the partial outputs / input gradients
  DevPtr<T> all_GK_ = nullptr;  // gathered probs; then the prob gradients
};

}  // namespace moecore::moe
