// AlltoAllDispatcher: the local permutation is LocalDispatcher's (over all E experts), so the
// send side is exactly the single-rank path; what is added is the split arithmetic, the
// all-to-all-v and the chunk sort. Deterministic: every row is copied; the only reduction is
// ETP's reduce-scatter of the experts' partial sums (in T, also on the bf16 way back).
#include "moe/alltoall_dispatcher.h"

#include <algorithm>
#include <span>

#include "core/check.h"
#include "core/profiler.h"
#include "core/sync_audit.h"
#include "ops/memory.h"
#include "ops/permute.h"

namespace moecore::moe {

template <typename T>
AlltoAllDispatcher<T>::AlltoAllDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                                          const EpRowBudget& budget, parallel::Communicator& ep,
                                          parallel::Communicator* etp,
                                          parallel::Communicator* ep_host,
                                          parallel::Communicator* etp_host)
    : E_(num_experts),
      K_(topk),
      H_(hidden),
      L_(0),
      R_(ep.size()),
      me_(ep.rank()),
      P_(etp ? etp->size() : 1),
      pe_(etp ? etp->rank() : 0),
      budget_(budget),
      ep_(ep),
      etp_(P_ > 1 ? etp : nullptr),
      ep_host_(ep_host != nullptr ? *ep_host : ep),
      etp_host_(P_ > 1 ? (etp_host != nullptr ? etp_host : etp) : nullptr),
      local_(num_experts, topk, hidden, budget.pad_capacity_factor) {
  L_ = experts_per_ep_rank(E_, R_);
}

template <typename T>
int64_t AlltoAllDispatcher<T>::max_rows(int64_t max_tokens) const {
  return ep_max_rows(R_, max_tokens, K_, E_, budget_, P_);
}

template <typename T>
int64_t AlltoAllDispatcher<T>::recv_max_rows(int64_t max_tokens) const {
  // One ETP slice: R sources, each sending at most all its rows to this rank (padded: exactly
  // its capacity blocks); the rank capacity factor bounds the whole ETP group's rows (max_rows).
  const EpRowBudget one_slice{budget_.pad_capacity_factor, 0.0};
  return std::min(max_rows(max_tokens), ep_max_rows(R_, max_tokens, K_, E_, one_slice));
}

template <typename T>
void AlltoAllDispatcher<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
  max_tokens_ = max_tokens;
  local_.allocate(a, max_tokens);
  const int64_t S = local_.max_rows(max_tokens), N = max_rows(max_tokens);
  recv_max_rows_ = recv_max_rows(max_tokens);
  plan_.tokens_per_expert_L = a.alloc<int64_t>(L_, "dispatcher.tokens_per_expert");
  chunk_dev_RL_ = a.alloc<int64_t>(P_ * R_ * L_, "dispatcher.chunk_rows");
  recv_off_dev_RL_ = a.alloc<int64_t>(P_ * R_ * L_, "dispatcher.recv_offsets");
  sort_off_dev_RL_ = a.alloc<int64_t>(P_ * R_ * L_, "dispatcher.sort_offsets");
  counts_E_.assign(E_, 0);
  counts_RE_.assign(R_ * E_, 0);
  counts_PRE_.assign(P_ > 1 ? P_ * R_ * E_ : 0, 0);
  const int64_t n_RL = P_ * R_ * L_;
  const size_t n_tables = static_cast<size_t>(3 * n_RL + L_);
  int64_t* tables = nullptr;
  if (ex_->on_cpu() || ex_->stream == nullptr) {
    // The CPU's copies read any host memory; a sizing pass's context (no stream: a plan for a
    // device, maybe in a build without it) runs nothing and has no pinned memory to give.
    tables_.reset();
    tables_host_.assign(n_tables, 0);
    tables = tables_host_.data();
  } else {
    tables_ = std::unique_ptr<int64_t[], PinnedFree>(
        static_cast<int64_t*>(exec_alloc(*ex_, MemSpace::PinnedHost, n_tables * sizeof(int64_t))),
        PinnedFree{ex_});
    tables = tables_.get();
    std::fill(tables, tables + n_tables, 0);
  }
  chunk_RL_ = tables;
  recv_off_RL_ = chunk_RL_ + n_RL;
  sort_off_RL_ = recv_off_RL_ + n_RL;
  rows_L_ = sort_off_RL_ + n_RL;
  etp_rows_P_.assign(P_, 0);
  etp_elems_P_.assign(P_, 0);
  for (auto* v : {&send_rows_R_, &recv_rows_R_, &send_elems_R_, &recv_elems_R_}) v->assign(R_, 0);
  send_SH_ = a.alloc<T>(S * H_, "dispatcher.send_rows_data", MemKind::Workspace);
  send_p_S_ = a.alloc<T>(S, "dispatcher.send_probs", MemKind::Workspace);
  // The all-to-all lands this rank's ETP slice only; with ETP = 1 that is all N.
  recv_NH_ = a.alloc<T>(recv_max_rows_ * H_, "dispatcher.recv_rows_data", MemKind::Workspace);
  recv_p_N_ = a.alloc<T>(recv_max_rows_, "dispatcher.recv_probs", MemKind::Workspace);
  if (P_ > 1) {
    gath_NH_ = a.alloc<T>(N * H_, "dispatcher.etp_rows_data", MemKind::Workspace);
    gath_p_N_ = a.alloc<T>(N, "dispatcher.etp_probs", MemKind::Workspace);
  }
}

