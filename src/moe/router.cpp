#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "core/rng.h"
#include "ops/gemm.h"
#include "ops/softmax_topk.h"

namespace moecore::moe {

namespace {

// Megatron's epsilon in the sigmoid / sqrtsoftplus normalisations (issue #1545: it lets the
// aux loss dip below its floor; we keep it for parity, it is far below f64 resolution of 1).
constexpr double kNormEps = 1e-20;
// Megatron's Sinkhorn: stop when mean |d1 change| <= tol; eps guards the divisions.
constexpr double kSinkhornTol = 1e-4;
constexpr double kSinkhornEps = 1e-8;
constexpr int kSinkhornMaxIters = 100000;

// Slot of an aux-loss type in RouterSaved::lb_value, -1 for the loss-free types.
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

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
// log(1 + e^x) without overflow.
double softplus(double x) {
  return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

bool sigmoid_like(ScoreFunction s) {
  return s == ScoreFunction::Sigmoid || s == ScoreFunction::SqrtSoftplus;
}

// d score / d logit for the elementwise score functions, from the logit and the score.
double dscore_dlogit(ScoreFunction f, double logit, double score) {
  if (f == ScoreFunction::Sigmoid) return score * (1.0 - score);
  return sigmoid(logit) / (2.0 * score);  // d sqrt(softplus(l)) / dl
}

}  // namespace

template <typename T>
Router<T>::Router(const RouterConfig& cfg, int64_t hidden, double init_std, ParamRegistry& params,
                  const std::string& prefix)
    : cfg_(cfg), E_(cfg.num_experts), K_(cfg.topk), H_(hidden) {
  cfg_.validate();
  terms_ = cfg_.load_balancing_terms();
  gate_f64_ = std::is_same_v<T, float> && cfg_.dtype == RouterDType::F64;
  jitter_key_ = rng_key(cfg_.seed, prefix + ".router.input_jitter");
  weight_ = &params.add(ParamSpec{prefix + ".router.weight",
                                  {cfg.num_experts, hidden},
                                  ParamInit::Normal,
                                  init_std,
                                  ParamKind::Dense,
                                  true,
                                  {}});
}

template <typename T>
void Router<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
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
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T>
void Router<T>::forward(const T* x_TH, int64_t n_tok, int64_t seq_length, bool recompute) {
  MOE_CHECK(n_tok <= max_tokens_, "[router] {} tokens > planned maximum {}", n_tok, max_tokens_);
  MOE_CHECK(!recompute || !training_ || micro_ > 0,
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
  select(n_tok);
  compute_probs(n_tok);
  apply_capacity(n_tok);
  for (int64_t i = 0; i < n_tok * K_; ++i) s.probs_TK[i] = static_cast<T>(s.probs64_TK[i]);
  std::memset(s.tokens_per_expert_E, 0, sizeof(int64_t) * E_);
  for (int64_t i = 0; i < n_tok * K_; ++i) {
    if (s.idx_TK[i] >= 0) ++s.tokens_per_expert_E[s.idx_TK[i]];
  }
  compute_losses(n_tok);

  if (training_ && !recompute_) {
    // Aux-loss-free balancing counts the rows experts really processed (after dropping).
    if (cfg_.enable_expert_bias) {
      for (int64_t e = 0; e < E_; ++e) bias_counts_E_[e] += s.tokens_per_expert_E[e];
    }
    ++micro_;
  }
  recompute_ = false;
}

template <typename T>
void Router<T>::gate_forward(const T* x_TH, int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t H = H_, E = E_;
  const T* in = x_TH;
  s.jitter_TH = nullptr;
  if (cfg_.input_jitter_eps > 0 && training_) {
    // Megatron: x * U(1 - eps, 1 + eps), a fresh draw per element. Ours is a pure function of
    // (seed, layer, step, micro-batch, element), so reruns and resumes see the same noise.
    const double eps = cfg_.input_jitter_eps;
    const uint64_t base = static_cast<uint64_t>(step_) * static_cast<uint64_t>(max_tokens_ * H);
    // A recomputing forward reruns the last training forward: its micro-batch index.
    const auto micro = static_cast<uint32_t>(recompute_ ? micro_ - 1 : micro_);
    for (int64_t i = 0; i < n * H; ++i) {
      double u = rng_uniform(jitter_key_, base + static_cast<uint64_t>(i), micro);
      jitter_TH_[i] = static_cast<T>(1.0 - eps + 2.0 * eps * u);
      gate_TH_[i] = x_TH[i] * jitter_TH_[i];
    }
    s.jitter_TH = jitter_TH_;
    in = gate_TH_;
  }
  s.gate_in_TH = in;
  const T* w = weight_->data_as<T>();
  if (gate_f64_) {
    for (int64_t i = 0; i < n * H; ++i) x64_TH_[i] = static_cast<double>(in[i]);
    for (int64_t i = 0; i < E * H; ++i) w64_EH_[i] = static_cast<double>(w[i]);
    ops::linear_forward(*ex_, s.logits_TE, x64_TH_, w64_EH_, n, E, H);
  } else {
    ops::linear_forward(*ex_, logits_T_TE_, in, w, n, E, H);
    for (int64_t i = 0; i < n * E; ++i) s.logits_TE[i] = static_cast<double>(logits_T_TE_[i]);
  }
}

template <typename T>
void Router<T>::compute_scores(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_;
  if (cfg_.score == ScoreFunction::Softmax) {
    ops::softmax_forward(*ex_, s.scores_TE, s.logits_TE, n, E);
    std::memcpy(s.aux_scores_TE, s.scores_TE, sizeof(double) * n * E);
    return;
  }
  for (int64_t t = 0; t < n; ++t) {
    const double* l = s.logits_TE + t * E;
    double* sc = s.scores_TE + t * E;
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      sc[e] = cfg_.score == ScoreFunction::Sigmoid ? sigmoid(l[e]) : std::sqrt(softplus(l[e]));
      sum += sc[e];
    }
    // Megatron normalises the aux scores for every K (compute_routing_scores_for_aux_loss).
    for (int64_t e = 0; e < E; ++e) s.aux_scores_TE[t * E + e] = sc[e] / (sum + kNormEps);
  }
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
  std::memcpy(key_TE_, on_logits ? s.logits_TE : s.scores_TE, sizeof(double) * n * E);
  if (cfg_.uses(LoadBalancing::Sinkhorn) && K_ == 1) {
    for (int64_t i = 0; i < n * E; ++i) key_TE_[i] = sigmoid(s.logits_TE[i]);  // eval, top-1
  }
  if (cfg_.enable_expert_bias) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e) key_TE_[t * E + e] += expert_bias_E_[e];
    }
  }
  if (cfg_.group_limited()) group_limited_topk(key_TE_, n);
  ops::topk(*ex_, s.routed_TK, keyv_TK_, key_TE_, n, E, K_);
}

