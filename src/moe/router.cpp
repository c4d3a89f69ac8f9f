#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/check.h"
#include "core/rng.h"
#include "parallel/communicator.h"
#include "core/profiler.h"
#include "ops/add.h"
#include "ops/convert_f64.h"
#include "ops/memory.h"
#include "ops/gemm.h"
#include "ops/input_jitter.h"
#include "ops/router_balance.h"
#include "ops/router_losses.h"
#include "ops/router_probs.h"
#include "ops/router_scores.h"
#include "ops/router_select.h"
#include "ops/softmax_topk.h"

namespace moecore::moe {

namespace {

// Slots of the report buffer (values the ops write; the host reads them after the step).
constexpr int kReportZ = 3;  // 0..2: lb_value's slots
constexpr int kReportSlots = 4;

// Slot of an aux-loss type in the report's lb values, -1 for the loss-free types.
int lb_slot(LoadBalancing t) {
  switch (t) {
    case LoadBalancing::AuxLoss:
      return 0;
    case LoadBalancing::SeqAuxLoss:
      return 1;
    case LoadBalancing::GlobalAuxLoss:
      return 2;
    default:
      return -1;
  }
}

ops::ScoreFn score_fn(ScoreFunction s) {
  switch (s) {
    case ScoreFunction::Sigmoid:
      return ops::ScoreFn::Sigmoid;
    case ScoreFunction::SqrtSoftplus:
      return ops::ScoreFn::SqrtSoftplus;
    default:
      return ops::ScoreFn::Softmax;
  }
}

// How the probs follow from the selected values (docs/router.md, "Selection").
ops::ProbsFn probs_fn(const RouterConfig& cfg) {
  if (cfg.uses(LoadBalancing::Sinkhorn))
    return cfg.topk == 1 ? ops::ProbsFn::SigmoidTop1 : ops::ProbsFn::SoftmaxOverE;
  if (cfg.score == ScoreFunction::Softmax)
    return cfg.pre_softmax ? ops::ProbsFn::SoftmaxOverE : ops::ProbsFn::SoftmaxOverK;
  return ops::ProbsFn::Normalized;
}

}  // namespace

template <typename T>
Router<T>::Router(const RouterConfig& cfg, int64_t hidden, double init_std, ParamRegistry& params,
                  const std::string& prefix, TpRole weight_role)
    : cfg_(cfg), E_(cfg.num_experts), K_(cfg.topk), H_(hidden) {
  cfg_.validate();
  terms_ = cfg_.load_balancing_terms();
  for (const LoadBalancingTerm& term : terms_) {  // the logged aux value: the first listed type
    if (const int slot = lb_slot(term.type); slot >= 0) {
      aux_slot_ = slot;
      break;
    }
  }
  gate_f64_ = std::is_same_v<T, float> && cfg_.dtype == RouterDType::F64;
  jitter_key_ = rng_key(cfg_.seed, prefix + ".router.input_jitter");
  ParamSpec w{prefix + ".router.weight",
              {cfg.num_experts, hidden},
              ParamInit::Normal,
              init_std,
              ParamKind::Dense,
              true,
              {}};
  w.tp_role = weight_role;
  weight_ = &params.add(w);
}

template <typename T>
void Router<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
  range_E_.assign(E_, 0.0f);
  const int64_t N = max_tokens, E = E_, K = K_, H = H_;
  if (cfg_.uses(LoadBalancing::QuantileBalancing)) {
    MOE_CHECK((N * K) % E == 0,
              "[router] quantile_balancing needs tokens * topk divisible by num_experts, got "
              "{} * {} % {} != 0: change --micro-batch-size / --seq-length or --moe-router-topk",
              N, K, E);
  }
  max_tokens_ = N;
  RouterSaved<T>& s = saved_;
  s.logits_TE = a.alloc<double>(N * E, "router.logits");
  s.scores_TE = a.alloc<double>(N * E, "router.scores");
  s.aux_scores_TE = a.alloc<double>(N * E, "router.aux_scores");
  s.routed_TK = a.alloc<int32_t>(N * K, "router.routed");
  s.idx_TK = a.alloc<int32_t>(N * K, "router.idx");
  s.topv_TK = a.alloc<double>(N * K, "router.topv");
  s.probs64_TK = a.alloc<double>(N * K, "router.probs64");
  s.probs_TK = a.alloc<T>(N * K, "router.probs");
  s.tokens_per_expert_E = a.alloc<int64_t>(E, "router.tokens_per_expert", MemKind::State);
  s.aux_counts_E = a.alloc<int64_t>(E, "router.aux_counts");
  s.aux_seq_counts_BE = a.alloc<int64_t>(N * E, "router.aux_seq_counts");
  s.global_counts_E = a.alloc<double>(E, "router.global_counts");
  s.lse_T = a.alloc<double>(N, "router.lse");
  if (cfg_.input_jitter_eps > 0) {
    jitter_step_ = a.alloc<int64_t>(1, "router.jitter_step", MemKind::State);
    jitter_TH_ = a.alloc<T>(N * H, "router.jitter");
    gate_TH_ = a.alloc<T>(N * H, "router.gate_in");
    dgate_TH_ = a.alloc<T>(N * H, "router.dgate_in", MemKind::Workspace);
  }
  // Model state: fp32 like Megatron's buffers (zero-filled by the arena).
  expert_bias_E_ = a.alloc<float>(E, "router.expert_bias", MemKind::Weights);
  beta_E_ = a.alloc<float>(E, "router.quantile_beta", MemKind::Weights);
  bias_counts_E_ = a.alloc<double>(E, "router.bias_counts", MemKind::OptimizerState);
  global_sum_E_ = a.alloc<double>(E, "router.global_counts_sum", MemKind::OptimizerState);
  beta_sum_E_ = a.alloc<double>(E, "router.beta_sum", MemKind::OptimizerState);

