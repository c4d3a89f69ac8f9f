// Megatron's BlendedDataset: samples drawn from several datasets in proportion to weights by
// the greedy rule of helpers.cpp build_blending_indices (sample i goes to the dataset whose
// count lags its share weight * max(i, 1) the most, the first on ties), so the blend is a pure
// function of the weights and the size, identical to Megatron's. Weights of None (a plain list
// of prefixes) blend each dataset's one epoch exhaustively (build_exhaustive_blending_indices).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_source.h"

namespace moecore::data {

struct BlendingIndices {
  std::vector<int16_t> dataset_index;         // [size]
  std::vector<int64_t> dataset_sample_index;  // [size]
};

// weights normalised (sum 1).
BlendingIndices build_blending_indices(const std::vector<double>& weights, int64_t size);
// Exactly sizes[i] samples of dataset i.
BlendingIndices build_exhaustive_blending_indices(const std::vector<int64_t>& sizes);

// Megatron's utils.normalize: w / sum(w) in float64.
std::vector<double> normalize_weights(const std::vector<double>& w);

class BlendedDataset final : public TokenSource {
 public:
  // weights normalised; size < 0: exhaustive over the datasets' num_samples().
  BlendedDataset(std::vector<std::unique_ptr<TokenSource>> datasets, std::vector<double> weights,
                 int64_t size);

  int64_t vocab() const override;
  void sample(int32_t* tokens, int64_t len, uint64_t index) const override;
  std::string describe() const override;
  int64_t num_samples() const override { return static_cast<int64_t>(idx_.dataset_index.size()); }
  const BlendingIndices& indices() const { return idx_; }
  const TokenSource& dataset(int i) const { return *datasets_[i]; }
  int num_datasets() const { return static_cast<int>(datasets_.size()); }

 private:
  std::vector<std::unique_ptr<TokenSource>> datasets_;
  std::vector<double> weights_;
  BlendingIndices idx_;
};

}  // namespace moecore::data