// Megatron's group_limited_topk: group score = sum of the top-(K/g) keys in each of G
// contiguous groups; keep the g best groups and mask every other expert to -inf.
template <typename T>
void Router<T>::group_limited_topk(double* key_TE, int64_t n) {
  const int64_t E = E_, G = cfg_.num_groups, g = cfg_.group_topk, per = E / G, kg = K_ / g;
  for (int64_t t = 0; t < n; ++t) {
    double* key = key_TE + t * E;
    double* row = work_TE_ + t * E;  // scratch copy, partially sorted per group
    std::memcpy(row, key, sizeof(double) * E);
    double* group_score = col_T_;  // [G] (col_T_ holds max(T, E) >= G values)
    for (int64_t j = 0; j < G; ++j) {
      double* seg = row + j * per;
      std::partial_sort(seg, seg + kg, seg + per, std::greater<double>());
      double sum = 0;
      for (int64_t i = 0; i < kg; ++i) sum += seg[i];
      group_score[j] = sum;
    }
    // Pick g groups, best first, ties to the lower group; picked groups are marked by NaN.
    uint64_t keep_bits[4] = {0, 0, 0, 0};  // G <= E <= 256
    for (int64_t r = 0; r < g; ++r) {
      int64_t best = -1;
      for (int64_t j = 0; j < G; ++j) {
        if (std::isnan(group_score[j])) continue;
        if (best < 0 || group_score[j] > group_score[best]) best = j;
      }
      keep_bits[best / 64] |= uint64_t(1) << (best % 64);
      group_score[best] = NAN;
    }
    for (int64_t j = 0; j < G; ++j) {
      if (keep_bits[j / 64] >> (j % 64) & 1) continue;
      for (int64_t i = 0; i < per; ++i) key[j * per + i] = -INFINITY;
    }
  }
}

