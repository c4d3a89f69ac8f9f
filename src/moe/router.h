// The router: gating logits, score function, top-k selection (group-limited, expert-biased,
// quantile-offset or Sinkhorn-balanced), capacity dropping, the probabilities the experts
// apply, the load-balancing and z losses with their gradients, and the once-per-step
// expert-bias / quantile updates. Every mode, and where we differ from Megatron: docs/router.md.
// Legend: T tokens (sequence-major, t = s * B + b), H hidden, E routed experts, K top-k,
// B sequences in the micro-batch, S sequence length.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "moe/config.h"

namespace moecore::parallel {
class Communicator;
}

namespace moecore::moe {

// The router math runs in f64 whatever the model dtype: only the gate GEMM follows
// --moe-router-dtype (fp32: in the model dtype; fp64: x and W_r widened first). Top-k on f64
// scores cannot flip near-ties the way bf16 does, and the loss values are exact enough for the
// "uniform routing logs exactly 1.0" property.
template <typename T>
struct RouterSaved {
  DevPtr<const T> x_TH = nullptr;        // router input, owned by the caller until backward
  DevPtr<const T> gate_in_TH = nullptr;  // what the gate saw: x, or x * jitter
  DevPtr<T> jitter_TH = nullptr;         // input-jitter factors (null when off or in eval)
  DevPtr<double> logits_TE = nullptr;    // x W_r^T
  DevPtr<double> scores_TE = nullptr;    // softmax / sigmoid / sqrt(softplus) of the logits over E
  DevPtr<double> aux_scores_TE = nullptr;  // aux-loss scores: softmax, or s / (sum_E s + 1e-20)
  DevPtr<int32_t> routed_TK = nullptr;  // chosen experts before capacity dropping, descending key
  DevPtr<int32_t> idx_TK = nullptr;  // chosen experts after dropping: -1 where a slot was dropped
  DevPtr<double> topv_TK = nullptr;  // what the probs derive from: selected logits or scores
  DevPtr<double> probs64_TK = nullptr;  // the routing probs in f64 (0 at dropped slots)
  DevPtr<T> probs_TK = nullptr;         // the weights the experts apply (0 at dropped slots)
  DevPtr<int64_t> tokens_per_expert_E = nullptr;  // rows each expert really processes (after
                                                  // dropping); kept for the logs (MemKind::State)
  DevPtr<int64_t> aux_counts_E = nullptr;       // N_i of the aux map for this micro-batch
  DevPtr<int64_t> aux_seq_counts_BE = nullptr;  // N_i of the aux map per sequence
  DevPtr<double> global_counts_E = nullptr;     // global_aux_loss: mean N_i over the step so far
  DevPtr<double> lse_T = nullptr;               // logsumexp(logits), for the z-loss
  int64_t n_tok = 0;
  int64_t n_seq = 1;     // B
  int64_t capacity = 0;  // rows per expert allowed; 0 = dropless
  bool training = true;
};

// Where the last forward's ops wrote its results for the logs and the step report: planned
// memory that the host reads only after the step (the model sums it into the step report with
// ops::report_moe_layer). Coefficient-free values (aux / coeff: exactly 1.0 for uniform
// routing) are computed for every listed aux type whatever its coefficient.
struct RouterReport {
  // [3]: aux_loss, seq_aux_loss, global_aux_loss (0: not listed).
  DevPtr<const double> lb_value = nullptr;
  // The first listed aux type's slot; null when none is listed.
  DevPtr<const double> aux_value = nullptr;
  DevPtr<const double> z_value = nullptr;   // mean_t lse_t^2
  DevPtr<const int64_t> dropped = nullptr;  // (token, slot) pairs dropped by capacity
  // Rows each expert processes (after dropping).
  DevPtr<const int64_t> tokens_per_expert_E = nullptr;
};

// Per-layer routing statistics for the logs.
struct RouterStats {
  std::vector<int64_t> tokens_per_expert;  // [E] this micro-batch, after dropping
  double max_over_mean_load = 0;           // max_e N_e / mean_e N_e
  int64_t dropped = 0;
  int64_t capacity = 0;              // 0 = dropless
  float bias_min = 0, bias_max = 0;  // expert bias range (0 when off)
  float beta_min = 0, beta_max = 0;  // quantile beta range (0 when off)
};

// Collectives for the once-per-step updates; empty members = one rank. The parallel layouts
// plug their all-reduces in here: the router looks no process group up.
struct RouterStepSync {
  // In-place sum of n values over TP x DP x CP (expert-bias token counts).
  std::function<void(DevPtr<double>, int64_t)> sum_tp_dp_cp;
  // In-place mean of n values over DP x CP (the quantile beta estimate).
  std::function<void(DevPtr<double>, int64_t)> mean_dp_cp;
};

template <typename T>
class Router {
 public:
  // prefix names the layer ("decoder.layers.3.mlp"): the weight's name and the jitter stream.
  // weight_role: the weight's TP role (ReplicatedPartialGrad when the tokens are a TP slice).
  Router(const RouterConfig& cfg, int64_t hidden, double init_std, ParamRegistry& params,
         const std::string& prefix, TpRole weight_role = TpRole::Replicated);