template <typename T>
const DispatchPlan& AlltoAllDispatcher<T>::plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                                                int64_t pad_to_rows) {
  MOE_CHECK(n_tok <= max_tokens_, "[dispatcher] {} tokens > planned maximum {}", n_tok,
            max_tokens_);
  // Send side: expert-major rows over all E experts; experts [j*L, (j+1)*L) go to EP rank j.
  const DispatchPlan& lp = local_.plan(idx_TK, n_tok, pad_to_rows);
  if (pad_to_rows > 0) {
    // Static splits: every source sends exactly pad_to_rows rows per expert.
    std::fill(counts_E_.begin(), counts_E_.end(), pad_to_rows);
    std::fill(counts_RE_.begin(), counts_RE_.end(), pad_to_rows);
    std::fill(counts_PRE_.begin(), counts_PRE_.end(), pad_to_rows);
  } else {
    ScopedPhase phase(Phase::Communication);
    // The one documented host sync of a dropless MoE layer under EP: the host sizes the
    // all-to-all from every rank's counts (padded dispatch has static splits and none).
    SyncAudit::Point point(SyncAudit::kEpCountExchange);
    ops::read_back(*ex_, counts_E_.data(), DevPtr<const int64_t>(lp.tokens_per_expert_L), E_);
    ep_host_.all_gather(counts_E_, counts_RE_);
    if (P_ > 1) etp_host_->all_gather(counts_RE_, counts_PRE_);  // the ETP x EP group's counts
  }
  // Every source (p, r)'s rows per expert: counts_PRE_ [p][r][E] (P = 1: counts_RE_).
  const std::vector<int64_t>& all = P_ > 1 ? counts_PRE_ : counts_RE_;
  // The all-to-all within this rank's ETP slice p = pe_.
  for (int64_t r = 0; r < R_; ++r) {
    int64_t sent = 0, got = 0;
    for (int64_t l = 0; l < L_; ++l) {
      sent += counts_E_[r * L_ + l];
      got += counts_RE_[r * E_ + me_ * L_ + l];
    }
    send_rows_R_[r] = sent;
    recv_rows_R_[r] = got;
    send_elems_R_[r] = sent * H_;
    recv_elems_R_[r] = got * H_;
  }
  // The gathered rows, chunks [p][r][l] (each ETP rank's all-to-all output back to back).
  int64_t recv_off = 0;
  for (int64_t p = 0; p < P_; ++p) {
    const int64_t first = recv_off;
    for (int64_t r = 0; r < R_; ++r) {
      for (int64_t l = 0; l < L_; ++l) {
        const int64_t i = (p * R_ + r) * L_ + l;
        const int64_t c = all[(p * R_ + r) * E_ + me_ * L_ + l];
        chunk_RL_[i] = c;
        recv_off_RL_[i] = recv_off;
        recv_off += c;
      }
    }
    etp_rows_P_[p] = recv_off - first;
    etp_elems_P_[p] = (recv_off - first) * H_;
  }
  const int64_t N = recv_off;
  // Before any row moves: the buffers hold max_rows. Dropless, every EP rank holds every rank's
  // counts, so all of them stop here together, naming the rank whose buffers would overflow
  // (none waits in an all-to-all for a rank that stopped); padded splits are static, the same N
  // on every rank.
  const int64_t planned = max_rows(max_tokens_);
  if (pad_to_rows > 0) {
    if (N > planned) fail_received_rows(me_, N, planned, R_, max_tokens_, K_, budget_);
  } else {
    for (int64_t dst = 0; dst < R_; ++dst) {  // host arithmetic on the exchanged counts
      int64_t rows = 0;
      for (int64_t src = 0; src < P_ * R_; ++src) {
        for (int64_t l = 0; l < L_; ++l) rows += all[src * E_ + dst * L_ + l];
      }
      if (rows > planned) fail_received_rows(dst, rows, planned, R_, max_tokens_, K_, budget_);
    }
  }
  // What this rank's all-to-all brings is bounded by construction (each source sends at most
  // its T K rows, padded exactly its capacity blocks, and all of it lies within N checked
  // above); a broken bound would overrun the receive buffers, so it is checked too.
  MOE_CHECK(etp_rows_P_[pe_] <= recv_max_rows_,
            "[dispatcher] EP rank {} (ETP rank {}) receives {} rows in its all-to-all, above the "
            "{} its receive buffers were planned for ({} EP ranks x {} tokens x top-k {})",
            me_, pe_, etp_rows_P_[pe_], recv_max_rows_, R_, max_tokens_, K_);
  int64_t sort_off = 0;
  for (int64_t l = 0; l < L_; ++l) {
    int64_t rows = 0;
    for (int64_t pr = 0; pr < P_ * R_; ++pr) {
      const int64_t i = pr * L_ + l;
      sort_off_RL_[i] = sort_off;
      sort_off += chunk_RL_[i];
      rows += chunk_RL_[i];
    }
    rows_L_[l] = rows;
  }
  // What the ops read from memory: the chunk table and the experts' group sizes.
  ops::copy<int64_t>(*ex_, chunk_dev_RL_, chunk_RL_, P_ * R_ * L_);
  ops::copy<int64_t>(*ex_, recv_off_dev_RL_, recv_off_RL_, P_ * R_ * L_);
  ops::copy<int64_t>(*ex_, sort_off_dev_RL_, sort_off_RL_, P_ * R_ * L_);
  ops::copy<int64_t>(*ex_, plan_.tokens_per_expert_L, rows_L_, L_);
  plan_.n_tok = n_tok;
  plan_.topk = K_;
  plan_.n_rows = N;
  plan_.rows_per_expert = pad_to_rows > 0 ? P_ * R_ * pad_to_rows : 0;
  plan_.pad_rows = lp.pad_rows;
  plan_.row_token_N = nullptr;
  plan_.row_slot_N = nullptr;
  plan_.token_rows_TK = lp.token_rows_TK;
  plan_.ep_size = R_;
  plan_.send_rows_R = send_rows_R_.data();
  plan_.recv_rows_R = recv_rows_R_.data();
  return plan_;
}

