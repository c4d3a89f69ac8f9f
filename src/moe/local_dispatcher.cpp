// LocalDispatcher: dispatch and combine as gathers over the plan's maps (deterministic). With
// padding to capacity each expert's block is its real rows (token order) then pad rows, whose
// input and gradient are zero.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "moe/dispatcher.h"
#include "ops/memory.h"
#include "ops/permute.h"

namespace moecore::moe {

template <typename T>
LocalDispatcher<T>::LocalDispatcher(int64_t num_experts, int64_t topk, int64_t hidden,
                                    double pad_capacity_factor)
    : E_(num_experts), K_(topk), H_(hidden), pad_capacity_factor_(pad_capacity_factor) {}

template <typename T>
int64_t LocalDispatcher<T>::max_rows(int64_t max_tokens) const {
  int64_t rows = max_tokens * K_;
  if (pad_capacity_factor_ > 0) {
    rows = std::max(rows, E_ * expert_capacity(max_tokens, K_, E_, pad_capacity_factor_));
  }
  return rows;
}

template <typename T>
void LocalDispatcher<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
  max_tokens_ = max_tokens;
  plan_.tokens_per_expert_L = a.alloc<int64_t>(E_, "dispatcher.tokens_per_expert");
  plan_.row_token_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_token");
  plan_.row_slot_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_slot");
  plan_.token_rows_TK = a.alloc<int32_t>(max_tokens * K_, "dispatcher.token_rows");
  n_kept_ = a.alloc<int64_t>(1, "dispatcher.kept_rows");
  pads_ = a.alloc<int64_t>(1, "dispatcher.pad_rows");
  plan_.pad_rows = pads_;
}

template <typename T>
const DispatchPlan& LocalDispatcher<T>::plan(DevPtr<const int32_t> idx_TK, int64_t n_tok,
                                             int64_t pad_to_rows) {
  MOE_CHECK(n_tok <= max_tokens_, "[dispatcher] {} tokens > planned maximum {}", n_tok,
            max_tokens_);
  plan_.n_tok = n_tok;
  plan_.topk = K_;
  plan_.rows_per_expert = pad_to_rows;
  // The kept rows stay in memory; T * K rows are dispatched (the dropped slots' are zero).
  ops::build_permutation(*ex_, n_kept_, plan_.tokens_per_expert_L, plan_.row_token_N,
                         plan_.row_slot_N, plan_.token_rows_TK, idx_TK, n_tok, K_, E_);
  plan_.n_rows = n_tok * K_;
  if (pad_to_rows <= 0) {
    ops::zero(*ex_, pads_, 1);
    return plan_;
  }

  const int64_t cap = pad_to_rows;
  MOE_CHECK(E_ * cap <= max_rows(max_tokens_),
            "[dispatcher] padding to {} rows per expert needs {} rows > planned {}: the "
            "dispatcher was built for a smaller --moe-expert-capacity-factor",
            cap, E_ * cap, max_rows(max_tokens_));
  ops::pad_permutation(*ex_, pads_, plan_.tokens_per_expert_L, plan_.row_token_N,
                       plan_.row_slot_N, plan_.token_rows_TK, n_kept_, n_tok, K_, E_, cap);
  plan_.n_rows = E_ * cap;
  return plan_;
}

template <typename T>
void LocalDispatcher<T>::dispatch(DevPtr<T> x_NH, DevPtr<T> p_N, DevPtr<const T> x_TH,
                                  DevPtr<const T> probs_TK) {
  // Pad rows (row_token -1) become zero rows with prob 0.
  ops::permute_rows(*ex_, x_NH, x_TH, plan_.row_token_N, plan_.n_rows, H_);
  ops::gather_row_probs(*ex_, p_N, probs_TK, plan_.row_token_N, plan_.row_slot_N, plan_.n_rows, K_);
}

template <typename T>
void LocalDispatcher<T>::combine(DevPtr<T> y_TH, DevPtr<const T> y_NH) {
  ops::unpermute_rows(*ex_, y_TH, y_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
}

template <typename T>
void LocalDispatcher<T>::combine_backward(DevPtr<T> dy_NH, DevPtr<const T> dy_TH) {
  ops::permute_rows(*ex_, dy_NH, dy_TH, plan_.row_token_N, plan_.n_rows, H_);
}

template <typename T>
void LocalDispatcher<T>::dispatch_backward(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                           DevPtr<const T> dx_NH, DevPtr<const T> dp_N) {
  ops::unpermute_rows(*ex_, dx_TH, dx_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
  ops::scatter_row_probs(*ex_, dprobs_TK, dp_N, plan_.token_rows_TK, plan_.n_tok * K_);
}

template <typename T>
void LocalDispatcher<T>::dispatch16_start(DevPtr<bf16> x_NH, DevPtr<T> p_N, DevPtr<const bf16> x_TH,
                                          DevPtr<const T> probs_TK) {
  ops::permute_rows(*ex_, x_NH, x_TH, plan_.row_token_N, plan_.n_rows, H_);
  ops::gather_row_probs(*ex_, p_N, probs_TK, plan_.row_token_N, plan_.row_slot_N, plan_.n_rows, K_);
}

template <typename T>
void LocalDispatcher<T>::combine_backward16_start(DevPtr<bf16> dy_NH, DevPtr<const bf16> dy_TH) {
  ops::permute_rows(*ex_, dy_NH, dy_TH, plan_.row_token_N, plan_.n_rows, H_);
}

template <typename T>
void LocalDispatcher<T>::unpermute16(DevPtr<T> y_TH, DevPtr<const bf16> y16_NH) {
  if constexpr (std::is_same_v<T, float>) {
    ops::unpermute_rows(*ex_, y_TH, y16_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
  } else {
    MOE_FAIL("[dispatcher] bf16 expert rows are for the f32 model under --bf16");
  }
}

template <typename T>
void LocalDispatcher<T>::dispatch_backward_rows16(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                                  DevPtr<const bf16> dx16_NH,
                                                  DevPtr<const T> dp_N) {
  unpermute16(dx_TH, dx16_NH);
  ops::scatter_row_probs(*ex_, dprobs_TK, dp_N, plan_.token_rows_TK, plan_.n_tok * K_);
}

template <typename T>
void LocalDispatcher<T>::combine16_start(DevPtr<T> y_TH, DevPtr<const T> y_NH,
                                         DevPtr<bf16> y16_NH) {
  round_rows_to_bf16<T>(*ex_, y16_NH, y_NH, plan_.n_rows * H_);
  unpermute16(y_TH, y16_NH);
}

template <typename T>
void LocalDispatcher<T>::dispatch_backward16_start(DevPtr<T> dx_TH, DevPtr<T> dprobs_TK,
                                                   DevPtr<const T> dx_NH, DevPtr<bf16> dx16_NH,
                                                   DevPtr<const T> dp_N) {
  round_rows_to_bf16<T>(*ex_, dx16_NH, dx_NH, plan_.n_rows * H_);
  dispatch_backward_rows16(dx_TH, dprobs_TK, dx16_NH, dp_N);
}

template class LocalDispatcher<float>;
template class LocalDispatcher<double>;

}  // namespace moecore::moe