  void allocate(Arena& arena, int64_t max_tokens);
  // The aux-loss reduce group (TP x CP, MOE_SEMANTICS "Load-balancing losses") when this rank's
  // tokens are a slice of the micro-batch (null or one rank: its tokens are the whole). Then
  // the aux-map counts are summed over it (N_i of the whole micro-batch), each rank's loss is
  // its tokens' share (the aux losses normalised with T_tot = T * |group|, the z-loss divided
  // by |group|), whose gradients are the one-rank model's; the report's values are summed
  // over the group, so every rank logs the whole layer's values.
  void set_token_group(parallel::Communicator* group) { token_group_ = group; }
  // x [T, H] sequence-major; seq_length S splits T into B = T / S sequences for seq_aux_loss
  // (0: one sequence). recompute: the backward's rerun of the last forward (activation
  // recomputation): the same jitter and the same results, and no balancing state changes.
  void forward(DevPtr<const T> x_TH, int64_t n_tok, int64_t seq_length = 0, bool recompute = false);
  // The micro-batch (of this step's training forwards, 0-based) that recomputing forwards rerun
  // until reset with -1. Unset, a recomputation reruns the last training forward; a pipeline
  // stage recomputes an earlier one before its backward (pipeline/pipeline_runner.h).
  void set_replay_micro_batch(int64_t m) { replay_micro_ = m; }
  // dprobs [T, K] -> dW_r (+=) and dx (+=: the router is one branch of the MoE input). The
  // aux and z-loss gradients enter here, multiplied by loss_grad_scale (Megatron's
  // MoEAuxLossAutoScaler scale: 1 / micro-batches).
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dprobs_TK, double loss_grad_scale);

  // Once per optimizer step, after the gradient sync: expert-bias and quantile-beta updates
  // from this step's training forwards, then the step's accumulators reset.
  void finish_step(const RouterStepSync& sync = {});
  // Drops this step's accumulators without updating anything (tests, aborted steps).
  void reset_step();
  // The host's counts of this step's training forwards (micro-batches, quantile estimates,
  // global aux-loss counts), which the ops read by value and finish_step divides by. A replayed
  // CUDA graph runs a step's forwards without their host code, so the trainer sets the counts
  // the captured step left (train/trainer.cpp) before finish_step.
  struct StepCounts {
    int64_t micro = 0, beta_micro = 0, global_micro = 0;
  };
  StepCounts step_counts() const { return {micro_, beta_micro_, global_micro_}; }
  void set_step_counts(const StepCounts& c) {
    micro_ = c.micro;
    beta_micro_ = c.beta_micro;
    global_micro_ = c.global_micro;
  }
  // Training forwards jitter the input, accumulate counts and use Sinkhorn selection; eval
  // forwards route with the current bias / beta and change no state.
  void set_training(bool training) { training_ = training; }
  // Routing replay (moe/routing_replay.h): enable_routing_replay() before allocate() makes room
  // for replayed experts, replayed_experts() [T, K]. While set_routing_replayed(true), every
  // training forward (a recomputing one included) routes its tokens to the experts the caller
  // wrote there before it, in place of its selection's: the probs are gathered from this
  // router's scores at them, and capacity, losses and counts follow as from selected experts.
  // No selection runs then, but quantile balancing's (its beta estimate is kept). Eval forwards
  // select.
  void enable_routing_replay() { routing_replay_ = true; }
  DevPtr<int32_t> replayed_experts() { return replay_TK_; }
  void set_routing_replayed(bool on);

  const RouterSaved<T>& saved() const { return saved_; }
  RouterReport report() const;
  // Host reads of the last forward's report (ops::read_back: after the step, or in tests after
  // a forward).
  double lb_value(int slot) const;
  double aux_value() const { return aux_slot_ >= 0 ? lb_value(aux_slot_) : 0.0; }
  double aux_loss() const;  // sum over the listed aux types of coeff * value
  double z_value() const;
  double z_loss() const { return cfg_.z_loss_coeff * z_value(); }
  int64_t dropped() const;
  // Fills *out in place (its vector keeps its capacity: nothing allocates inside a step); a
  // host read like the accessors above.
  void stats(RouterStats* out) const;
  RouterStats stats() const {
    RouterStats st;
    stats(&st);
    return st;
  }
  const RouterConfig& config() const { return cfg_; }
  const Param& weight() const { return *weight_; }
  // fp32 buffers [E], part of the model state (checkpointed with it).
  DevPtr<float> expert_bias() { return expert_bias_E_; }
  DevPtr<const float> expert_bias() const { return expert_bias_E_; }
  DevPtr<float> quantile_beta() { return beta_E_; }
  DevPtr<const float> quantile_beta() const { return beta_E_; }
  int64_t steps_finished() const { return step_; }
  // Resuming from a checkpoint: the optimizer steps finished (the jitter stream's counter too).
  void set_steps_finished(int64_t n);
  // d(loss) / d(logits) of the last backward, [T, E] (tests compare it with Megatron's).
  DevPtr<const double> dlogits_TE() const { return dlogits_TE_; }

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  void gate_forward(DevPtr<const T> x_TH, int64_t n_tok);
  void compute_scores(int64_t n_tok);
  void select(int64_t n_tok);
  void sinkhorn_select(int64_t n_tok);
  void quantile_select(int64_t n_tok);
  void compute_probs(int64_t n_tok);
  void apply_capacity(int64_t n_tok);
  void compute_losses(int64_t n_tok);
  void backward_probs(DevPtr<double> dlogits_TE, DevPtr<const T> dprobs_TK);
  void backward_losses(DevPtr<double> dlogits_TE, double loss_grad_scale);
  void gate_backward(DevPtr<T> dx_TH);