// Megatron's sinkhorn(): S-BASE balancing of exp(logits) into a doubly stochastic matrix;
// training selects the top-k of the balanced matrix (no gradient through it).
template <typename T>
void Router<T>::sinkhorn_select(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_;
  double* cost = key_TE_;
  for (int64_t i = 0; i < n * E; ++i) cost[i] = std::exp(s.logits_TE[i]);
  double* d0 = sk_d0_T_;
  double* d1 = sk_d1_E_;
  double* d1_old = sk_d1_E_ + E;
  for (int64_t t = 0; t < n; ++t) d0[t] = 1.0;
  for (int64_t e = 0; e < E; ++e) d1[e] = d1_old[e] = 1.0;
  double error = 1e9;
  int iters = 0;
  while (error > kSinkhornTol) {
    MOE_CHECK(++iters <= kSinkhornMaxIters,
              "[router] sinkhorn did not converge in {} iterations (error {}): the router logits "
              "are degenerate",
              kSinkhornMaxIters, error);
    for (int64_t t = 0; t < n; ++t) {
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc += d1[e] * cost[t * E + e];
      d0[t] = (1.0 / static_cast<double>(n)) * 1.0 / (acc + kSinkhornEps);
    }
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t t = 0; t < n; ++t) acc += d0[t] * cost[t * E + e];
      d1[e] = (1.0 / static_cast<double>(E)) * 1.0 / (acc + kSinkhornEps);
    }
    error = 0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(d1_old[e] - d1[e]);
    error /= static_cast<double>(E);
    std::memcpy(d1_old, d1, sizeof(double) * E);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) cost[t * E + e] *= d1[e] * d0[t];
  }
  ops::topk(*ex_, s.routed_TK, keyv_TK_, cost, n, E, K_);
}

// Quantile balancing (MOE_SEMANTICS Router 5): idx = top-k of (l - beta); alpha_t = the
// (K+1)-th largest of l_t - beta; training estimates beta_local[e] = the (T K / E + 1)-th
// largest of column e of (l - alpha), which would give every expert exactly T K / E tokens.
template <typename T>
void Router<T>::quantile_select(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_, K1 = K_ + 1;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) key_TE_[t * E + e] = s.logits_TE[t * E + e] - beta_E_[e];
  }
  ops::topk(*ex_, keyi_TK_, keyv_TK_, key_TE_, n, E, K1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) s.routed_TK[t * K + k] = keyi_TK_[t * K1 + k];
  }
  if (!training_ || recompute_ || n == 0) return;
  const int64_t C = n * K / E;  // divisibility checked in forward
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t = 0; t < n; ++t) col_T_[t] = s.logits_TE[t * E + e] - keyv_TK_[t * K1 + K];
    std::nth_element(col_T_, col_T_ + C, col_T_ + n, std::greater<double>());
    beta_sum_E_[e] += col_T_[C];
  }
  ++beta_micro_;
}

template <typename T>
void Router<T>::compute_probs(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_;
  const bool sinkhorn = cfg_.uses(LoadBalancing::Sinkhorn);
  const bool softmax_over_k =
      !sinkhorn && cfg_.score == ScoreFunction::Softmax && !cfg_.pre_softmax;
  for (int64_t t = 0; t < n; ++t) {
    double* v = s.topv_TK + t * K;
    double* p = s.probs64_TK + t * K;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t te = t * E + s.routed_TK[t * K + k];
      if (sinkhorn && K == 1)
        v[k] = sigmoid(s.logits_TE[te]);
      else
        v[k] = softmax_over_k ? s.logits_TE[te] : s.scores_TE[te];
    }
    if (softmax_over_k) {
      double m = v[0], z = 0;  // v is in descending order of the key, not necessarily of v
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) p[k] = std::exp(v[k] - m) / z;
    } else if (sigmoid_like(cfg_.score) && K > 1) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      for (int64_t k = 0; k < K; ++k) p[k] = v[k] / (sum + kNormEps);
    } else {
      for (int64_t k = 0; k < K; ++k) p[k] = v[k];
    }
    for (int64_t k = 0; k < K; ++k) p[k] *= cfg_.topk_scaling_factor;
  }
  std::memcpy(s.idx_TK, s.routed_TK, sizeof(int32_t) * n * K);
}

