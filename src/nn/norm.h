// The transformer's normalization layer: RMSNorm (weight) or LayerNorm (weight and bias, with
// --apply-layernorm-1p the weight stored as gamma - 1), over the hidden size of each token. The
// blocks and the final norm use it; the statistics it saves for its backward are its own.
// Legend: T tokens, H hidden.
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "nn/param_registry.h"

namespace moecore::nn {

struct NormConfig {
  bool layernorm = false;  // false: RMSNorm
  bool one_p = false;      // LayerNorm's zero-centred gamma (--apply-layernorm-1p)
  double eps = 1e-5;
  int64_t H = 0;
};

template <typename T>
class Norm {
 public:
  // Registers `<prefix>.weight` (and `<prefix>.bias` for LayerNorm), of TP role `tp_role`:
  // Replicated, or ReplicatedPartialGrad where each TP rank normalises its own tokens (sequence
  // parallelism) or heads (qk-layernorm).
  Norm(const NormConfig& cfg, ParamRegistry& params, const std::string& prefix,
       TpRole tp_role = TpRole::Replicated);
  // The statistics of up to n_tok tokens (kept for the backward: MemKind::Activations).
  void allocate(Arena& a, int64_t n_tok, const char* name);
  // y [n, H] = norm(x); round: y written as bf16 values in f32 (widened --bf16, T = float).
  void forward(const Exec& ex, DevPtr<T> y, DevPtr<const T> x, int64_t n, bool round = false);
  // dx assigned; the weight (and bias) gradients accumulated. x is the forward's input.
  void backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x, int64_t n);

 private:
  NormConfig cfg_;
  Param* weight_;
  Param* bias_ = nullptr;
  DevPtr<T> mean_ = nullptr;  // [T] LayerNorm only
  DevPtr<T> rstd_ = nullptr;  // [T]
};

}  // namespace moecore::nn
