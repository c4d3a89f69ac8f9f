// A synthetic language with a known entropy rate: a random sparse first-order Markov chain over
// the vocabulary (each token has `branching` successors with Dirichlet(1) weights), started in
// its stationary distribution. The best achievable next-token loss is exactly the entropy rate
// sum_s pi(s) H(P(.|s)), which the trainer prints as the floor. Sample i of the stream is a pure
// function of (seed, i), so every data-parallel layout sees the same global batch.
#pragma once

#include <cstdint>
#include <vector>

namespace moecore::data {

class SyntheticLanguage {
 public:
  SyntheticLanguage(int64_t vocab, int64_t branching, uint64_t seed);

  double entropy_rate() const { return entropy_rate_; }  // nats per token
  int64_t vocab() const { return V_; }
  // Tokens of sample `index` (len tokens).
  void sample(int32_t* tokens, int64_t len, uint64_t index) const;
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

// Fills ids/targets [n_samples, S] with samples first_index, first_index + 1, ...: ids are
// tokens [0, S), targets tokens [1, S].
void synthetic_batch(const SyntheticLanguage& lang, int32_t* ids_BS, int32_t* targets_BS,
                     int64_t n_samples, int64_t S, uint64_t first_index, int32_t* scratch_S1);

}  // namespace moecore::data