// Capacity: each expert keeps at most `capacity` of its (token, slot) pairs, by prob (ties to
// the lower token) or by position; the rest become idx = -1 with prob 0.
template <typename T>
void Router<T>::apply_capacity(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_;
  s.dropped = 0;
  s.capacity = cfg_.dropless() ? 0 : cfg_.capacity(n);
  if (cfg_.dropless()) return;
  const int64_t cap = s.capacity;
  // Counting sort of the pairs by expert, token order within an expert.
  std::fill(cand_off_E_, cand_off_E_ + E + 1, 0);
  for (int64_t i = 0; i < n * K; ++i) ++cand_off_E_[s.routed_TK[i] + 1];
  for (int64_t e = 0; e < E; ++e) cand_off_E_[e + 1] += cand_off_E_[e];
  int64_t* fill = cand_off_E_ + E + 1;  // E cursors
  for (int64_t e = 0; e < E; ++e) fill[e] = cand_off_E_[e];
  for (int64_t i = 0; i < n * K; ++i) cand_N_[fill[s.routed_TK[i]]++] = static_cast<int32_t>(i);
  const double* p = s.probs64_TK;
  for (int64_t e = 0; e < E; ++e) {
    int32_t* b = cand_N_ + cand_off_E_[e];
    int32_t* end = cand_N_ + cand_off_E_[e + 1];
    if (end - b <= cap) continue;
    if (cfg_.drop_policy == TokenDropPolicy::Probs) {
      std::sort(b, end,
                [p](int32_t i, int32_t j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
    }
    for (int32_t* it = b + cap; it < end; ++it) {
      s.idx_TK[*it] = -1;
      s.probs64_TK[*it] = 0.0;
      ++s.dropped;
    }
  }
}

template <typename T>
void Router<T>::compute_losses(int64_t n) {
  RouterSaved<T>& s = saved_;
  const int64_t E = E_, K = K_, B = s.n_seq;
  const int64_t S = n / B;
  // The aux map: the experts the router chose (group limit, bias, quantile offsets included,
  // before capacity dropping), or with --moe-aux-loss-megatron-map Megatron's plain top-k of
  // the aux scores (issue #2767).
  const int32_t* map = s.routed_TK;
  if (cfg_.megatron_aux_map) {
    ops::topk(*ex_, keyi_TK_, keyv_TK_, s.aux_scores_TE, n, E, K);
    map = keyi_TK_;
  }
  std::memset(s.aux_counts_E, 0, sizeof(int64_t) * E);
  std::memset(s.aux_seq_counts_BE, 0, sizeof(int64_t) * B * E);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = map[t * K + k];
      ++s.aux_counts_E[e];
      ++s.aux_seq_counts_BE[(t % B) * E + e];
    }
  }

  for (double& v : s.lb_value) v = 0;
  s.aux_value = s.aux_loss = 0;
  bool first = true;
  for (const LoadBalancingTerm& term : terms_) {
    const int slot = lb_slot(term.type);
    if (slot < 0 || n == 0) continue;
    double value = 0;
    if (term.type == LoadBalancing::AuxLoss) {
      // E / (K T^2) * sum_i P_i N_i with P_i = sum_t a_ti.
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) {
        double psum = 0;
        for (int64_t t = 0; t < n; ++t) psum += s.aux_scores_TE[t * E + e];
        acc += psum * static_cast<double>(s.aux_counts_E[e]);
      }
      value = acc * static_cast<double>(E) / (static_cast<double>(K) * n * n);
    } else if (term.type == LoadBalancing::SeqAuxLoss) {
      // The same per sequence (tokens t = s * B + b), averaged over the B sequences.
      double acc = 0;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t e = 0; e < E; ++e) {
          double psum = 0;
          for (int64_t q = 0; q < S; ++q) psum += s.aux_scores_TE[(q * B + b) * E + e];
          acc += psum * static_cast<double>(s.aux_seq_counts_BE[b * E + e]);
        }
      }
      value = acc * static_cast<double>(E) / (static_cast<double>(K) * S * S) / B;
    } else {
      // global_aux_loss: N_i averaged over the micro-batches of the step so far (Megatron's
      // ga_steps average; the fix of #7213), normalised with this micro-batch's T.
      // A recomputing forward finds this micro-batch's counts already in the sums; the values
      // are the same doubles (the sum was stored as computed here).
      if (recompute_) {
        const double steps = static_cast<double>(global_micro_);
        for (int64_t e = 0; e < E; ++e) s.global_counts_E[e] = global_sum_E_[e] / steps;
      } else {
        const double steps = static_cast<double>(global_micro_ + 1);
        for (int64_t e = 0; e < E; ++e) {
          s.global_counts_E[e] =
              (global_sum_E_[e] + static_cast<double>(s.aux_counts_E[e])) / steps;
        }
      }
      if (training_ && !recompute_) {
        for (int64_t e = 0; e < E; ++e) global_sum_E_[e] += static_cast<double>(s.aux_counts_E[e]);
        ++global_micro_;
      }
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) {
        double psum = 0;
        for (int64_t t = 0; t < n; ++t) psum += s.aux_scores_TE[t * E + e];
        acc += psum * s.global_counts_E[e];
      }
      value = acc * static_cast<double>(E) / (static_cast<double>(K) * n * n);
    }
    s.lb_value[slot] = value;
    s.aux_loss += term.coeff * value;
    if (first) s.aux_value = value;
    first = false;
  }

  // z-loss = coeff * mean_t logsumexp(logits_t)^2.
  double acc = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double* l = s.logits_TE + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
    s.lse_T[t] = m + std::log(z);
    acc += s.lse_T[t] * s.lse_T[t];
  }
  s.z_value = n > 0 ? acc / n : 0.0;
  s.z_loss = cfg_.z_loss_coeff * s.z_value;
}

