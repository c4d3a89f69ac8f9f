// AllGatherDispatcher: the plan is a counting sort of the gathered routing map restricted to the
// local experts, ordered (local expert, source rank, token), so the experts see exactly the rows
// AlltoAllDispatcher gives them. The combine is a sum over ranks (reduce-scatter): equal to the
// alltoall combine up to the order of at most K additions per element.
#include "moe/allgather_dispatcher.h"

#include <algorithm>
#include <optional>
#include <span>
#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "core/sync_audit.h"
#include "ops/memory.h"
#include "ops/permute.h"

namespace moecore::moe {

template <typename T>
AllGatherDispatcher<T>::AllGatherDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                                            const EpRowBudget& budget, parallel::Communicator& ep,
                                            parallel::Communicator* ep_host)
    : AllGatherDispatcher(num_experts, topk, hidden, budget, ep, ep.size(), ep.rank(), ep_host) {}

template <typename T>
AllGatherDispatcher<T>::AllGatherDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                                            const EpRowBudget& budget,
                                            parallel::Communicator& tp_ep, int64_t ep_size,
                                            int64_t ep_rank, parallel::Communicator* tp_ep_host)
    : E_(num_experts),
      K_(topk),
      H_(hidden),
      L_(0),
      R_(tp_ep.size()),
      me_(tp_ep.rank()),
      ep_size_(ep_size),
      ep_rank_(ep_rank),
      budget_(budget),
      ep_(tp_ep),
      ep_host_(tp_ep_host != nullptr ? *tp_ep_host : tp_ep) {
  L_ = experts_per_ep_rank(E_, ep_size_);
  MOE_CHECK(ep_rank_ >= 0 && ep_rank_ < ep_size_ && R_ % ep_size_ == 0,
            "[dispatcher] EP rank {} of {} in a group of {} ranks: the all-gather group must be "
            "expert TP x EP",
            ep_rank_, ep_size_, R_);
}

template <typename T>
int64_t AllGatherDispatcher<T>::max_rows(int64_t max_tokens) const {
  return ep_max_rows(ep_size_, max_tokens, K_, E_, budget_, R_ / ep_size_);
}

template <typename T>
void AllGatherDispatcher<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
  max_tokens_ = max_tokens;
  const int64_t G = R_ * max_tokens, N = max_rows(max_tokens);
  plan_.tokens_per_expert_L = a.alloc<int64_t>(L_, "dispatcher.tokens_per_expert");
  meta_R2_.assign(2 * R_, 0);
  tok_off_R_.assign(R_ + 1, 0);
  for (auto* v : {&cap_R_, &tok_elems_R_, &slot_elems_R_, &send_rows_R_, &recv_rows_R_})
    v->assign(R_, 0);
  tok_off_dev_R_ = a.alloc<int64_t>(R_ + 1, "dispatcher.token_offsets");
  cap_dev_R_ = a.alloc<int64_t>(R_, "dispatcher.rank_capacity");
  cnt_LR_ = a.alloc<int64_t>(L_ * R_, "dispatcher.chunk_rows");
  pads_ = a.alloc<int64_t>(1, "dispatcher.pad_rows");
  idx_GK_ = a.alloc<int32_t>(G * K_, "dispatcher.group_idx");
  group_rows_GK_ = a.alloc<int32_t>(G * K_, "dispatcher.group_rows");
  row_token_N_ = a.alloc<int32_t>(N, "dispatcher.row_token");
  row_slot_N_ = a.alloc<int32_t>(N, "dispatcher.row_slot");
  all_GH_ = a.alloc<T>(G * H_, "dispatcher.group_rows_data", MemKind::Workspace);
  all_GK_ = a.alloc<T>(G * K_, "dispatcher.group_probs", MemKind::Workspace);
}

