#include "data/data_pipeline.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "core/check.h"
#include "data/blended_dataset.h"
#include "data/byte_text_dataset.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/mapped_file.h"
#include "data/mock_gpt_dataset.h"

namespace moecore::data {

namespace {

bool parse_weight(const std::string& s, double* out) {
  // Python's float(): surrounding whitespace allowed, the whole string a number.
  const char* b = s.c_str();
  char* end = nullptr;
  const double v = std::strtod(b, &end);
  if (end == b) return false;
  while (*end == ' ' || *end == '\t' || *end == '\n') ++end;
  if (*end != '\0') return false;
  *out = v;
  return true;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<BlendEntry> parse_blend(const std::vector<std::string>& items, bool* has_weights) {
  MOE_CHECK(!items.empty(), "[data] --data-path needs at least one prefix");
  std::vector<BlendEntry> out;
  *has_weights = false;
  if (items.size() % 2 == 0) {
    bool all = true;
    for (size_t i = 0; i < items.size(); i += 2) {
      double w = 0;
      if (!parse_weight(items[i], &w)) all = false;
      else out.push_back(BlendEntry{items[i + 1], w});
    }
    if (all) {
      *has_weights = true;
      for (auto& e : out) {
        MOE_CHECK(e.weight > 0 && std::isfinite(e.weight),
                  "[data] --data-path weight {} for '{}' must be a positive number", e.weight,
                  e.prefix);
      }
    } else {
      out.clear();
    }
  }
  if (!*has_weights) {
    for (const std::string& p : items) out.push_back(BlendEntry{p, 0});
  }
  for (auto& e : out) {
    // Megatron strips the prefixes.
    const size_t b = e.prefix.find_first_not_of(" \t\n"), l = e.prefix.find_last_not_of(" \t\n");
    e.prefix = b == std::string::npos ? std::string() : e.prefix.substr(b, l - b + 1);
    MOE_CHECK(!e.prefix.empty(), "[data] --data-path has an empty prefix");
  }
  return out;
}

DataPathKind classify_data_path(const std::string& path) {
  const std::string idx = path + ".idx", bin = path + ".bin";
  const std::string idx_why = unreadable_reason(idx), bin_why = unreadable_reason(bin);
  if (idx_why != "does not exist" || bin_why != "does not exist") {
    // A prefix: IndexedDataset names whichever half cannot serve.
    MOE_CHECK(idx_why != "does not exist",
              "[data] --data-path prefix '{}': '{}' exists but its index '{}' does not", path, bin,
              idx);
    return DataPathKind::IndexedPrefix;
  }
  for (const char* ext : {".idx", ".bin"}) {
    if (ends_with(path, ext) && is_regular_file(path)) {
      MOE_FAIL("[data] --data-path '{}': give the prefix without the extension, '{}'", path,
               path.substr(0, path.size() - 4));
    }
  }
  const std::string why = unreadable_reason(path);
  MOE_CHECK(why.empty(),
            "[data] --data-path '{}' {}: give the prefix of a .bin/.idx pair (neither '{}' nor "
            "'{}' exists) or a plain text file",
            path, why, idx, bin);
  return DataPathKind::TextFile;
}

namespace {

// Megatron's _get_size_per_split_per_dataset.
int64_t size_for(double weight, int64_t target, double surplus) {
  return static_cast<int64_t>(std::ceil(std::ceil(static_cast<double>(target) * weight) * (1 + surplus)));
}

std::unique_ptr<TokenSource> gpt_split(const std::shared_ptr<const LowLevelDataset>& data,
                                       Split s, int64_t num_samples, const GPTDatasetConfig& cfg,
                                       std::vector<std::string>& notes) {
  const SplitMatrix m = split_matrix(parse_split(cfg.split));
  const auto range = split_range(m, s, data->num_sequences());
  if (!range) return nullptr;
  if (range->second <= range->first && s != Split::Train) {
    notes.push_back(fmt::format("[data] '{}': the {} split of --split '{}' gets none of its {} "
                                "sequences, so there is no {} data",
                                data->name(), split_name(s), cfg.split, data->num_sequences(),
                                split_name(s)));
    return nullptr;
  }
  return std::make_unique<GPTDataset>(data, s, num_samples, cfg);
}

}  // namespace

DataSplits build_data_splits(const DataConfig& cfg, int64_t seq_length, uint32_t seed,
                             const std::array<int64_t, kNumSplits>& num_samples, int64_t vocab,
                             int64_t eod) {
  DataSplits out;
  GPTDatasetConfig g;
  g.seq_length = seq_length;
  g.seed = seed;
  g.split = cfg.split.empty() ? kDefaultSplit : cfg.split;
  g.cache_path = cfg.data_cache_path;
  g.vocab = vocab;
  if (cfg.mock_data) {
    // Megatron: mock data is split "1,1,1" and never cached.
    auto mock = std::make_shared<const MockGPTLowLevelDataset>(vocab, eod);
    g.split = "1,1,1";
    g.cache_path.clear();
    g.class_name = "MockGPTDataset";
    for (int s = 0; s < kNumSplits; ++s) {
      out.split[s] = gpt_split(mock, static_cast<Split>(s), num_samples[s], g, out.notes);
    }
    return out;
  }
  bool has_weights = false;
  const std::vector<BlendEntry> blend = parse_blend(cfg.data_path, &has_weights);
  if (blend.size() == 1 && !has_weights &&
      classify_data_path(blend[0].prefix) == DataPathKind::TextFile) {
    out.split[0] = std::make_unique<ByteTextDataset>(blend[0].prefix, seq_length, seed);
    out.notes.push_back(fmt::format("[data] '{}' is a plain text file: byte-level, every window "
                                    "trains (no validation or test split)",
                                    blend[0].prefix));
    return out;
  }
  std::vector<std::shared_ptr<const LowLevelDataset>> datasets;
  for (const BlendEntry& e : blend) {
    MOE_CHECK(classify_data_path(e.prefix) == DataPathKind::IndexedPrefix,
              "[data] --data-path '{}' is a text file; blends take .bin/.idx prefixes (make one "
              "with `moecore preprocess`)",
              e.prefix);
    datasets.push_back(std::make_shared<const IndexedDataset>(e.prefix));
  }
  if (datasets.size() == 1 && !has_weights) {
    for (int s = 0; s < kNumSplits; ++s) {
      out.split[s] = gpt_split(datasets[0], static_cast<Split>(s), num_samples[s], g, out.notes);
    }
    return out;
  }
  std::vector<double> weights;
  if (has_weights) {
    for (const BlendEntry& e : blend) weights.push_back(e.weight);
    weights = normalize_weights(weights);
  }
  constexpr double kSurplus = 0.005;  // Megatron's mid_level_dataset_surplus
  for (int s = 0; s < kNumSplits; ++s) {
    std::vector<std::unique_ptr<TokenSource>> parts;
    std::vector<double> w;
    int64_t size = 0;
    bool any_missing = false;
    for (size_t d = 0; d < datasets.size(); ++d) {
      const int64_t n = has_weights ? size_for(weights[d], num_samples[s], kSurplus) : -1;
      auto part = gpt_split(datasets[d], static_cast<Split>(s), n, g, out.notes);
      if (!part) {
        any_missing = true;
        continue;
      }
      if (has_weights) {
        size += size_for(weights[d], num_samples[s], 0.0);
        w.push_back(weights[d]);
      } else {
        w.push_back(static_cast<double>(part->num_samples()));
      }
      parts.push_back(std::move(part));
    }
    if (parts.empty()) continue;
    MOE_CHECK(!any_missing,
              "[data] the {} split is empty in some but not all of the blended datasets: give "
              "each dataset enough sequences for --split '{}'",
              split_name(static_cast<Split>(s)), g.split);
    if (!has_weights) {
      // Blend by the datasets' sizes, at most the requested samples.
      int64_t total = 0;
      for (double x : w) total += static_cast<int64_t>(x);
      size = std::min(num_samples[s], total);
      w = normalize_weights(w);
    }
    out.split[s] = std::make_unique<BlendedDataset>(std::move(parts), w, size);
  }
  return out;
}

}  // namespace moecore::data