// ---------------------------------------------------------------------------------------------
// Backward

template <typename T>
void Router<T>::backward(T* dx_TH, const T* dprobs_TK, double loss_grad_scale) {
  std::memset(dlogits_TE_, 0, sizeof(double) * saved_.n_tok * E_);
  backward_probs(dlogits_TE_, dprobs_TK);
  backward_losses(dlogits_TE_, loss_grad_scale);
  gate_backward(dx_TH);
}

template <typename T>
void Router<T>::backward_probs(double* dl, const T* dprobs_TK) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, K = K_;
  const bool sinkhorn = cfg_.uses(LoadBalancing::Sinkhorn);
  const bool softmax_over_k =
      !sinkhorn && cfg_.score == ScoreFunction::Softmax && !cfg_.pre_softmax;
  // Undo the scaling factor; dropped slots carry no gradient (their prob is the constant 0).
  double* g_TK = work_TK_;
  for (int64_t i = 0; i < n * K; ++i) {
    g_TK[i] = s.idx_TK[i] >= 0 ? static_cast<double>(dprobs_TK[i]) * cfg_.topk_scaling_factor : 0;
  }
  const bool over_e_softmax =
      (sinkhorn && K > 1) || (cfg_.score == ScoreFunction::Softmax && cfg_.pre_softmax);
  if (over_e_softmax) std::memset(work_TE_, 0, sizeof(double) * n * E);
  for (int64_t t = 0; t < n; ++t) {
    const double* v = s.topv_TK + t * K;
    const double* g = g_TK + t * K;
    const int32_t* idx = s.routed_TK + t * K;
    if (softmax_over_k) {
      // p = softmax(v) over K, recomputed unscaled.
      double m = v[0], z = 0, dot = 0;
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) dot += g[k] * std::exp(v[k] - m) / z;
      for (int64_t k = 0; k < K; ++k) dl[t * E + idx[k]] += std::exp(v[k] - m) / z * (g[k] - dot);
    } else if (over_e_softmax) {
      for (int64_t k = 0; k < K; ++k) work_TE_[t * E + idx[k]] += g[k];
    } else if (sinkhorn) {  // top-1 sigmoid
      dl[t * E + idx[0]] += g[0] * v[0] * (1.0 - v[0]);
    } else {
      // Sigmoid-like: p = v / (sum v + eps) for K > 1, else v.
      double sum = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      const double den = sum + kNormEps;
      for (int64_t k = 0; k < K; ++k) dot += g[k] * v[k];
      for (int64_t k = 0; k < K; ++k) {
        const double dv = K > 1 ? g[k] / den - dot / (den * den) : g[k];
        const int64_t te = t * E + idx[k];
        dl[te] += dv * dscore_dlogit(cfg_.score, s.logits_TE[te], s.scores_TE[te]);
      }
    }
  }
  if (over_e_softmax) {
    ops::softmax_backward(*ex_, work_TE_, work_TE_, s.scores_TE, n, E);
    for (int64_t i = 0; i < n * E; ++i) dl[i] += work_TE_[i];
  }
}

