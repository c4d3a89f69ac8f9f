// A synthetic language with a known entropy rate: a random sparse first-order Markov chain over
// the vocabulary (each token has `branching` successors with Dirichlet(1) weights), started in
// its stationary distribution. The best achievable next-token loss is exactly the entropy rate
// sum_s pi(s) H(P(.|s)), which the trainer prints as the floor. Sample i of the stream is a pure
// function of (seed, i), so every data-parallel layout sees the same global batch.
#pragma once

#include <cstdint>
#include <vector>

#include "data/token_source.h"

namespace moecore::data {

class SyntheticLanguage final : public TokenSource {
 public:
  SyntheticLanguage(int64_t vocab, int64_t branching, uint64_t seed);

  double entropy_rate() const { return entropy_rate_; }  // nats per token
  double entropy_floor() const override { return entropy_rate_; }
  int64_t vocab() const override { return V_; }
  void sample(int32_t* tokens, int64_t len, uint64_t index) const override;
  std::string describe() const override;
  // Transition probability P(next | prev), for tests.
  double transition(int32_t prev, int32_t next) const;

 private:
  int64_t V_, branching_;
  uint64_t key_;
  std::vector<int32_t> succ_;    // [V, branching]
  std::vector<double> cdf_;      // [V, branching] cumulative transition probabilities
  std::vector<double> pi_cdf_;   // [V] cumulative stationary distribution
  double entropy_rate_ = 0;
};

}  // namespace moecore::data