  if (gate_f64_) {
    x64_TH_ = a.alloc<double>(N * H, "router.x64");
    w64_EH_ = a.alloc<double>(E * H, "router.w64");
    dx64_TH_ = a.alloc<double>(N * H, "router.dx64", MemKind::Workspace);
    dw64_EH_ = a.alloc<double>(E * H, "router.dw64", MemKind::Workspace);
  } else {
    logits_T_TE_ = a.alloc<T>(N * E, "router.logits_t", MemKind::Workspace);
    dlogits_T_TE_ = a.alloc<T>(N * E, "router.dlogits_t", MemKind::Workspace);
  }
  key_TE_ = a.alloc<double>(N * E, "router.key", MemKind::Workspace);
  keyv_TK_ = a.alloc<double>(N * (K + 1), "router.key_topv", MemKind::Workspace);
  keyi_TK_ = a.alloc<int32_t>(N * (K + 1), "router.key_topi", MemKind::Workspace);
  col_T_ = a.alloc<double>(std::max(N, E), "router.column", MemKind::Workspace);
  sk_d0_T_ = a.alloc<double>(N, "router.sinkhorn_d0", MemKind::Workspace);
  sk_d1_E_ = a.alloc<double>(2 * E, "router.sinkhorn_d1", MemKind::Workspace);
  cand_N_ = a.alloc<int32_t>(N * K, "router.capacity_candidates", MemKind::Workspace);
  cand_off_E_ = a.alloc<int64_t>(2 * E + 1, "router.capacity_offsets", MemKind::Workspace);
  dlogits_TE_ = a.alloc<double>(N * E, "router.dlogits", MemKind::Workspace);
  work_TE_ = a.alloc<double>(N * E, "router.work", MemKind::Workspace);
  work_TK_ = a.alloc<double>(N * K, "router.work_k", MemKind::Workspace);
  // Kept whatever is recomputed: the "moe" recomputation reroutes from it in the backward.
  if (routing_replay_)
    replay_TK_ = a.alloc<int32_t>(N * K, "router.replayed_experts", MemKind::State);
  report_ = a.alloc<double>(kReportSlots, "router.report", MemKind::State);
  // [0] the report's count; [1] a later capacity group's, added to it.
  report_dropped_ = a.alloc<int64_t>(cfg_.capacity_groups > 1 ? 2 : 1, "router.report_dropped",
                                     MemKind::State);
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T>
void Router<T>::forward(DevPtr<const T> x_TH, int64_t n_tok, int64_t seq_length, bool recompute) {
  MOE_CHECK(n_tok <= max_tokens_, "[router] {} tokens > planned maximum {}", n_tok, max_tokens_);
  MOE_CHECK(!recompute || !training_ || micro_ > std::max<int64_t>(replay_micro_, 0),
            "[router] a recomputing forward must follow a training forward of the same step");
  recompute_ = recompute;
  RouterSaved<T>& s = saved_;
  s.x_TH = x_TH;
  s.n_tok = n_tok;
  s.training = training_;
  const int64_t S = seq_length > 0 ? seq_length : std::max<int64_t>(n_tok, 1);
  if (cfg_.uses(LoadBalancing::SeqAuxLoss)) {
    MOE_CHECK(n_tok % S == 0, "[router] seq_aux_loss: {} tokens are not whole sequences of {}",
              n_tok, S);
  }
  s.n_seq = std::max<int64_t>(n_tok / S, 1);
  if (cfg_.uses(LoadBalancing::QuantileBalancing)) {
    MOE_CHECK((n_tok * K_) % E_ == 0,
              "[router] quantile_balancing needs tokens * topk divisible by num_experts, got "
              "{} * {} % {} != 0: change --micro-batch-size / --seq-length or --moe-router-topk",
              n_tok, K_, E_);
  }

  gate_forward(x_TH, n_tok);
  compute_scores(n_tok);
  // Routing replay: the replayed experts in place of a selection, which runs only where it
  // keeps state (quantile balancing's beta estimate).
  const bool replayed = routing_replayed_ && training_;
  if (!replayed || cfg_.uses(LoadBalancing::QuantileBalancing)) select(n_tok);
  if (replayed) ops::copy<int32_t>(*ex_, s.routed_TK, replay_TK_, n_tok * K_);
  compute_probs(n_tok);
  apply_capacity(n_tok);
  ops::narrow_from_f64(*ex_, s.probs_TK, s.probs64_TK, n_tok * K_);
  ops::count_tokens_per_expert(*ex_, s.tokens_per_expert_E, nullptr, s.idx_TK, n_tok, K_, E_, 1);
  compute_losses(n_tok);

  if (training_ && !recompute_) {
    // Aux-loss-free balancing counts the rows experts really processed (after dropping).
    if (cfg_.enable_expert_bias) {
      ops::accumulate_counts(*ex_, bias_counts_E_, s.tokens_per_expert_E, E_);
    }
    ++micro_;
  }
  recompute_ = false;
}

template <typename T>
void Router<T>::set_routing_replayed(bool on) {
  MOE_CHECK(!on || replay_TK_ != nullptr,
            "[router] routing replay was not enabled before the router was allocated");
  routing_replayed_ = on;
}

template <typename T>
void Router<T>::gate_forward(DevPtr<const T> x_TH, int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t H = H_, E = E_;
  DevPtr<const T> in = x_TH;
  s.jitter_TH = nullptr;
  if (cfg_.input_jitter_eps > 0 && training_) {
    // Megatron: x * U(1 - eps, 1 + eps), a fresh draw per element. Ours is a pure function of
    // (seed, layer, step, micro-batch, element), so reruns and resumes see the same noise.
    const double eps = cfg_.input_jitter_eps;
    // Stream offset: the step counter (in memory) times the planned tokens x H. A recomputing
    // forward reruns the last training forward: its micro-batch index.
    const auto micro = static_cast<uint32_t>(
        !recompute_ ? micro_ : replay_micro_ >= 0 ? replay_micro_ : micro_ - 1);
    ops::input_jitter_forward(*ex_, jitter_TH_, gate_TH_, x_TH, eps, jitter_key_, jitter_step_,
                              max_tokens_ * H, micro, n * H);
    s.jitter_TH = jitter_TH_;
    in = gate_TH_;
  }
  s.gate_in_TH = in;
  DevPtr<const T> w = weight_->compute_as<T>();
  if (gate_f64_) {
    ops::widen_to_f64(*ex_, x64_TH_, in, n * H);
    ops::widen_to_f64(*ex_, w64_EH_, w, E * H);
    ops::linear_forward(*ex_, s.logits_TE, x64_TH_, w64_EH_, n, E, H);
  } else {
    ops::linear_forward(*ex_, logits_T_TE_, in, w, n, E, H);
    ops::widen_to_f64(*ex_, s.logits_TE, logits_T_TE_, n * E);
  }
}

template <typename T>
void Router<T>::compute_scores(int64_t n) {
  RouterSaved<T>& s = saved_;
  // Megatron normalises the aux scores for every K (compute_routing_scores_for_aux_loss).
  ops::router_scores(*ex_, score_fn(cfg_.score), s.scores_TE, s.aux_scores_TE, s.logits_TE, n,
                     E_);
}

template <typename T>
void Router<T>::select(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_;
  if (cfg_.uses(LoadBalancing::Sinkhorn) && training_) return sinkhorn_select(n);
  if (cfg_.uses(LoadBalancing::QuantileBalancing)) return quantile_select(n);

  // The key the top-k runs on. Probs never see the bias or the group mask: they are gathered
  // from the logits / scores at the chosen experts in compute_probs.
  const bool on_logits = cfg_.score == ScoreFunction::Softmax && !cfg_.pre_softmax &&
                         !cfg_.uses(LoadBalancing::Sinkhorn);
  if (cfg_.uses(LoadBalancing::Sinkhorn) && K_ == 1) {  // eval, top-1: sigmoid(logits)
    ops::router_scores(*ex_, ops::ScoreFn::Sigmoid, key_TE_, nullptr, s.logits_TE, n, E);
  } else {
    // The expert bias (sigmoid-like scores only; never with sinkhorn) is added to the key.
    ops::routing_key(*ex_, key_TE_, on_logits ? s.logits_TE : s.scores_TE,
                     cfg_.enable_expert_bias ? expert_bias_E_ : nullptr, /*subtract=*/false, n,
                     E);
  }
  if (cfg_.group_limited()) {
    ops::group_limited_mask(*ex_, key_TE_, work_TE_, n, E, cfg_.num_groups, cfg_.group_topk, K_);
  }
  ops::topk(*ex_, s.routed_TK, keyv_TK_, key_TE_, n, E, K_);
}

// Megatron's sinkhorn(): S-BASE balancing of exp(logits) into a doubly stochastic matrix;
// training selects the top-k of the balanced matrix (no gradient through it).
template <typename T>
void Router<T>::sinkhorn_select(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_;
  ops::sinkhorn_balance(*ex_, key_TE_, sk_d0_T_, sk_d1_E_, s.logits_TE, n, E);
  ops::topk(*ex_, s.routed_TK, keyv_TK_, key_TE_, n, E, K_);
}

// Quantile balancing (MOE_SEMANTICS Router 5): idx = top-k of (l - beta); alpha_t = the
// (K+1)-th largest of l_t - beta; training estimates beta_local[e] = the (T K / E + 1)-th
// largest of column e of (l - alpha), which would give every expert exactly T K / E tokens.
template <typename T>
void Router<T>::quantile_select(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_, K1 = K_ + 1;
  ops::routing_key(*ex_, key_TE_, s.logits_TE, beta_E_, /*subtract=*/true, n, E);
  ops::topk(*ex_, keyi_TK_, keyv_TK_, key_TE_, n, E, K1);
  ops::topk_prefix(*ex_, s.routed_TK, keyi_TK_, n, K, K1);
  if (!training_ || recompute_ || n == 0) return;
  // T K divisible by E: checked in forward.
  ops::quantile_beta_estimate(*ex_, beta_sum_E_, col_T_, s.logits_TE, keyv_TK_, n, E, K);
  ++beta_micro_;
}

template <typename T>
void Router<T>::compute_probs(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_;
  const ops::ProbsFn fn = probs_fn(cfg_);
  // The values the probs derive from: the selected logits (softmax over K), else the scores.
  // Sinkhorn's top-1 takes sigmoid(logit) of the chosen expert.
  const bool on_logits = fn == ops::ProbsFn::SoftmaxOverK || fn == ops::ProbsFn::SigmoidTop1;
  ops::gather_topk(*ex_, s.topv_TK, on_logits ? s.logits_TE : s.scores_TE, s.routed_TK, n, E, K);
  if (fn == ops::ProbsFn::SigmoidTop1) {
    ops::router_scores(*ex_, ops::ScoreFn::Sigmoid, s.topv_TK, nullptr, s.topv_TK, n, K);
  }
  ops::topk_probs(*ex_, fn, s.probs64_TK, s.topv_TK, cfg_.topk_scaling_factor, n, K);
}

// Capacity: each expert keeps at most `capacity` of its (token, slot) pairs, by prob (ties to
// the lower token) or by position; the rest become idx = -1 with prob 0.
template <typename T>
void Router<T>::apply_capacity(int64_t n) {
  RouterSaved<T>& s = saved_;
  // Each capacity group (config.h: one unless a one-rank model routes as a TP layout) keeps its
  // own capacity; the groups' dropped pairs are summed into the report.
  const int64_t groups = cfg_.capacity_groups;
  MOE_CHECK(n % groups == 0, "[router] {} tokens do not split into {} equal capacity groups", n,
            groups);
  const int64_t g_tok = n / groups;
  s.capacity = cfg_.dropless() ? 0 : cfg_.capacity(g_tok);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = g * g_tok * K_;
    ops::apply_capacity(*ex_, s.idx_TK + at, s.probs64_TK + at,
                        g == 0 ? report_dropped_ : report_dropped_ + 1, cand_N_, cand_off_E_,
                        s.routed_TK + at, g_tok, K_, E_, s.capacity,
                        cfg_.drop_policy == TokenDropPolicy::Probs);
    if (g > 0) {
      ops::add<int64_t>(*ex_, report_dropped_, report_dropped_, report_dropped_ + 1, 1);
    }
  }
}