template <typename T>
void Router<T>::backward_losses(double* dl, double loss_grad_scale) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, K = K_, B = s.n_seq;
  if (n == 0) return;
  const int64_t S = n / B;
  // d(sum_j coeff_j aux_j) / d a_te, then through the aux scores to the logits.
  bool any = false;
  for (const LoadBalancingTerm& term : terms_) any |= lb_slot(term.type) >= 0 && term.coeff > 0;
  if (any) {
    std::memset(work_TE_, 0, sizeof(double) * n * E);
    for (const LoadBalancingTerm& term : terms_) {
      if (lb_slot(term.type) < 0 || term.coeff == 0) continue;
      const double c =
          loss_grad_scale * term.coeff * static_cast<double>(E) / static_cast<double>(K);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t e = 0; e < E; ++e) {
          double gte;
          if (term.type == LoadBalancing::AuxLoss) {
            gte = c / (static_cast<double>(n) * n) * static_cast<double>(s.aux_counts_E[e]);
          } else if (term.type == LoadBalancing::SeqAuxLoss) {
            gte = c / (static_cast<double>(S) * S * B) *
                  static_cast<double>(s.aux_seq_counts_BE[(t % B) * E + e]);
          } else {
            gte = c / (static_cast<double>(n) * n) * s.global_counts_E[e];
          }
          work_TE_[t * E + e] += gte;
        }
      }
    }
    if (cfg_.score == ScoreFunction::Softmax) {
      ops::softmax_backward(*ex_, work_TE_, work_TE_, s.aux_scores_TE, n, E);
      for (int64_t i = 0; i < n * E; ++i) dl[i] += work_TE_[i];
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const double* sc = s.scores_TE + t * E;
        const double* g = work_TE_ + t * E;
        double sum = 0, dot = 0;
        for (int64_t e = 0; e < E; ++e) sum += sc[e];
        const double den = sum + kNormEps;
        for (int64_t e = 0; e < E; ++e) dot += g[e] * sc[e];
        for (int64_t e = 0; e < E; ++e) {
          const double ds = g[e] / den - dot / (den * den);
          dl[t * E + e] += ds * dscore_dlogit(cfg_.score, s.logits_TE[t * E + e], sc[e]);
        }
      }
    }
  }

  // z-loss: d/dlogits = coeff * 2 * lse_t * softmax(logits_t) / T.
  if (cfg_.z_loss_coeff > 0) {
    const double* sm = s.scores_TE;
    if (cfg_.score != ScoreFunction::Softmax) {
      ops::softmax_forward(*ex_, work_TE_, s.logits_TE, n, E);
      sm = work_TE_;
    }
    const double c = loss_grad_scale * cfg_.z_loss_coeff * 2.0 / static_cast<double>(n);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e) dl[t * E + e] += c * s.lse_T[t] * sm[t * E + e];
    }
  }
}

