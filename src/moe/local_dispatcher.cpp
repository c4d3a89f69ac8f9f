// LocalDispatcher: dispatch and combine as gathers over the plan's maps (deterministic).
#include "core/check.h"
#include "moe/dispatcher.h"
#include "ops/permute.h"

namespace moecore::moe {

template <typename T>
LocalDispatcher<T>::LocalDispatcher(int64_t num_experts, int64_t topk, int64_t hidden)
    : E_(num_experts), K_(topk), H_(hidden) {}

template <typename T>
void LocalDispatcher<T>::allocate(Arena& a, int64_t max_tokens) {
  max_tokens_ = max_tokens;
  plan_.tokens_per_expert_L = a.alloc<int64_t>(E_, "dispatcher.tokens_per_expert");
  plan_.row_token_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_token");
  plan_.row_slot_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_slot");
  plan_.token_rows_TK = a.alloc<int32_t>(max_tokens * K_, "dispatcher.token_rows");
}

template <typename T>
const DispatchPlan& LocalDispatcher<T>::plan(const int32_t* idx_TK, int64_t n_tok) {
  MOE_CHECK(n_tok <= max_tokens_, "[dispatcher] {} tokens > planned maximum {}", n_tok,
            max_tokens_);
  plan_.n_tok = n_tok;
  plan_.topk = K_;
  plan_.n_rows = ops::build_permutation(plan_.tokens_per_expert_L, plan_.row_token_N,
                                        plan_.row_slot_N, plan_.token_rows_TK, idx_TK, n_tok, K_,
                                        E_);
  return plan_;
}

template <typename T>
void LocalDispatcher<T>::dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) {
  ops::permute_rows(x_NH, x_TH, plan_.row_token_N, plan_.n_rows, H_);
  for (int64_t r = 0; r < plan_.n_rows; ++r) {
    p_N[r] = probs_TK[static_cast<int64_t>(plan_.row_token_N[r]) * K_ + plan_.row_slot_N[r]];
  }
}

template <typename T>
void LocalDispatcher<T>::combine(T* y_TH, const T* y_NH) {
  ops::unpermute_rows(y_TH, y_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
}

template <typename T>
void LocalDispatcher<T>::combine_backward(T* dy_NH, const T* dy_TH) {
  ops::permute_rows(dy_NH, dy_TH, plan_.row_token_N, plan_.n_rows, H_);
}

template <typename T>
void LocalDispatcher<T>::dispatch_backward(T* dx_TH, T* dprobs_TK, const T* dx_NH,
                                           const T* dp_N) {
  ops::unpermute_rows(dx_TH, dx_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
  for (int64_t i = 0; i < plan_.n_tok * K_; ++i) {
    int32_t r = plan_.token_rows_TK[i];
    dprobs_TK[i] = r >= 0 ? dp_N[r] : T(0);
  }
}

template class LocalDispatcher<float>;
template class LocalDispatcher<double>;

}  // namespace moecore::moe