template <typename T>
void Router<T>::compute_losses(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_, B = s.n_seq;
  // The aux map: the experts the router chose (group limit, bias, quantile offsets included,
  // before capacity dropping), or with --moe-aux-loss-megatron-map Megatron's plain top-k of
  // the aux scores (issue #2767).
  DevPtr<const int32_t> map = s.routed_TK;
  if (cfg_.megatron_aux_map) {
    ops::topk(*ex_, keyi_TK_, keyv_TK_, s.aux_scores_TE, n, E, K);
    map = keyi_TK_;
  }
  ops::count_tokens_per_expert(*ex_, s.aux_counts_E, s.aux_seq_counts_BE, map, n, K, E, B);
  const int64_t tpcp = token_group_size();
  if (tpcp > 1) {  // N_i over the micro-batch (per sequence: the same sequences on every rank)
    ScopedPhase phase(Phase::Communication);
    token_group_->all_reduce_async(s.aux_counts_E, E, DType::I64, parallel::ReduceOp::Sum)
        .wait_on(*ex_);
    token_group_->all_reduce_async(s.aux_seq_counts_BE, B * E, DType::I64,
                                   parallel::ReduceOp::Sum)
        .wait_on(*ex_);
  }

  // The report's slots of types not listed (and all of them when n = 0) stay 0.
  ops::zero(*ex_, report_, kReportSlots);
  for (const LoadBalancingTerm& term : terms_) {
    const int slot = lb_slot(term.type);
    if (slot < 0 || n == 0) continue;
    DevPtr<double> value = report_ + slot;
    if (term.type == LoadBalancing::AuxLoss) {
      // E / (K T^2) * sum_i P_i N_i with P_i = sum_t a_ti.
      ops::aux_loss_value(*ex_, value, s.aux_scores_TE, s.aux_counts_E, n, E, K);
    } else if (term.type == LoadBalancing::SeqAuxLoss) {
      // The same per sequence (tokens t = s * B + b), averaged over the B sequences.
      ops::seq_aux_loss_value(*ex_, value, s.aux_scores_TE, s.aux_seq_counts_BE, n, E, K, B);
    } else {
      // global_aux_loss: N_i averaged over the micro-batches of the step so far (Megatron's
      // ga_steps average; the fix of #7213), normalised with this micro-batch's T.
      // A recomputing forward finds this micro-batch's counts already in the sums; the values
      // are the same doubles (the sum was stored as computed here).
      if (recompute_) {
        ops::running_mean_counts(*ex_, s.global_counts_E, global_sum_E_, nullptr,
                                 static_cast<double>(global_micro_), E);
      } else {
        ops::running_mean_counts(*ex_, s.global_counts_E, global_sum_E_, s.aux_counts_E,
                                 static_cast<double>(global_micro_ + 1), E);
      }
      if (training_ && !recompute_) {
        ops::accumulate_counts(*ex_, global_sum_E_, s.aux_counts_E, E);
        ++global_micro_;
      }
      ops::aux_loss_value(*ex_, value, s.aux_scores_TE, s.global_counts_E, n, E, K);
    }
  }

  // z-loss = coeff * mean_t logsumexp(logits_t)^2.
  ops::z_loss_value(*ex_, report_ + kReportZ, s.lse_T, s.logits_TE, n, E);
  if (tpcp > 1) {
    // This rank's shares: the aux losses with T_tot = T * |TP x CP| (the ops normalised with
    // T), the z-loss's mean over T_tot; then summed over the group.
    const double g = static_cast<double>(tpcp);
    if (n > 0) {
      ops::divide_in_place(*ex_, report_, g * g, kReportZ);
      ops::divide_in_place(*ex_, report_ + kReportZ, g, 1);
    }
    ScopedPhase phase(Phase::Communication);
    token_group_->all_reduce_async(report_, kReportZ + 1, DType::F64, parallel::ReduceOp::Sum)
        .wait_on(*ex_);
  }
}