template <typename T>
template <typename R>
parallel::CommHandle AlltoAllDispatcher<T>::start_a2a(DevPtr<const R> send,
                                                      const std::vector<int64_t>& send_counts,
                                                      DevPtr<R> recv,
                                                      const std::vector<int64_t>& recv_counts) {
  return ep_.all_to_all_v_async(send, send_counts, recv, recv_counts, DTypeOf<R>::value);
}

template <typename T>
template <typename R>
void AlltoAllDispatcher<T>::sort_chunks(DevPtr<R> out_NW, DevPtr<const R> recv_W, int64_t W) const {
  ops::copy_row_chunks(*ex_, out_NW, recv_W, sort_off_dev_RL_, recv_off_dev_RL_, chunk_dev_RL_,
                       P_ * R_ * L_, W);
}

template <typename T>
void AlltoAllDispatcher<T>::unsort_chunks(DevPtr<T> recv_W, DevPtr<const T> in_NW,
                                          int64_t W) const {
  ops::copy_row_chunks(*ex_, recv_W, in_NW, recv_off_dev_RL_, sort_off_dev_RL_, chunk_dev_RL_,
                       P_ * R_ * L_, W);
}

template <typename T>
template <typename R>
void AlltoAllDispatcher<T>::etp_gather(DevPtr<R> all_W, DevPtr<const R> mine_W,
                                       const std::vector<int64_t>& counts_P) {
  if (P_ == 1) return;
  ScopedPhase phase(Phase::Communication);
  etp_->all_gather_v_async(mine_W, all_W, counts_P, DTypeOf<R>::value).wait_on(*ex_);
}

