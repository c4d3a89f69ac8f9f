// LocalDispatcher: dispatch and combine as gathers over the plan's maps (deterministic). With
// padding to capacity each expert's block is its real rows (token order) then pad rows, whose
// input and gradient are zero.
#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "moe/dispatcher.h"
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
  max_tokens_ = max_tokens;
  plan_.tokens_per_expert_L = a.alloc<int64_t>(E_, "dispatcher.tokens_per_expert");
  plan_.row_token_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_token");
  plan_.row_slot_N = a.alloc<int32_t>(max_rows(max_tokens), "dispatcher.row_slot");
  plan_.token_rows_TK = a.alloc<int32_t>(max_tokens * K_, "dispatcher.token_rows");
}

template <typename T>
const DispatchPlan& LocalDispatcher<T>::plan(const int32_t* idx_TK, int64_t n_tok,
                                             int64_t pad_to_rows) {
  MOE_CHECK(n_tok <= max_tokens_, "[dispatcher] {} tokens > planned maximum {}", n_tok,
            max_tokens_);
  plan_.n_tok = n_tok;
  plan_.topk = K_;
  plan_.rows_per_expert = pad_to_rows;
  plan_.pad_rows = 0;
  const int64_t real = ops::build_permutation(plan_.tokens_per_expert_L, plan_.row_token_N,
                                              plan_.row_slot_N, plan_.token_rows_TK, idx_TK,
                                              n_tok, K_, E_);
  plan_.n_rows = real;
  if (pad_to_rows <= 0) return plan_;

  const int64_t cap = pad_to_rows;
  MOE_CHECK(E_ * cap <= max_rows(max_tokens_),
            "[dispatcher] padding to {} rows per expert needs {} rows > planned {}: the "
            "dispatcher was built for a smaller --moe-expert-capacity-factor",
            cap, E_ * cap, max_rows(max_tokens_));
  // Move each expert's block from its packed offset to e * cap, last expert first (blocks only
  // move up), and fill the tail with pad rows.
  int64_t end = real;
  for (int64_t e = E_ - 1; e >= 0; --e) {
    const int64_t cnt = plan_.tokens_per_expert_L[e];
    MOE_CHECK(cnt <= cap,
              "[dispatcher] expert {} has {} rows > capacity {}: the router must drop to "
              "capacity before padding",
              e, cnt, cap);
    const int64_t from = end - cnt;
    end = from;
    std::memmove(plan_.row_token_N + e * cap, plan_.row_token_N + from, sizeof(int32_t) * cnt);
    std::memmove(plan_.row_slot_N + e * cap, plan_.row_slot_N + from, sizeof(int32_t) * cnt);
    for (int64_t r = e * cap + cnt; r < (e + 1) * cap; ++r) {
      plan_.row_token_N[r] = -1;
      plan_.row_slot_N[r] = -1;
    }
    plan_.pad_rows += cap - cnt;
    plan_.tokens_per_expert_L[e] = cap;
  }
  plan_.n_rows = E_ * cap;
  for (int64_t r = 0; r < plan_.n_rows; ++r) {
    if (plan_.row_token_N[r] >= 0) {
      plan_.token_rows_TK[static_cast<int64_t>(plan_.row_token_N[r]) * K_ + plan_.row_slot_N[r]] =
          static_cast<int32_t>(r);
    }
  }
  return plan_;
}

// Gathers rows of src_TH into dst_NH over the plan; pad rows become zero.
template <typename T>
static void gather_rows(T* dst_NH, const T* src_TH, const DispatchPlan& p, int64_t H) {
  if (p.rows_per_expert <= 0) {
    ops::permute_rows(dst_NH, src_TH, p.row_token_N, p.n_rows, H);
    return;
  }
  const int64_t cap = p.rows_per_expert, L = p.n_rows / cap;
  for (int64_t e = 0; e < L; ++e) {
    const int32_t* rows = p.row_token_N + e * cap;
    int64_t real = 0;
    while (real < cap && rows[real] >= 0) ++real;
    ops::permute_rows(dst_NH + e * cap * H, src_TH, rows, real, H);
    std::memset(dst_NH + (e * cap + real) * H, 0, sizeof(T) * (cap - real) * H);
  }
}

template <typename T>
void LocalDispatcher<T>::dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) {
  gather_rows(x_NH, x_TH, plan_, H_);
  for (int64_t r = 0; r < plan_.n_rows; ++r) {
    const int32_t t = plan_.row_token_N[r];
    p_N[r] = t >= 0 ? probs_TK[static_cast<int64_t>(t) * K_ + plan_.row_slot_N[r]] : T(0);
  }
}

template <typename T>
void LocalDispatcher<T>::combine(T* y_TH, const T* y_NH) {
  ops::unpermute_rows(y_TH, y_NH, plan_.token_rows_TK, plan_.n_tok, K_, H_);
}

template <typename T>
void LocalDispatcher<T>::combine_backward(T* dy_NH, const T* dy_TH) {
  gather_rows(dy_NH, dy_TH, plan_, H_);
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
