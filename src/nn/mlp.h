// The MLP: h = x fc1^T (+ b1), a = act(h) * p, y = a fc2^T (+ p b2). act is SwiGLU (h rows
// [gate | up], 2F wide) or an element-wise activation (GeLU, its tanh form, squared ReLU: F
// wide), ops/activation.h. The functional core works on G groups of rows with per-group weights,
// so the dense MLP (G = 1), the shared expert (G = 1) and the routed experts (G = local experts,
// grouped GEMM) run the same code.
// Legend: N rows, H hidden, F ffn width, F1 fc1's output width (2F gated, else F), G groups
// (local experts).
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "ops/activation.h"
#include "ops/gemm.h"

namespace moecore::nn {

struct MlpShape {
  int64_t H = 0, F = 0;
  ops::Activation act = ops::Activation::SwiGLU;
  // fc1 bias [G, F1] added to h, fc2 bias [G, H] added to y times the row's prob. They stay f32
  // under --bf16: added in f32 after the bf16 GEMMs, their gradients summed from f32 values.
  bool bias = false;
  // With biases: whether this rank adds fc2's bias. Under tensor parallelism fc2 is row-parallel
  // (its output a partial sum over the TP ranks): the replicated bias is added once, by TP rank 0,
  // and the other ranks take neither its value nor its gradient (fc2_bias null in MlpParams).
  bool fc2_bias_here = true;
  int64_t F1() const { return ops::activation_fc1_width(act, F); }
};

// The values (DevPtr<const T>) or gradients (DevPtr<T>) of one MLP's parameters, G groups;
// the biases null without them.
template <typename P>
struct MlpParams {
  P fc1 = nullptr;       // [G, F1, H]
  P fc2 = nullptr;       // [G, H, F]
  P fc1_bias = nullptr;  // [G, F1]
  P fc2_bias = nullptr;  // [G, H]
};

// An MLP's parameter values and gradients (the bias pointers null without biases).
template <typename T>
MlpParams<DevPtr<const T>> mlp_values(const Param& fc1, const Param& fc2, const Param* fc1_bias,
                                      const Param* fc2_bias) {
  MlpParams<DevPtr<const T>> w;
  // Under --bf16 the GEMMs read the weights' bf16 copies (Param::data16 / data16w) instead.
  if (!fc1.has_bf16_copy()) w.fc1 = fc1.data_as<T>();
  if (!fc2.has_bf16_copy()) w.fc2 = fc2.data_as<T>();
  if (fc1_bias != nullptr) w.fc1_bias = fc1_bias->compute_as<T>();
  if (fc2_bias != nullptr) w.fc2_bias = fc2_bias->compute_as<T>();
  return w;
}
template <typename T>
MlpParams<DevPtr<T>> mlp_grads(Param& fc1, Param& fc2, Param* fc1_bias, Param* fc2_bias) {
  MlpParams<DevPtr<T>> g;
  g.fc1 = fc1.grad_as<T>();
  g.fc2 = fc2.grad_as<T>();
  if (fc1_bias != nullptr) g.fc1_bias = fc1_bias->grad_as<T>();
  if (fc2_bias != nullptr) g.fc2_bias = fc2_bias->grad_as<T>();
  return g;
}

template <typename T>
struct MlpSaved {
  const Exec* ex = &cpu_exec();         // the arena's: where the ops run (set by allocate)
  DevPtr<const T> x_NH = nullptr;       // input rows, owned by the caller until backward
  DevPtr<const T> p_N = nullptr;        // per-row probs (null: 1)
  DevPtr<const int64_t> m_G = nullptr;  // rows per group
  int64_t G = 0, N = 0;
  // > 0: every group has exactly this many rows, known on the host (the dense MLP's one group,
  // padded dispatch's capacity blocks): the CUDA GEMMs read no size (ops/gemm.h), so a step
  // with them can be captured in a CUDA graph. 0: the sizes are m_G's alone.
  int64_t rows_per_group = 0;
  DevPtr<T> h_NF1 = nullptr;      // fc1 output (with its bias); null under --bf16
  // --bf16: fc1's output is kept as bf16 alone, as Megatron's (TE's GEMMs write bf16): the f32
  // accumulation plus the f32 bias, rounded to nearest even, written by fc1's bf16-output GEMM
  // (ops/gemm_bf16.h, grouped_gemm_bf16_out / grouped_gemm_widened_bf16_out: a bf16 D with the
  // bias in its epilogue; no f32 h of its own). The activation and its backward read h16_NF1
  // (ops/swiglu.h, ops/activation.h: the bf16-h forms, bitwise the f32 ones on the widened
  // values).
  DevPtr<bf16> h16_NF1 = nullptr;
  // --bf16: where fc1's f32 products land before the bias and the rounding (ops/gemm_bf16.h,
  // grouped_gemm_bf16_out: the library's f32-output calls, which keep the bits): the owner's dh
  // workspace [max_rows, F1], set after allocation. dh is dead in the forward, and the backward
  // writes it only after recomputing fc1, so no f32 h is planned.
  DevPtr<T> fc1_f32 = nullptr;
  DevPtr<T> a_NF = nullptr;       // activation (fc2 input); null under --bf16, which keeps
  DevPtr<bf16> a16_NF = nullptr;  // only its bf16 copy
  // Activation recomputation: the backward recomputes a from h (recompute_act), or h from x
  // and then a (recompute_fc1); those buffers are MemKind::Recomputed.
  bool recompute_fc1 = false;
  bool recompute_act = false;
  // --bf16: the GEMMs read the weights' bf16 copies (native or widened; known in both of the
  // arena's passes, unlike the copies' addresses below).
  bool gemm16 = false;
  // --bf16: the bf16 copies of fc1/fc2 (set by the owner at allocation; null: f32 GEMMs) and
  // two bf16 workspaces of max_rows * max(F1, H) for the other GEMM inputs.
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
  bool dy_rounded = false;  // the same for the backward's dy_NH (never with biases)
  // --bf16, rows that arrive as bf16 (mlp_forward's bf16 form; x_NH then null): the owner cast
  // them once before moving them (the MoE layer's dispatch). The native GEMMs read them as they
  // are, the widened path widens them into ws32 (exact): both compute what the cast of the f32
  // rows gave, bitwise. Kept by the owner until the backward, like x_NH.
  DevPtr<const bf16> x16_NH = nullptr;
  DevPtr<bf16> ws_a16 = nullptr;
  DevPtr<bf16> ws_b16 = nullptr;
  // f32 operands of the widened-bf16 GEMM path (null on the native one).
  DevPtr<float> ws32 = nullptr;
  // The grouped GEMMs' device-table memory on CUDA (ops/gemm.h, GroupedGemmWorkspace: their
  // problem table and the backend's workspace, for G groups); empty elsewhere.
  ops::GroupedGemmWorkspace gws;
};

// What an MLP recomputes in its backward instead of keeping from the forward.
struct MlpRecompute {
  bool fc1 = false;  // fc1's output (and so the activation): only the input is kept
  bool act = false;  // the activation: fc1's output is kept
};

// Buffers of an MlpSaved for up to max_rows rows in up to `groups` groups; with bf16 copies of
// the weights (fc1_16/fc2_16 non-null after the params are allocated) also the bf16 workspaces.
template <typename T>
void mlp_allocate(MlpSaved<T>& s, Arena& a, int64_t max_rows, MlpShape sh, const char* name,
                  const Param* fc1 = nullptr, const Param* fc2 = nullptr,
                  MlpRecompute recompute = {}, int64_t groups = 1);

// y [N, H] assigned. w.fc1_bias / w.fc2_bias must be set exactly when sh.bias.
// rows_per_group: MlpSaved's (G * rows_per_group == N when > 0).
template <typename T>
void mlp_forward(MlpSaved<T>& s, DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
                 DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                 const MlpParams<DevPtr<const T>>& w, MlpShape sh, int64_t rows_per_group = 0);
// The same on input rows already cast to bf16 (MlpSaved::x16_NH): --bf16 only (the weights'
// bf16 copies allocated), bitwise mlp_forward on the f32 rows they were cast from.
void mlp_forward(MlpSaved<float>& s, DevPtr<float> y_NH, DevPtr<const bf16> x16_NH,
                 DevPtr<const float> p_N, DevPtr<const int64_t> m_G, int64_t G, int64_t N,
                 const MlpParams<DevPtr<const float>>& w, MlpShape sh, int64_t rows_per_group = 0);
// dx assigned, dp assigned (if p and dp non-null), every parameter gradient in `grad`
// accumulated. da_NF [N, F] and dh_NF1 [N, F1] are workspace. Recomputes first what
// s.recompute_* say was not kept. dy16_NH (--bf16, no biases; dy_NH then null): dy already cast
// to bf16 by the owner, which the GEMMs read as they would read the cast of dy_NH (bitwise).
template <typename T>
void mlp_backward(const MlpSaved<T>& s, DevPtr<T> dx_NH, DevPtr<T> dp_N,
                  const MlpParams<DevPtr<T>>& grad, DevPtr<const T> dy_NH,
                  const MlpParams<DevPtr<const T>>& w, MlpShape sh, DevPtr<T> da_NF,
                  DevPtr<T> dh_NF1, DevPtr<const bf16> dy16_NH = nullptr);

// A dense MLP layer (a transformer FFN or the shared expert): linear_fc1.weight [F1, H],
// linear_fc2.weight [H, F], with biases linear_fc1.bias [F1] and linear_fc2.bias [H] (zeros at
// init, no weight decay, as Megatron's).
// Tensor parallelism (tp.size > 1): fc1 is column-parallel (this rank's F / tp rows of every
// chunk of F1: SwiGLU's gate and up halves alike) with its bias, fc2 row-parallel (F / tp
// columns); fc2's bias is replicated and added by TP rank 0 only. The layer computes on the
// whole tokens it is given and returns this rank's partial sum of the output: the caller enters
// and leaves the TP region around it (parallel::TensorParallel).
template <typename T>
class MLP {
 public:
  MLP(int64_t hidden, int64_t ffn, ops::Activation act, bool bias, double init_std,
      double out_init_std, ParamRegistry& params, const std::string& prefix, TpShard tp = {});
  // recompute: keep only the input; the backward recomputes fc1 and the activation.
  void allocate(Arena& arena, int64_t max_tokens, bool recompute = false);
  // As SelfAttention's: after allocate(), an input of bf16 values skips the rounding passes.
  bool widened_bf16() const { return saved_.widened; }
  void input_rounded() { saved_.x_rounded = saved_.widened; }
  // dy as bf16 values. Not with biases: fc2's bias gradient sums dy's f32 values.
  void output_grad_rounded();
  bool has_bias() const { return sh_.bias; }
  // --bf16 (after allocate()): fc1 and fc2 are bf16 GEMMs, which read the input's bf16 values.
  bool reads_input_as_bf16() const { return saved_.gemm16; }
  // --bf16 without biases: only fc2's bf16 GEMMs read the output gradient (with biases fc2's
  // bias gradient sums its f32 values; on every TP rank alike, whichever adds the bias).
  bool reads_output_grad_as_bf16() const { return saved_.gemm16 && !sh_.bias; }
  // This rank's ffn width (ffn / tp).
  int64_t local_ffn() const { return sh_.F; }
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok);
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH);  // dx assigned, weight grads accumulated
  // Each pass in two halves, for a caller that runs them in separate windows (the shared
  // expert's overlap with the dispatcher's collectives): the same ops in the same order as the
  // one-call forms, so bitwise the same results. Between the halves the MLP's buffers hold the
  // activation (forward) or dh (backward); the caller keeps x (and dy until backward_fc1).
  void forward_fc1(DevPtr<const T> x_TH, int64_t n_tok);  // fc1 and the activation
  void forward_fc2(DevPtr<T> y_TH);                       // y = fc2 (+ its bias)
  // Recomputation, fc2's and the activation's backward: fc2's gradients accumulated.
  void backward_fc2(DevPtr<const T> dy_TH);
  // fc1's backward: dx assigned (it may be dy's memory), fc1's gradients accumulated.
  void backward_fc1(DevPtr<T> dx_TH);

 private:
  MlpParams<DevPtr<const T>> values() const;
  MlpShape sh_;
  Param* fc1_;                 // [F1, H]
  Param* fc2_;                 // [H, F]
  Param* fc1_bias_ = nullptr;  // [F1]
  Param* fc2_bias_ = nullptr;  // [H]
  MlpSaved<T> saved_;
  int64_t rows_ = 0;                    // the host's group size, uploaded when it changes
  DevPtr<int64_t> rows_dev_ = nullptr;  // [1] what the grouped GEMMs read
  DevPtr<T> da_ = nullptr;
  DevPtr<T> dh_ = nullptr;
};

}  // namespace moecore::nn