template <typename T>
void AlltoAllDispatcher<T>::etp_reduce_scatter(DevPtr<T> mine_W, DevPtr<const T> all_W,
                                               const std::vector<int64_t>& counts_P) {
  if (P_ == 1) return;
  ScopedPhase phase(Phase::Communication);
  etp_->reduce_scatter_v_async(all_W, mine_W, counts_P, DTypeOf<T>::value,
                               parallel::ReduceOp::Sum)
      .wait_on(*ex_);
}

template <typename T>
const char* AlltoAllDispatcher<T>::pending_name(Pending p) {
  switch (p) {
    case Pending::None:
      return "none";
    case Pending::Dispatch:
      return "dispatch";
    case Pending::Combine:
      return "combine";
    case Pending::CombineBackward:
      return "combine_backward";
    case Pending::DispatchBackward:
      return "dispatch_backward";
  }
  return "?";
}

template <typename T>
void AlltoAllDispatcher<T>::begin(Pending phase) {
  MOE_CHECK(pending_ == Pending::None,
            "[dispatcher] {}_start while {} is in flight on EP rank {}: every start is followed "
            "by its finish before the next phase starts",
            pending_name(phase), pending_name(pending_), me_);
  pending_ = phase;
}

template <typename T>
void AlltoAllDispatcher<T>::end(Pending phase) {
  MOE_CHECK(pending_ == phase,
            "[dispatcher] {}_finish on EP rank {} without its start (in flight: {})",
            pending_name(phase), me_, pending_name(pending_));
  pending_ = Pending::None;
}

template <typename T>
void AlltoAllDispatcher<T>::wait_in_flight() {
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_.wait_on(*ex_);
  probs_in_flight_.wait_on(*ex_);
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_start(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                                           DevPtr<const T> probs_TK) {
  begin(Pending::Dispatch);
  local_.dispatch(send_SH_, send_p_S_, x_TH, probs_TK);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<T>(send_SH_, send_elems_R_, recv_NH_, recv_elems_R_);
  probs_in_flight_ = start_a2a<T>(send_p_S_, send_rows_R_, recv_p_N_, recv_rows_R_);
  out_rows_ = x_NH;
  out_rows16_ = nullptr;
  out_probs_ = p_N;
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N,
                                             DevPtr<const bf16> x_TH, DevPtr<const T> probs_TK) {
  begin(Pending::Dispatch);
  local_.dispatch16(send16_SH(), send_p_S_, x_TH, probs_TK);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<bf16>(send16_SH(), send_elems_R_, recv16_NH(), recv_elems_R_);
  probs_in_flight_ = start_a2a<T>(send_p_S_, send_rows_R_, recv_p_N_, recv_rows_R_);
  out_rows_ = nullptr;
  out_rows16_ = x_NH;
  out_probs_ = p_N;
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_finish() {
  end(Pending::Dispatch);
  wait_in_flight();
  if (out_rows16_) {
    etp_gather<bf16>(rows16_NH(), recv16_NH(), etp_elems_P_);
  } else {
    etp_gather<T>(gath_NH_, recv_NH_, etp_elems_P_);
  }
  etp_gather<T>(gath_p_N_, recv_p_N_, etp_rows_P_);
  if (out_rows16_) {
    sort_chunks<bf16>(out_rows16_, rows16_NH(), H_);
  } else {
    sort_chunks<T>(out_rows_, rows_NH(), H_);
  }
  sort_chunks<T>(out_probs_, rows_p_N(), 1);
}

template <typename T>
void AlltoAllDispatcher<T>::combine_start(DevPtr<T> y_TH, DevPtr<const T> y_NH) {
  begin(Pending::Combine);
  unsort_chunks(rows_NH(), y_NH, H_);
  etp_reduce_scatter(recv_NH_, gath_NH_, etp_elems_P_);  // the experts' partial sums over F
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<T>(recv_NH_, recv_elems_R_, send_SH_, send_elems_R_);
  out_rows_ = y_TH;
  back16_ = false;
}

template <typename T>
void AlltoAllDispatcher<T>::combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH,
                                            DevPtr<bf16> y16_NH) {
  begin(Pending::Combine);
  unsort_chunks(rows_NH(), y_NH, H_);
  etp_reduce_scatter(recv_NH_, gath_NH_, etp_elems_P_);  // the partial sums over F, in T
  round_rows_to_bf16<T>(*ex_, y16_NH, recv_NH_, etp_elems_P_[pe_]);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<bf16>(y16_NH, recv_elems_R_, send16_SH(), send_elems_R_);
  out_rows_ = y_TH;
  back16_ = true;
}

template <typename T>
void AlltoAllDispatcher<T>::combine_finish() {
  end(Pending::Combine);
  wait_in_flight();
  if (back16_) {
    local_.unpermute16(out_rows_, send16_SH());
  } else {
    local_.combine(out_rows_, send_SH_);
  }
}

template <typename T>
void AlltoAllDispatcher<T>::combine_backward_start(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) {
  begin(Pending::CombineBackward);
  local_.combine_backward(send_SH_, dy_TH);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<T>(send_SH_, send_elems_R_, recv_NH_, recv_elems_R_);
  out_rows_ = dy_NH;
  out_rows16_ = nullptr;
}

template <typename T>
void AlltoAllDispatcher<T>::combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) {
  begin(Pending::CombineBackward);
  local_.combine_backward16(send16_SH(), dy_TH);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<bf16>(send16_SH(), send_elems_R_, recv16_NH(), recv_elems_R_);
  out_rows_ = nullptr;
  out_rows16_ = dy_NH;
}

