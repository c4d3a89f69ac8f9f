#include "moe/router.h"

#include <cmath>
#include <cstring>

#include "ops/gemm.h"
#include "ops/softmax_topk.h"

namespace moecore::moe {

// Sigmoid scores are normalised with this epsilon (Megatron's value) before use.
constexpr double kSigmoidNormEps = 1e-20;

template <typename T>
Router<T>::Router(const RouterConfig& cfg, int64_t hidden, double init_std, ParamRegistry& params,
                  const std::string& prefix)
    : cfg_(cfg), H_(hidden) {
  cfg_.validate();
  weight_ = &params.add(ParamSpec{prefix + ".router.weight", {cfg.num_experts, hidden},
                                  ParamInit::Normal, init_std, ParamKind::Dense, true, {}});
}

template <typename T>
void Router<T>::allocate(Arena& a, int64_t max_tokens) {
  const int64_t E = cfg_.num_experts, K = cfg_.topk;
  saved_.logits_TE = a.alloc<T>(max_tokens * E, "router.logits");
  saved_.scores_TE = a.alloc<T>(max_tokens * E, "router.scores");
  saved_.aux_scores_TE = a.alloc<T>(max_tokens * E, "router.aux_scores");
  saved_.topv_TK = a.alloc<T>(max_tokens * K, "router.topv");
  saved_.idx_TK = a.alloc<int32_t>(max_tokens * K, "router.idx");
  saved_.probs_TK = a.alloc<T>(max_tokens * K, "router.probs");
  saved_.tokens_per_expert_E = a.alloc<int64_t>(E, "router.tokens_per_expert");
  saved_.lse_T = a.alloc<T>(max_tokens, "router.lse");
  dlogits_TE_ = a.alloc<T>(max_tokens * E, "router.dlogits", MemKind::Workspace);
  work_TE_ = a.alloc<T>(max_tokens * E, "router.work", MemKind::Workspace);
  work_TK_ = a.alloc<T>(max_tokens * K, "router.work_k", MemKind::Workspace);
}

template <typename T>
void Router<T>::forward(const T* x_TH, int64_t n_tok) {
  const int64_t E = cfg_.num_experts, K = cfg_.topk;
  RouterSaved<T>& s = saved_;
  s.x_TH = x_TH;
  s.n_tok = n_tok;
  const T* w = weight_->data_as<T>();
  ops::linear_forward(s.logits_TE, x_TH, w, n_tok, E, H_);

  // Scores over all experts: softmax for the softmax modes (needed for pre-softmax selection
  // and for the aux loss), sigmoid otherwise.
  if (cfg_.score == ScoreFunction::Softmax) {
    ops::softmax_forward(s.scores_TE, s.logits_TE, n_tok, E);
    std::memcpy(s.aux_scores_TE, s.scores_TE, sizeof(T) * n_tok * E);
  } else {
    for (int64_t t = 0; t < n_tok; ++t) {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        T v = T(1) / (T(1) + std::exp(-s.logits_TE[t * E + e]));
        s.scores_TE[t * E + e] = v;
        sum += v;
      }
      for (int64_t e = 0; e < E; ++e) {
        s.aux_scores_TE[t * E + e] = static_cast<T>(s.scores_TE[t * E + e] / (sum + kSigmoidNormEps));
      }
    }
  }

  // Selection and the probabilities the experts apply.
  if (cfg_.score == ScoreFunction::Softmax && !cfg_.pre_softmax) {
    ops::topk(s.idx_TK, s.topv_TK, s.logits_TE, n_tok, E, K);
    ops::softmax_forward(s.probs_TK, s.topv_TK, n_tok, K);
  } else {
    ops::topk(s.idx_TK, s.topv_TK, s.scores_TE, n_tok, E, K);
    for (int64_t t = 0; t < n_tok; ++t) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += s.topv_TK[t * K + k];
      bool normalise = cfg_.score == ScoreFunction::Sigmoid && K > 1;
      for (int64_t k = 0; k < K; ++k) {
        double v = s.topv_TK[t * K + k];
        s.probs_TK[t * K + k] = static_cast<T>(normalise ? v / (sum + kSigmoidNormEps) : v);
      }
    }
  }
  if (cfg_.topk_scaling_factor != 1.0) {
    for (int64_t i = 0; i < n_tok * K; ++i) {
      s.probs_TK[i] = static_cast<T>(s.probs_TK[i] * cfg_.topk_scaling_factor);
    }
  }

  std::memset(s.tokens_per_expert_E, 0, sizeof(int64_t) * E);
  for (int64_t i = 0; i < n_tok * K; ++i) ++s.tokens_per_expert_E[s.idx_TK[i]];

  // Switch aux loss over the map the tokens really took (not Megatron's plain top-k map,
  // which ignores group limits and the expert bias; Megatron issue #2767):
  //   aux = E / (K T^2) * sum_i (sum_t a_ti) N_i, exactly 1 for uniform routing.
  s.aux_value = 0;
  s.aux_loss = 0;
  if (cfg_.load_balancing == LoadBalancing::AuxLoss && n_tok > 0) {
    double acc = 0;
    for (int64_t e = 0; e < E; ++e) {
      double psum = 0;
      for (int64_t t = 0; t < n_tok; ++t) psum += s.aux_scores_TE[t * E + e];
      acc += psum * static_cast<double>(s.tokens_per_expert_E[e]);
    }
    s.aux_value = acc * E / (static_cast<double>(K) * n_tok * n_tok);
    s.aux_loss = cfg_.aux_loss_coeff * s.aux_value;
  }

  // z-loss = coeff * mean_t logsumexp(logits_t)^2.
  s.z_loss = 0;
  if (cfg_.z_loss_coeff > 0 && n_tok > 0) {
    double acc = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
      double m = -INFINITY;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(s.logits_TE[t * E + e]));
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(s.logits_TE[t * E + e] - m);
      double lse = m + std::log(z);
      s.lse_T[t] = static_cast<T>(lse);
      acc += lse * lse;
    }
    s.z_loss = cfg_.z_loss_coeff * acc / n_tok;
  }
}