template <typename T>
int64_t Router<T>::token_group_size() const {
  return token_group_ != nullptr ? token_group_->size() : 1;
}

// ---------------------------------------------------------------------------------------------
// Backward

template <typename T>
void Router<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dprobs_TK, double loss_grad_scale) {
  ops::zero(*ex_, dlogits_TE_, saved_.n_tok * E_);
  backward_probs(dlogits_TE_, dprobs_TK);
  backward_losses(dlogits_TE_, loss_grad_scale);
  gate_backward(dx_TH);
}

template <typename T>
void Router<T>::backward_probs(DevPtr<double> dl, DevPtr<const T> dprobs_TK) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, K = K_;
  // Undo the scaling factor; dropped slots carry no gradient (their prob is the constant 0).
  ops::kept_prob_grads(*ex_, work_TK_, dprobs_TK, s.idx_TK, cfg_.topk_scaling_factor, n * K);
  ops::topk_probs_backward(*ex_, probs_fn(cfg_), score_fn(cfg_.score), dl, work_TE_, work_TK_,
                           s.topv_TK, s.routed_TK, s.logits_TE, s.scores_TE, n, E, K);
}

template <typename T>
void Router<T>::backward_losses(DevPtr<double> dl, double loss_grad_scale) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, K = K_, B = s.n_seq;
  if (n == 0) return;
  // d(sum_j coeff_j aux_j) / d a_te, then through the aux scores to the logits.
  bool any = false;
  for (const LoadBalancingTerm& term : terms_) any |= lb_slot(term.type) >= 0 && term.coeff > 0;
  // Under TP x CP this rank's share of each loss (compute_losses): T_tot = T * g.
  const double g = static_cast<double>(token_group_size());
  if (any) {
    ops::zero(*ex_, work_TE_, n * E);
    for (const LoadBalancingTerm& term : terms_) {
      if (lb_slot(term.type) < 0 || term.coeff == 0) continue;
      const double c = loss_grad_scale * term.coeff * static_cast<double>(E) /
                       static_cast<double>(K) / (g * g);
      if (term.type == LoadBalancing::AuxLoss) {
        ops::aux_loss_grad(*ex_, work_TE_, s.aux_counts_E, c, n, E);
      } else if (term.type == LoadBalancing::SeqAuxLoss) {
        ops::seq_aux_loss_grad(*ex_, work_TE_, s.aux_seq_counts_BE, c, n, E, B);
      } else {
        ops::aux_loss_grad(*ex_, work_TE_, s.global_counts_E, c, n, E);
      }
    }
    ops::aux_scores_backward(*ex_, score_fn(cfg_.score), dl, work_TE_, s.aux_scores_TE,
                             s.scores_TE, s.logits_TE, n, E);
  }

  // z-loss: d/dlogits = coeff * 2 * lse_t * softmax(logits_t) / T.
  if (cfg_.z_loss_coeff > 0) {
    DevPtr<const double> sm = s.scores_TE;
    if (cfg_.score != ScoreFunction::Softmax) {
      ops::softmax_forward(*ex_, work_TE_, s.logits_TE, n, E);
      sm = work_TE_;
    }
    const double c = loss_grad_scale * cfg_.z_loss_coeff * 2.0 / (static_cast<double>(n) * g);
    ops::z_loss_grad(*ex_, dl, s.lse_T, sm, c, n, E);
  }
}