template <typename T>
void AlltoAllDispatcher<T>::combine_backward_finish() {
  end(Pending::CombineBackward);
  wait_in_flight();
  if (out_rows16_) {
    etp_gather<bf16>(rows16_NH(), recv16_NH(), etp_elems_P_);
    sort_chunks<bf16>(out_rows16_, rows16_NH(), H_);
    return;
  }
  etp_gather<T>(gath_NH_, recv_NH_, etp_elems_P_);
  sort_chunks<T>(out_rows_, rows_NH(), H_);
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_backward_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                                    DevPtr<const T> dx_NH, DevPtr<const T> dp_N) {
  begin(Pending::DispatchBackward);
  unsort_chunks(rows_NH(), dx_NH, H_);
  unsort_chunks(rows_p_N(), dp_N, 1);
  etp_reduce_scatter(recv_NH_, gath_NH_, etp_elems_P_);
  etp_reduce_scatter(recv_p_N_, gath_p_N_, etp_rows_P_);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<T>(recv_NH_, recv_elems_R_, send_SH_, send_elems_R_);
  probs_in_flight_ = start_a2a<T>(recv_p_N_, recv_rows_R_, send_p_S_, send_rows_R_);
  out_rows_ = dx_TH;
  out_probs_ = dprobs_TK;
  back16_ = false;
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                                      DevPtr<const T> dx_NH,
                                                      DevPtr<bf16> dx16_NH,
                                                      DevPtr<const T> dp_N) {
  begin(Pending::DispatchBackward);
  unsort_chunks(rows_NH(), dx_NH, H_);
  unsort_chunks(rows_p_N(), dp_N, 1);
  etp_reduce_scatter(recv_NH_, gath_NH_, etp_elems_P_);
  etp_reduce_scatter(recv_p_N_, gath_p_N_, etp_rows_P_);
  round_rows_to_bf16<T>(*ex_, dx16_NH, recv_NH_, etp_elems_P_[pe_]);
  ScopedPhase phase(Phase::Communication);
  rows_in_flight_ = start_a2a<bf16>(dx16_NH, recv_elems_R_, send16_SH(), send_elems_R_);
  probs_in_flight_ = start_a2a<T>(recv_p_N_, recv_rows_R_, send_p_S_, send_rows_R_);
  out_rows_ = dx_TH;
  out_probs_ = dprobs_TK;
  back16_ = true;
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_backward_finish() {
  end(Pending::DispatchBackward);
  wait_in_flight();
  if (back16_) {
    local_.dispatch_backward_rows16(out_rows_, out_probs_, send16_SH(), send_p_S_);
  } else {
    local_.dispatch_backward(out_rows_, out_probs_, send_SH_, send_p_S_);
  }
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                                     DevPtr<const T> probs_TK) {
  dispatch_start(x_NH, p_N, x_TH, probs_TK);
  dispatch_finish();
}

template <typename T>
void AlltoAllDispatcher<T>::combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) {
  combine_start(y_TH, y_NH);
  combine_finish();
}

template <typename T>
void AlltoAllDispatcher<T>::combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) {
  combine_backward_start(dy_NH, dy_TH);
  combine_backward_finish();
}

template <typename T>
void AlltoAllDispatcher<T>::dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                              DevPtr<const T> dx_NH, DevPtr<const T> dp_N) {
  dispatch_backward_start(dx_TH, dprobs_TK, dx_NH, dp_N);
  dispatch_backward_finish();
}

template class AlltoAllDispatcher<float>;
template class AlltoAllDispatcher<double>;

}  // namespace moecore::moe