template <typename T>
const DispatchPlan& AllGatherDispatcher<T>::plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                                                 int64_t pad_to_rows) {
  MOE_CHECK(n_tok <= max_tokens_, "[dispatcher] {} tokens > planned maximum {}", n_tok,
            max_tokens_);
  // Dropless: the documented sync point of this dispatcher, the host reads every rank's token
  // count, and the row count of the plan, to size the gathers and the experts' launch. Padded
  // (--moe-pad-expert-input-to-capacity): every rank of the group runs the same micro-batch shape
  // and pads every expert to the same capacity (the all-to-all dispatcher's static splits rest on
  // the same), so both are known here and so is N: no exchange, no host sync, a plan that a CUDA
  // graph can hold.
  std::optional<SyncAudit::Point> point;
  if (pad_to_rows > 0) {
    for (int64_t r = 0; r < R_; ++r) {
      meta_R2_[2 * r] = n_tok;
      meta_R2_[2 * r + 1] = pad_to_rows;
    }
  } else {
    point.emplace(SyncAudit::kEpTokenCounts);
    ScopedPhase phase(Phase::Communication);
    const int64_t meta[2] = {n_tok, pad_to_rows};
    ep_host_.all_gather(std::span<const int64_t>(meta, 2), meta_R2_);
  }
  tok_off_R_[0] = 0;
  for (int64_t r = 0; r < R_; ++r) {
    const int64_t t = meta_R2_[2 * r];
    MOE_CHECK(t <= max_tokens_,
              "[dispatcher] EP rank {} has {} tokens > the planned maximum {} of EP rank {}: "
              "every EP rank must be planned for the same maximum micro-batch",
              r, t, max_tokens_, me_);
    MOE_CHECK((meta_R2_[2 * r + 1] > 0) == (pad_to_rows > 0),
              "[dispatcher] EP rank {} pads to {} rows per expert but EP rank {} to {}: "
              "--moe-pad-expert-input-to-capacity must be the same on every rank",
              r, meta_R2_[2 * r + 1], me_, pad_to_rows);
    tok_off_R_[r + 1] = tok_off_R_[r] + t;
    tok_elems_R_[r] = t * H_;
    slot_elems_R_[r] = t * K_;
    cap_R_[r] = meta_R2_[2 * r + 1];
  }
  const int64_t G = tok_off_R_[R_];
  n_group_ = G;
  {
    ScopedPhase phase(Phase::Communication);
    ep_.all_gather_v_async(idx_TK, idx_GK_, slot_elems_R_, DType::I32)
        .wait_on(*ex_);  // the plan op reads the gathered map
  }

  // The rows of the local experts, ordered (local expert, source rank, token).
  ops::GroupRouting g;
  ops::copy<int64_t>(*ex_, tok_off_dev_R_, tok_off_R_.data(), R_ + 1);
  ops::copy<int64_t>(*ex_, cap_dev_R_, cap_R_.data(), R_);
  g.idx_GK = idx_GK_;
  g.tok_off_R = tok_off_dev_R_;
  g.cap_R = cap_dev_R_;
  g.R = R_, g.me = me_, g.L = L_, g.first = ep_rank_ * L_, g.K = K_;
  g.max_rows = max_rows(max_tokens_);
  g.G = G;
  g.known_rows = pad_to_rows > 0 ? L_ * R_ * pad_to_rows : 0;
  const int64_t N = ops::build_group_permutation(*ex_, plan_.tokens_per_expert_L, row_token_N_,
                                                 row_slot_N_, group_rows_GK_, cnt_LR_, pads_, g);
  if (N > g.max_rows) {
    fail_received_rows(ep_rank_, N, g.max_rows, ep_size_, max_tokens_, K_, budget_);
  }
  // Traffic: every rank's tokens go to every other rank (and the sums come back).
  for (int64_t r = 0; r < R_; ++r) {
    send_rows_R_[r] = r == me_ ? 0 : n_tok;
    recv_rows_R_[r] = r == me_ ? 0 : meta_R2_[2 * r];
  }
  plan_.n_tok = n_tok;
  plan_.topk = K_;
  plan_.n_rows = N;
  plan_.rows_per_expert = pad_to_rows > 0 ? R_ * pad_to_rows : 0;
  plan_.pad_rows = pads_;
  plan_.row_token_N = nullptr;
  plan_.row_slot_N = nullptr;
  plan_.token_rows_TK = nullptr;
  plan_.ep_size = R_;
  plan_.send_rows_R = send_rows_R_.data();
  plan_.recv_rows_R = recv_rows_R_.data();
  return plan_;
}

template <typename T>
template <typename R>
void AllGatherDispatcher<T>::gather_rows(DevPtr<R> out_NH, DevPtr<const R> all_GH) const {
  ops::permute_rows(*ex_, out_NH, all_GH, row_token_N_, plan_.n_rows, H_);  // pad rows: zeros
}

template <typename T>
void AllGatherDispatcher<T>::scatter_rows(DevPtr<T> all_GH, DevPtr<const T> in_NH) const {
  ops::unpermute_rows(*ex_, all_GH, in_NH, group_rows_GK_, n_group_, K_, H_);
}

template <typename T>
void AllGatherDispatcher<T>::dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                                      DevPtr<const T> probs_TK) {
  {
    ScopedPhase phase(Phase::Communication);
    parallel::CommHandle hx =
        ep_.all_gather_v_async(x_TH, all_GH_, tok_elems_R_, DTypeOf<T>::value);
    parallel::CommHandle hp =
        ep_.all_gather_v_async(probs_TK, all_GK_, slot_elems_R_, DTypeOf<T>::value);
    hx.wait_on(*ex_);
    hp.wait_on(*ex_);
  }
  gather_rows<T>(x_NH, all_GH_);
  ops::gather_row_probs(*ex_, p_N, all_GK_, row_token_N_, row_slot_N_, plan_.n_rows, K_);
}