template <typename T>
void Router<T>::backward(T* dx_TH, const T* dprobs_TK, double loss_grad_scale) {
  const int64_t E = cfg_.num_experts, K = cfg_.topk;
  const RouterSaved<T>& s = saved_;
  const int64_t n = s.n_tok;
  std::memset(dlogits_TE_, 0, sizeof(T) * n * E);

  // Undo the scaling factor, then the probability normalisation, onto the selected values.
  for (int64_t i = 0; i < n * K; ++i) {
    work_TK_[i] = static_cast<T>(dprobs_TK[i] * cfg_.topk_scaling_factor);
  }
  if (cfg_.score == ScoreFunction::Softmax && !cfg_.pre_softmax) {
    // probs = softmax(topv) over K; recover it unscaled from the selected logits.
    ops::softmax_forward(work_TE_, s.topv_TK, n, K);
    ops::softmax_backward(work_TK_, work_TK_, work_TE_, n, K);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < K; ++k) dlogits_TE_[t * E + s.idx_TK[t * K + k]] += work_TK_[t * K + k];
    }
  } else {
    // dscores at the selected experts.
    std::memset(work_TE_, 0, sizeof(T) * n * E);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = s.topv_TK + t * K;
      const T* g = work_TK_ + t * K;
      if (cfg_.score == ScoreFunction::Sigmoid && K > 1) {
        double sum = 0, dot = 0;
        for (int64_t k = 0; k < K; ++k) sum += v[k];
        double den = sum + kSigmoidNormEps;
        for (int64_t k = 0; k < K; ++k) dot += g[k] * v[k];
        for (int64_t k = 0; k < K; ++k) {
          work_TE_[t * E + s.idx_TK[t * K + k]] += static_cast<T>(g[k] / den - dot / (den * den));
        }
      } else {
        for (int64_t k = 0; k < K; ++k) work_TE_[t * E + s.idx_TK[t * K + k]] += g[k];
      }
    }
    if (cfg_.score == ScoreFunction::Softmax) {
      ops::softmax_backward(work_TE_, work_TE_, s.scores_TE, n, E);
      for (int64_t i = 0; i < n * E; ++i) dlogits_TE_[i] += work_TE_[i];
    } else {
      for (int64_t i = 0; i < n * E; ++i) {
        dlogits_TE_[i] += work_TE_[i] * s.scores_TE[i] * (T(1) - s.scores_TE[i]);
      }
    }
  }

  // Aux loss: d aux / d a_ti = coeff * E / (K T^2) * N_i, through the aux scores to the logits.
  if (cfg_.load_balancing == LoadBalancing::AuxLoss && cfg_.aux_loss_coeff > 0 && n > 0) {
    double c = loss_grad_scale * cfg_.aux_loss_coeff * E / (static_cast<double>(K) * n * n);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        work_TE_[t * E + e] = static_cast<T>(c * s.tokens_per_expert_E[e]);
      }
    }
    if (cfg_.score == ScoreFunction::Softmax) {
      ops::softmax_backward(work_TE_, work_TE_, s.aux_scores_TE, n, E);
      for (int64_t i = 0; i < n * E; ++i) dlogits_TE_[i] += work_TE_[i];
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const T* sc = s.scores_TE + t * E;
        const T* g = work_TE_ + t * E;
        double sum = 0, dot = 0;
        for (int64_t e = 0; e < E; ++e) sum += sc[e];
        double den = sum + kSigmoidNormEps;
        for (int64_t e = 0; e < E; ++e) dot += g[e] * sc[e];
        for (int64_t e = 0; e < E; ++e) {
          double ds = g[e] / den - dot / (den * den);
          dlogits_TE_[t * E + e] += static_cast<T>(ds * sc[e] * (1.0 - sc[e]));
        }
      }
    }
  }

  // z-loss: d/dlogits = coeff * 2 * lse_t * softmax(logits_t) / T.
  if (cfg_.z_loss_coeff > 0 && n > 0) {
    ops::softmax_forward(work_TE_, s.logits_TE, n, E);
    double c = loss_grad_scale * cfg_.z_loss_coeff * 2.0 / n;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        dlogits_TE_[t * E + e] += static_cast<T>(c * s.lse_T[t] * work_TE_[t * E + e]);
      }
    }
  }

  ops::linear_backward(dx_TH, weight_->grad_as<T>(), dlogits_TE_, s.x_TH, weight_->data_as<T>(), n,
                       E, H_, /*accumulate_dx=*/true);
}

template class Router<float>;
template class Router<double>;

}  // namespace moecore::moe
