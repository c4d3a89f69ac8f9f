#include "data/blended_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <set>

#include "core/check.h"

namespace moecore::data {

// numpy's pairwise summation (add.reduce on a contiguous float64 array), so the normalised
// weights are numpy's to the last bit.
static double pairwise_sum(const double* a, size_t n) {
  if (n < 8) {
    double r = 0.;
    for (size_t i = 0; i < n; ++i) r += a[i];
    return r;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

std::vector<double> normalize_weights(const std::vector<double>& w) {
  MOE_CHECK(!w.empty(), "[data] no weights to normalise");
  const double sum = pairwise_sum(w.data(), w.size());
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / sum;
  return out;
}

BlendingIndices build_blending_indices(const std::vector<double>& weights, int64_t size) {
  const size_t n = weights.size();
  MOE_CHECK(n >= 1 && n < 32767, "[data] {} datasets to blend (1 to 32766)", n);
  BlendingIndices out;
  out.dataset_index.resize(static_cast<size_t>(size));
  out.dataset_sample_index.resize(static_cast<size_t>(size));
  std::vector<int64_t> current(n, 0);
  for (int64_t i = 0; i < size; ++i) {
    const double at = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_error = weights[0] * at - static_cast<double>(current[0]);
    for (size_t d = 1; d < n; ++d) {
      const double error = weights[d] * at - static_cast<double>(current[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    out.dataset_index[i] = static_cast<int16_t>(best);
    out.dataset_sample_index[i] = current[best]++;
  }
  return out;
}

BlendingIndices build_exhaustive_blending_indices(const std::vector<int64_t>& sizes) {
  const size_t n = sizes.size();
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  std::vector<double> weights(n);
  for (size_t i = 0; i < n; ++i) weights[i] = static_cast<double>(sizes[i]) / static_cast<double>(total);
  std::vector<int64_t> counts(n, 0);
  std::set<size_t> unspent;
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] > 0) unspent.insert(i);
  }
  BlendingIndices out;
  out.dataset_index.reserve(static_cast<size_t>(total));
  out.dataset_sample_index.reserve(static_cast<size_t>(total));
  for (int64_t i = 0; !unspent.empty(); ++i) {
    const double at = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_error = std::numeric_limits<double>::lowest();
    for (size_t d : unspent) {
      const double error = weights[d] * at - static_cast<double>(counts[d]);
      if (error > best_error) {
        best = d;
        best_error = error;
      }
    }
    out.dataset_index.push_back(static_cast<int16_t>(best));
    out.dataset_sample_index.push_back(counts[best]++);
    if (counts[best] == sizes[best]) unspent.erase(best);
  }
  return out;
}

BlendedDataset::BlendedDataset(std::vector<std::unique_ptr<TokenSource>> datasets,
                               std::vector<double> weights, int64_t size)
    : datasets_(std::move(datasets)), weights_(std::move(weights)) {
  MOE_CHECK(!datasets_.empty() && datasets_.size() == weights_.size(),
            "[data] {} datasets and {} weights to blend", datasets_.size(), weights_.size());
  if (size < 0) {
    std::vector<int64_t> sizes;
    for (const auto& d : datasets_) sizes.push_back(d->num_samples());
    idx_ = build_exhaustive_blending_indices(sizes);
  } else {
    idx_ = build_blending_indices(weights_, size);
  }
  // Megatron's check: no dataset is asked for more samples than it has.
  std::vector<int64_t> used(datasets_.size(), 0);
  for (int16_t d : idx_.dataset_index) ++used[d];
  for (size_t d = 0; d < datasets_.size(); ++d) {
    MOE_CHECK(datasets_[d]->num_samples() < 0 || used[d] <= datasets_[d]->num_samples(),
              "[data] the blend draws {} samples from dataset {} ({}), which has {}", used[d], d,
              datasets_[d]->describe(), datasets_[d]->num_samples());
  }
}

int64_t BlendedDataset::vocab() const {
  int64_t v = 0;
  for (const auto& d : datasets_) v = std::max(v, d->vocab());
  return v;
}

void BlendedDataset::sample(int32_t* tokens, int64_t len, uint64_t index) const {
  MOE_CHECK(index < idx_.dataset_index.size(), "[data] blended sample {} of {}", index,
            idx_.dataset_index.size());
  datasets_[idx_.dataset_index[index]]->sample(tokens, len,
                                               static_cast<uint64_t>(idx_.dataset_sample_index[index]));
}

std::string BlendedDataset::describe() const {
  std::string s = fmt::format("blend of {} datasets, {} samples:", datasets_.size(), num_samples());
  for (size_t d = 0; d < datasets_.size(); ++d) {
    s += fmt::format("\n  weight {:.6g}: {}", weights_[d], datasets_[d]->describe());
  }
  return s;
}

}  // namespace moecore::data