template <typename T>
void AllGatherDispatcher<T>::dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N,
                                              DevPtr<const bf16> x_TH, DevPtr<const T> probs_TK) {
  const DevPtr<bf16> all16_GH = dev_ptr_cast<bf16>(all_GH_);
  {
    ScopedPhase phase(Phase::Communication);
    parallel::CommHandle hx = ep_.all_gather_v_async(x_TH, all16_GH, tok_elems_R_, DType::BF16);
    parallel::CommHandle hp =
        ep_.all_gather_v_async(probs_TK, all_GK_, slot_elems_R_, DTypeOf<T>::value);
    hx.wait_on(*ex_);
    hp.wait_on(*ex_);
  }
  gather_rows<bf16>(x_NH, all16_GH);
  ops::gather_row_probs(*ex_, p_N, all_GK_, row_token_N_, row_slot_N_, plan_.n_rows, K_);
}

template <typename T>
void AllGatherDispatcher<T>::combine_backward16_start(DevPtr<bf16> dy_NH,
                                                      DevPtr<const bf16> dy_TH) {
  const DevPtr<bf16> all16_GH = dev_ptr_cast<bf16>(all_GH_);
  {
    ScopedPhase phase(Phase::Communication);
    ep_.all_gather_v_async(dy_TH, all16_GH, tok_elems_R_, DType::BF16).wait_on(*ex_);
  }
  gather_rows<bf16>(dy_NH, all16_GH);
}

template <typename T>
void AllGatherDispatcher<T>::scatter_rows16(DevPtr<T> all_GH, DevPtr<const bf16> in_NH) const {
  if constexpr (std::is_same_v<T, float>) {
    ops::unpermute_rows(*ex_, all_GH, in_NH, group_rows_GK_, n_group_, K_, H_);
  } else {
    MOE_FAIL("[dispatcher] bf16 expert rows are for the f32 model under --bf16");
  }
}

template <typename T>
void AllGatherDispatcher<T>::reduce_rows(DevPtr<T> y_TH) {
  ScopedPhase phase(Phase::Communication);
  ep_.reduce_scatter_v_async(all_GH_, y_TH, tok_elems_R_, DTypeOf<T>::value,
                             parallel::ReduceOp::Sum)
      .wait_on(*ex_);
}

template <typename T>
void AllGatherDispatcher<T>::combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) {
  scatter_rows(all_GH_, y_NH);
  reduce_rows(y_TH);
}

template <typename T>
void AllGatherDispatcher<T>::combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH,
                                             DevPtr<bf16> y16_NH) {
  if (R_ > ep_size_) return combine(y_TH, y_NH);  // ETP partial sums: summed in T, not rounded
  round_rows_to_bf16<T>(*ex_, y16_NH, y_NH, plan_.n_rows * H_);
  scatter_rows16(all_GH_, y16_NH);
  reduce_rows(y_TH);
}

template <typename T>
void AllGatherDispatcher<T>::combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) {
  {
    ScopedPhase phase(Phase::Communication);
    ep_.all_gather_v_async(dy_TH, all_GH_, tok_elems_R_, DTypeOf<T>::value).wait_on(*ex_);
  }
  gather_rows<T>(dy_NH, all_GH_);
}

template <typename T>
void AllGatherDispatcher<T>::dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                               DevPtr<const T> dx_NH, DevPtr<const T> dp_N) {
  scatter_rows(all_GH_, dx_NH);
  ops::scatter_row_probs(*ex_, all_GK_, dp_N, group_rows_GK_, n_group_ * K_);
  reduce_rows_and_probs(dx_TH, dprobs_TK);
}

template <typename T>
void AllGatherDispatcher<T>::dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                                       DevPtr<const T> dx_NH,
                                                       DevPtr<bf16> dx16_NH,
                                                       DevPtr<const T> dp_N) {
  if (R_ > ep_size_) return dispatch_backward(dx_TH, dprobs_TK, dx_NH, dp_N);  // as combine16
  round_rows_to_bf16<T>(*ex_, dx16_NH, dx_NH, plan_.n_rows * H_);
  scatter_rows16(all_GH_, dx16_NH);
  ops::scatter_row_probs(*ex_, all_GK_, dp_N, group_rows_GK_, n_group_ * K_);
  reduce_rows_and_probs(dx_TH, dprobs_TK);
}

template <typename T>
void AllGatherDispatcher<T>::reduce_rows_and_probs(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK) {
  ScopedPhase phase(Phase::Communication);
  parallel::CommHandle hx = ep_.reduce_scatter_v_async(all_GH_, dx_TH, tok_elems_R_,
                                                       DTypeOf<T>::value, parallel::ReduceOp::Sum);
  parallel::CommHandle hp = ep_.reduce_scatter_v_async(all_GK_, dprobs_TK, slot_elems_R_,
                                                       DTypeOf<T>::value, parallel::ReduceOp::Sum);
  hx.wait_on(*ex_);
  hp.wait_on(*ex_);
}

template class AllGatherDispatcher<float>;
template class AllGatherDispatcher<double>;

}  // namespace moecore::moe
