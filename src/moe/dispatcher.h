// The token dispatcher interface: plan (from the routing decisions), dispatch (tokens to the
// rows of the local experts, expert-major), combine (expert outputs back to token order,
// summing the K copies). The plan is the handle that combine and both backwards reuse:
// dispatch's gradient runs combine's data path and vice versa. The local dispatcher (one
// rank, no communication) is the reference the EP dispatchers are tested against.
// Legend: T tokens, H hidden, K top-k, N rows for the local experts, L local experts.
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "model/config.h"

namespace moecore::moe {

struct DispatchPlan {
  int64_t n_tok = 0;
  int64_t topk = 0;
  int64_t n_rows = 0;                      // N (pad rows included)
  int64_t rows_per_expert = 0;             // > 0: padded, every local expert has exactly this
  int64_t pad_rows = 0;                    // rows that carry no token (zero input, prob 0)
  int64_t* tokens_per_expert_L = nullptr;  // rows of each local expert (pad rows included)
  int32_t* row_token_N = nullptr;          // source token of each row, -1 for a pad row
  int32_t* row_slot_N = nullptr;           // top-k slot of each row, -1 for a pad row
  int32_t* token_rows_TK = nullptr;        // row of each (token, slot), -1 if dropped
};

template <typename T>
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;

  virtual int64_t num_local_experts() const = 0;
  // Worst-case rows the local experts can receive for `max_tokens` tokens (memory planning).
  virtual int64_t max_rows(int64_t max_tokens) const = 0;
  virtual void allocate(Arena& arena, int64_t max_tokens) = 0;

  // idx < 0 marks a (token, slot) dropped by capacity. pad_to_rows > 0
  // (--moe-pad-expert-input-to-capacity): every local expert gets exactly that many rows, the
  // missing ones pad rows with zero input and prob 0 (static shapes); the router guarantees no
  // expert has more.
  virtual const DispatchPlan& plan(const int32_t* idx_TK, int64_t n_tok,
                                   int64_t pad_to_rows = 0) = 0;
  // x [T, H], probs [T, K] -> x_NH expert-major, p_N the prob of each row.
  virtual void dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) = 0;
  // y_NH -> y_TH (assigned): the sum of each token's K expert outputs.
  virtual void combine(T* y_TH, const T* y_NH) = 0;
  // Gradients: dy_TH -> dy_NH (dispatch's data path) and dx_NH, dp_N -> dx_TH, dprobs_TK
  // (combine's data path); all assigned.
  virtual void combine_backward(T* dy_NH, const T* dy_TH) = 0;
  virtual void dispatch_backward(T* dx_TH, T* dprobs_TK, const T* dx_NH, const T* dp_N) = 0;
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

  const DispatchPlan& plan(const int32_t* idx_TK, int64_t n_tok, int64_t pad_to_rows = 0) override;
  void dispatch(T* x_NH, T* p_N, const T* x_TH, const T* probs_TK) override;
  void combine(T* y_TH, const T* y_NH) override;
  void combine_backward(T* dy_NH, const T* dy_TH) override;
  void dispatch_backward(T* dx_TH, T* dprobs_TK, const T* dx_NH, const T* dp_N) override;

 private:
  int64_t E_, K_, H_;
  double pad_capacity_factor_;
  int64_t max_tokens_ = 0;
  DispatchPlan plan_;
};

}  // namespace moecore::moe
