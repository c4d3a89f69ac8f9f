// SwiGLU MLP: h = x fc1^T (rows [gate | up]), a = silu(gate) * up (* p), y = a fc2^T.
// The functional core works on G groups of rows with per-group weights, so the dense MLP
// (G = 1), the shared expert (G = 1) and the routed experts (G = local experts, grouped GEMM)
// run the same code.
// Legend: N rows, H hidden, F ffn width, G groups (local experts).
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "nn/param_registry.h"

namespace moecore::nn {

template <typename T>
struct SwigluMlpSaved {
  const Exec* ex = &cpu_exec();  // the arena's: where the ops run (set by allocate)
  DevPtr<const T> x_NH = nullptr;       // input rows, owned by the caller until backward
  DevPtr<const T> p_N = nullptr;        // per-row probs (null: 1)
  DevPtr<const int64_t> m_G = nullptr;  // rows per group
  int64_t G = 0, N = 0;
  DevPtr<T> h_N2F = nullptr;      // fc1 output
  DevPtr<T> a_NF = nullptr;       // activation (fc2 input); null under --bf16, which keeps
  DevPtr<bf16> a16_NF = nullptr;  // only its bf16 copy
  // Activation recomputation: the backward recomputes a from h (recompute_act), or h from x
  // and then a (recompute_fc1); those buffers are MemKind::Recomputed.
  bool recompute_fc1 = false;
  bool recompute_act = false;
  // --bf16: the bf16 copies of fc1/fc2 (set by the owner at allocation; null: f32 GEMMs) and
  // two bf16 workspaces of max_rows * max(2F, H) for the other GEMM inputs.
  DevPtr<const bf16> fc1_16 = nullptr;
  DevPtr<const bf16> fc2_16 = nullptr;
  DevPtr<const float> fc1_16w = nullptr;  // the same widened to f32 (widen GEMM path; else null)
  DevPtr<const float> fc2_16w = nullptr;
  // Widened bf16 (the weights' data16w exist): a_NF holds the activation's bf16 values in f32
  // (a16_NF stays null) and the GEMMs are f32 GEMMs on bf16 values.
  bool widened = false;
  // Widened: x_NH arrives as bf16 values (its producer rounded it), so neither fc1 GEMM rounds
  // it again. Set by the owner after allocation; the forward's recomputation must then hold too.
  bool x_rounded = false;
  bool dy_rounded = false;  // the same for the backward's dy_NH
  DevPtr<bf16> ws_a16 = nullptr;
  DevPtr<bf16> ws_b16 = nullptr;
  // f32 operands of the widened-bf16 GEMM path (null on the native one).
  DevPtr<float> ws32 = nullptr;
};

struct SwigluMlpShape {
  int64_t H = 0, F = 0;
};

// What a SwiGLU MLP recomputes in its backward instead of keeping from the forward.
struct SwigluRecompute {
  bool fc1 = false;  // fc1's output (and so the activation): only the input is kept
  bool act = false;  // the activation: fc1's output is kept
};

// Buffers of a SwigluMlpSaved for up to max_rows rows; with bf16 copies of the weights
// (fc1_16/fc2_16 non-null after the params are allocated) also the bf16 workspaces.
template <typename T>
void swiglu_mlp_allocate(SwigluMlpSaved<T>& s, Arena& a, int64_t max_rows, SwigluMlpShape sh,
                         const char* name, const Param* fc1 = nullptr, const Param* fc2 = nullptr,
                         SwigluRecompute recompute = {});

// fc1 [G, 2F, H], fc2 [G, H, F]; y [N, H] assigned.
template <typename T>
void swiglu_mlp_forward(SwigluMlpSaved<T>& s, DevPtr<T> y_NH, DevPtr<const T> x_NH,
                        DevPtr<const T> p_N, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                        DevPtr<const T> fc1, DevPtr<const T> fc2, SwigluMlpShape sh);
// dx assigned, dp assigned (if p and dp non-null), dfc1/dfc2 accumulated. da_NF, dh_N2F are
// workspace of the saved sizes. Recomputes first what s.recompute_* say was not kept.
template <typename T>
void swiglu_mlp_backward(const SwigluMlpSaved<T>& s, DevPtr<T> dx_NH, DevPtr<T> dp_N,
                         DevPtr<T> dfc1, DevPtr<T> dfc2, DevPtr<const T> dy_NH, DevPtr<const T> fc1,
                         DevPtr<const T> fc2, SwigluMlpShape sh, DevPtr<T> da_NF, DevPtr<T> dh_N2F);

// A dense SwiGLU MLP layer (a transformer FFN or the shared expert).
template <typename T>
class MLP {
 public:
  MLP(int64_t hidden, int64_t ffn, double init_std, double out_init_std, ParamRegistry& params,
      const std::string& prefix);
  // recompute: keep only the input; the backward recomputes fc1 and the activation.
  void allocate(Arena& arena, int64_t max_tokens, bool recompute = false);
  // As SelfAttention's: after allocate(), an input of bf16 values skips the rounding passes.
  bool widened_bf16() const { return saved_.widened; }
  void input_rounded() { saved_.x_rounded = saved_.widened; }
  void output_grad_rounded() { saved_.dy_rounded = saved_.widened; }  // dy as bf16 values
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok);
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH);  // dx assigned, weight grads accumulated

 private:
  SwigluMlpShape sh_;
  Param* fc1_;  // [2F, H]
  Param* fc2_;  // [H, F]
  SwigluMlpSaved<T> saved_;
  int64_t rows_ = 0;                    // the host's group size, uploaded each forward
  DevPtr<int64_t> rows_dev_ = nullptr;  // [1] what the grouped GEMMs read
  DevPtr<T> da_ = nullptr;
  DevPtr<T> dh_ = nullptr;
};

}  // namespace moecore::nn