template <typename T>
void Router<T>::gate_backward(T* dx_TH) {
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok, E = E_, H = H_;
  T* dw = weight_->grad_as<T>();
  const T* w = weight_->data_as<T>();
  if (gate_f64_) {
    std::memset(dw64_EH_, 0, sizeof(double) * E * H);
    ops::linear_backward(*ex_, dx64_TH_, dw64_EH_, dlogits_TE_, x64_TH_, w64_EH_, n, E, H, false);
    for (int64_t i = 0; i < E * H; ++i) dw[i] += static_cast<T>(dw64_EH_[i]);
    for (int64_t i = 0; i < n * H; ++i) {
      const double j = s.jitter_TH ? static_cast<double>(s.jitter_TH[i]) : 1.0;
      dx_TH[i] += static_cast<T>(dx64_TH_[i] * j);
    }
    return;
  }
  for (int64_t i = 0; i < n * E; ++i) dlogits_T_TE_[i] = static_cast<T>(dlogits_TE_[i]);
  if (s.jitter_TH) {
    ops::linear_backward(*ex_, dgate_TH_, dw, dlogits_T_TE_, s.gate_in_TH, w, n, E, H, false);
    for (int64_t i = 0; i < n * H; ++i) dx_TH[i] += dgate_TH_[i] * s.jitter_TH[i];
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
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += bias_counts_E_[e];
    const double mean = sum / static_cast<double>(E);
    const float rate = static_cast<float>(cfg_.bias_update_rate);
    for (int64_t e = 0; e < E; ++e) {
      const double off = mean - bias_counts_E_[e];
      const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
      expert_bias_E_[e] = expert_bias_E_[e] + sign * rate;
    }
  }
  if (cfg_.uses(LoadBalancing::QuantileBalancing) && beta_micro_ > 0) {
    for (int64_t e = 0; e < E; ++e) beta_sum_E_[e] /= static_cast<double>(beta_micro_);
    if (sync.mean_dp_cp) sync.mean_dp_cp(beta_sum_E_, E);
    const double ema = cfg_.quantile_ema;
    double mean = 0;
    for (int64_t e = 0; e < E; ++e) {
      col_T_[e] = ema * beta_E_[e] + (1.0 - ema) * beta_sum_E_[e];
      mean += col_T_[e];
    }
    mean /= static_cast<double>(E);
    // Only differences of beta matter to the top-k; centring keeps it from drifting.
    for (int64_t e = 0; e < E; ++e) beta_E_[e] = static_cast<float>(col_T_[e] - mean);
  }
  reset_step();
  ++step_;
}

template <typename T>
void Router<T>::reset_step() {
  std::memset(bias_counts_E_, 0, sizeof(double) * E_);
  std::memset(global_sum_E_, 0, sizeof(double) * E_);
  std::memset(beta_sum_E_, 0, sizeof(double) * E_);
  global_micro_ = beta_micro_ = 0;
  micro_ = 0;
}

template <typename T>
void Router<T>::stats(RouterStats* out) const {
  const RouterSaved<T>& s = saved_;
  RouterStats& st = *out;
  st.tokens_per_expert.assign(s.tokens_per_expert_E, s.tokens_per_expert_E + E_);
  int64_t sum = 0, mx = 0;
  for (int64_t c : st.tokens_per_expert) {
    sum += c;
    mx = std::max(mx, c);
  }
  st.max_over_mean_load = sum > 0 ? static_cast<double>(mx) * E_ / static_cast<double>(sum) : 0;
  st.dropped = s.dropped;
  st.capacity = s.capacity;
  st.bias_min = st.bias_max = st.beta_min = st.beta_max = 0;
  if (cfg_.enable_expert_bias) {
    st.bias_min = *std::min_element(expert_bias_E_, expert_bias_E_ + E_);
    st.bias_max = *std::max_element(expert_bias_E_, expert_bias_E_ + E_);
  }
  if (cfg_.uses(LoadBalancing::QuantileBalancing)) {
    st.beta_min = *std::min_element(beta_E_, beta_E_ + E_);
    st.beta_max = *std::max_element(beta_E_, beta_E_ + E_);
  }
}

template class Router<float>;
template class Router<double>;

}  // namespace moecore::moe