template <typename T>
void Router<T>::gate_backward(DevPtr<T> dx_TH) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, H = H_;
  DevPtr<T> dw = weight_->grad_as<T>();
  DevPtr<const T> w = weight_->compute_as<T>();
  if (gate_f64_) {
    ops::zero(*ex_, dw64_EH_, E * H);
    ops::linear_backward(*ex_, dx64_TH_, dw64_EH_, dlogits_TE_, x64_TH_, w64_EH_, n, E, H, false);
    ops::add_from_f64(*ex_, dw, dw64_EH_, DevPtr<const T>(nullptr), E * H);
    ops::add_from_f64(*ex_, dx_TH, dx64_TH_, DevPtr<const T>(s.jitter_TH), n * H);
    return;
  }
  ops::narrow_from_f64(*ex_, dlogits_T_TE_, dlogits_TE_, n * E);
  if (s.jitter_TH) {
    ops::linear_backward(*ex_, dgate_TH_, dw, dlogits_T_TE_, s.gate_in_TH, w, n, E, H, false);
    ops::input_jitter_backward(*ex_, dx_TH, dgate_TH_, DevPtr<const T>(s.jitter_TH), n * H);
  } else {
    ops::linear_backward(*ex_, dx_TH, dw, dlogits_T_TE_, s.gate_in_TH, w, n, E, H,
                         /*accumulate_dx=*/true);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-step updates and statistics

template <typename T>
void Router<T>::finish_step(const RouterStepSync& sync) {
  const int64_t E = E_;
  if (cfg_.enable_expert_bias) {
    // bias += u * sign(mean(c) - c) over the step's counts summed over TP x DP x CP
    // (Megatron's get_updated_expert_bias), in fp32 like Megatron's buffer.
    if (sync.sum_tp_dp_cp) sync.sum_tp_dp_cp(bias_counts_E_, E);
    ops::expert_bias_update(*ex_, expert_bias_E_, bias_counts_E_,
                            static_cast<float>(cfg_.bias_update_rate), E);
  }
  if (cfg_.uses(LoadBalancing::QuantileBalancing) && beta_micro_ > 0) {
    ops::divide_in_place(*ex_, beta_sum_E_, static_cast<double>(beta_micro_), E);
    if (sync.mean_dp_cp) sync.mean_dp_cp(beta_sum_E_, E);
    ops::quantile_beta_update(*ex_, beta_E_, col_T_, beta_sum_E_, cfg_.quantile_ema, E);
  }
  reset_step();
  if (jitter_step_) ops::input_jitter_advance(*ex_, jitter_step_);
  ++step_;
}

template <typename T>
void Router<T>::set_steps_finished(int64_t n) {
  MOE_CHECK(n >= 0, "[router] {} steps finished < 0", n);
  step_ = n;
  if (jitter_step_) ops::copy<int64_t>(*ex_, jitter_step_, &step_, 1);
}

template <typename T>
void Router<T>::reset_step() {
  ops::zero(*ex_, bias_counts_E_, E_);
  ops::zero(*ex_, global_sum_E_, E_);
  ops::zero(*ex_, beta_sum_E_, E_);
  global_micro_ = beta_micro_ = 0;
  micro_ = 0;
}

template <typename T>
RouterReport Router<T>::report() const {
  RouterReport r;
  r.lb_value = report_;
  r.z_value = report_ + kReportZ;
  r.dropped = report_dropped_;
  r.tokens_per_expert_E = saved_.tokens_per_expert_E;
  r.aux_value = aux_slot_ >= 0 ? report_ + aux_slot_ : nullptr;
  return r;
}

template <typename T>
double Router<T>::lb_value(int slot) const {
  return ops::read_value<double>(*ex_, report_ + slot);
}

template <typename T>
double Router<T>::z_value() const {
  return ops::read_value<double>(*ex_, report_ + kReportZ);
}

template <typename T>
int64_t Router<T>::dropped() const {
  return ops::read_value<int64_t>(*ex_, report_dropped_);
}

template <typename T>
double Router<T>::aux_loss() const {
  double sum = 0;
  for (const LoadBalancingTerm& term : terms_) {
    if (const int slot = lb_slot(term.type); slot >= 0) sum += term.coeff * lb_value(slot);
  }
  return sum;
}

template <typename T>
void Router<T>::stats(RouterStats* out) const {
  const RouterSaved<T>& s = saved_;
  RouterStats& st = *out;
  st.tokens_per_expert.resize(E_);
  ops::read_back(*ex_, st.tokens_per_expert.data(), DevPtr<const int64_t>(s.tokens_per_expert_E),
                 E_);
  int64_t sum = 0, mx = 0;
  for (int64_t c : st.tokens_per_expert) {
    sum += c;
    mx = std::max(mx, c);
  }
  st.max_over_mean_load = sum > 0 ? static_cast<double>(mx) * E_ / static_cast<double>(sum) : 0;
  st.dropped = dropped();
  st.capacity = s.capacity;
  st.bias_min = st.bias_max = st.beta_min = st.beta_max = 0;
  if (cfg_.enable_expert_bias) {
    ops::read_back(*ex_, range_E_.data(), DevPtr<const float>(expert_bias_E_), E_);
    st.bias_min = *std::min_element(range_E_.begin(), range_E_.end());
    st.bias_max = *std::max_element(range_E_.begin(), range_E_.end());
  }
  if (cfg_.uses(LoadBalancing::QuantileBalancing)) {
    ops::read_back(*ex_, range_E_.data(), DevPtr<const float>(beta_E_), E_);
    st.beta_min = *std::min_element(range_E_.begin(), range_E_.end());
    st.beta_max = *std::max_element(range_E_.begin(), range_E_.end());
  }
}

template class Router<float>;
template class Router<double>;

}  // namespace moecore::moe