  RouterConfig cfg_;
  parallel::Communicator* token_group_ = nullptr;  // TP x CP (null: one rank)
  int64_t token_group_size() const;
  std::vector<LoadBalancingTerm> terms_;
  int aux_slot_ = -1;  // the report slot of the first listed aux type (-1: none listed)
  int64_t E_, K_, H_;
  int64_t max_tokens_ = 0;
  bool training_ = true;
  bool recompute_ = false;  // inside a recomputing forward
  bool gate_f64_ = false;   // gate GEMM widened to f64 (T = float with --moe-router-dtype fp64)
  uint64_t jitter_key_ = 0;
  int64_t step_ = 0, micro_ = 0;  // micro_: training forwards of this step so far
  int64_t replay_micro_ = -1;     // set_replay_micro_batch's
  bool routing_replay_ = false;   // enable_routing_replay()
  bool routing_replayed_ = false;  // set_routing_replayed()
  DevPtr<int32_t> replay_TK_ = nullptr;  // the replayed experts (routing replay)
  Param* weight_;                 // [E, H]
  RouterSaved<T> saved_;

  // Model state and the step's accumulators.
  DevPtr<float> expert_bias_E_ = nullptr;
  DevPtr<float> beta_E_ = nullptr;
  DevPtr<double> bias_counts_E_ = nullptr;  // tokens per expert over the step's training forwards
  DevPtr<double> global_sum_E_ = nullptr;   // global_aux_loss counts summed over micro-batches
  int64_t global_micro_ = 0;
  DevPtr<double> beta_sum_E_ = nullptr;  // quantile beta estimates summed over micro-batches
  int64_t beta_micro_ = 0;

  // The jitter stream's step counter, in memory (steps_finished(), advanced by an op).
  DevPtr<int64_t> jitter_step_ = nullptr;

  // Workspace.
  DevPtr<T> jitter_TH_ = nullptr;  // U(1 - eps, 1 + eps) factors
  DevPtr<T> gate_TH_ = nullptr;    // x * jitter
  DevPtr<T> dgate_TH_ = nullptr;
  DevPtr<T> logits_T_TE_ = nullptr;  // gate output in the model dtype (fp32 gate)
  DevPtr<T> dlogits_T_TE_ = nullptr;
  DevPtr<double> x64_TH_ = nullptr;  // f64 gate (fp64 router with an f32 model)
  DevPtr<double> w64_EH_ = nullptr;
  DevPtr<double> dx64_TH_ = nullptr;
  DevPtr<double> dw64_EH_ = nullptr;
  DevPtr<double> key_TE_ = nullptr;   // the selection key (logits / scores + bias / l - beta / ...)
  DevPtr<double> keyv_TK_ = nullptr;  // top-k values of the key (K + 1 columns for quantile)
  DevPtr<int32_t> keyi_TK_ = nullptr;
  DevPtr<double> col_T_ = nullptr;    // one column of (l - alpha) for the quantile estimate
  DevPtr<double> sk_d0_T_ = nullptr;  // Sinkhorn scalings
  DevPtr<double> sk_d1_E_ = nullptr;
  DevPtr<int32_t> cand_N_ = nullptr;  // capacity: (t, k) candidates per expert, expert-major
  DevPtr<int64_t> cand_off_E_ = nullptr;
  DevPtr<double> dlogits_TE_ = nullptr;
  DevPtr<double> work_TE_ = nullptr;
  DevPtr<double> work_TK_ = nullptr;
  // The report: values the ops write for the step (aux values by lb slot, then z; dropped
  // pairs), read on the host after the step (report()).
  DevPtr<double> report_ = nullptr;
  DevPtr<int64_t> report_dropped_ = nullptr;
  mutable std::vector<float> range_E_;  // host scratch of stats(): a bias or beta vector
};

}  // namespace moecore::moe
