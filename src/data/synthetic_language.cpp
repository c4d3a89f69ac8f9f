#include "data/synthetic_language.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/check.h"
#include "core/rng.h"

namespace moecore::data {

static int64_t pick(const double* cdf, int64_t n, double u) {
  int64_t i = std::upper_bound(cdf, cdf + n, u) - cdf;
  return std::min(i, n - 1);
}

SyntheticLanguage::SyntheticLanguage(int64_t vocab, int64_t branching, uint64_t seed)
    : V_(vocab), branching_(branching), key_(rng_key(seed, "data.synthetic_language")) {
  MOE_CHECK(vocab >= 2 && branching >= 1 && branching <= vocab,
            "[data] synthetic language needs 1 <= branching={} <= vocab={} and vocab >= 2",
            branching, vocab);
  succ_.resize(V_ * branching_);
  cdf_.resize(V_ * branching_);
  const uint64_t build_key = rng_key(seed, "data.synthetic_language.transitions");
  std::vector<double> w(branching_);
  std::vector<double> entropy(V_);
  for (int64_t s = 0; s < V_; ++s) {
    // Distinct successors by rejection; Dirichlet(1) weights from exponentials.
    int64_t draw = 0;
    for (int64_t j = 0; j < branching_; ++j) {
      int32_t cand;
      do {
        cand = static_cast<int32_t>(rng_uniform(build_key, s * 1000003ull + draw++, 0) * V_);
      } while (std::find(&succ_[s * branching_], &succ_[s * branching_] + j, cand) !=
               &succ_[s * branching_] + j);
      succ_[s * branching_ + j] = cand;
      w[j] = -std::log(rng_uniform(build_key, s * 1000003ull + j, 1));
    }
    double sum = 0;
    for (double x : w) sum += x;
    double acc = 0, h = 0;
    for (int64_t j = 0; j < branching_; ++j) {
      double p = w[j] / sum;
      acc += p;
      cdf_[s * branching_ + j] = acc;
      h -= p * std::log(p);
    }
    entropy[s] = h;
  }
  // Stationary distribution by lazy power iteration (converges for periodic chains too).
  std::vector<double> pi(V_, 1.0 / V_), next(V_);
  for (int it = 0; it < 5000; ++it) {
    std::fill(next.begin(), next.end(), 0.0);
    for (int64_t s = 0; s < V_; ++s) {
      double prev = 0;
      for (int64_t j = 0; j < branching_; ++j) {
        double p = cdf_[s * branching_ + j] - prev;
        prev = cdf_[s * branching_ + j];
        next[succ_[s * branching_ + j]] += pi[s] * p;
      }
    }
    double diff = 0;
    for (int64_t s = 0; s < V_; ++s) {
      double v = 0.5 * pi[s] + 0.5 * next[s];
      diff += std::abs(v - pi[s]);
      pi[s] = v;
    }
    if (diff < 1e-13) break;
  }
  pi_cdf_.resize(V_);
  double acc = 0;
  for (int64_t s = 0; s < V_; ++s) {
    acc += pi[s];
    pi_cdf_[s] = acc;
    entropy_rate_ += pi[s] * entropy[s];
  }
  for (double& c : pi_cdf_) c /= acc;
}

double SyntheticLanguage::transition(int32_t prev, int32_t next) const {
  double before = 0;
  for (int64_t j = 0; j < branching_; ++j) {
    double c = cdf_[prev * branching_ + j];
    if (succ_[prev * branching_ + j] == next) return c - before;
    before = c;
  }
  return 0.0;
}

void SyntheticLanguage::sample(int32_t* tokens, int64_t len, uint64_t index) const {
  if (len <= 0) return;
  // One uniform per (sample, position): counter = index, lane = position.
  tokens[0] = static_cast<int32_t>(pick(pi_cdf_.data(), V_, rng_uniform(key_, index, 0)));
  for (int64_t t = 1; t < len; ++t) {
    const int64_t s = tokens[t - 1];
    double u = rng_uniform(key_, index, static_cast<uint32_t>(t));
    tokens[t] = succ_[s * branching_ + pick(&cdf_[s * branching_], branching_, u)];
  }
}

std::string SyntheticLanguage::describe() const {
  return fmt::format("synthetic Markov language (vocab {}, {} successors per token, entropy "
                     "rate {:.4f} nats/token)",
                     V_, branching_, entropy_rate_);
}

}  // namespace moecore::data
