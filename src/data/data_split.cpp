#include "data/data_split.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <vector>

#include "core/check.h"

namespace moecore::data {

const char* split_name(Split s) {
  switch (s) {
    case Split::Train: return "train";
    case Split::Valid: return "valid";
    case Split::Test: return "test";
  }
  return "?";
}

std::array<double, kNumSplits> parse_split(const std::string& split) {
  // Megatron: re.findall(r"[.0-9]+", split), then float(). Here every piece between the
  // separators must be such a number: Megatron's regex would read "-1,2,0" as 1,2,0 and skip
  // "nan" or "a" without a word.
  std::vector<double> v;
  const std::regex number("[.0-9]+");
  const std::regex piece("[^,/:\\s]+");
  for (auto it = std::sregex_iterator(split.begin(), split.end(), piece);
       it != std::sregex_iterator(); ++it) {
    const std::string s = it->str();
    char* end = nullptr;
    const double x = std::strtod(s.c_str(), &end);
    MOE_CHECK(std::regex_match(s, number) && end != nullptr && *end == '\0' && std::isfinite(x),
              "[data] --split '{}': '{}' is not a number: --split takes the train, valid, test "
              "proportions as non-negative numbers separated by commas, e.g. --split 969,30,1",
              split, s);
    v.push_back(x);
  }
  MOE_CHECK(v.size() <= kNumSplits,
            "[data] --split '{}' has {} numbers; give at most three (train, valid, test)", split,
            v.size());
  v.resize(kNumSplits, 0.0);
  double sum = 0;
  for (double x : v) sum += x;
  MOE_CHECK(sum > 0, "[data] --split '{}' sums to 0: give the train, valid, test proportions, "
                     "e.g. --split 99,1,0", split);
  std::array<double, kNumSplits> out{};
  for (int i = 0; i < kNumSplits; ++i) out[i] = v[i] / sum;
  return out;
}

SplitMatrix split_matrix(const std::array<double, kNumSplits>& ratios) {
  // convert_split_vector_to_split_matrix with one vector: cumulative book-ends, and a split whose
  // book-ends coincide is None.
  std::array<double, kNumSplits + 1> ends{};
  for (int i = 0; i < kNumSplits; ++i) ends[i + 1] = ends[i] + ratios[i];
  SplitMatrix m;
  for (int i = 0; i < kNumSplits; ++i) {
    if (ends[i + 1] > ends[i]) m[i] = std::make_pair(ends[i], ends[i + 1]);
  }
  return m;
}

std::optional<std::pair<int64_t, int64_t>> split_range(const SplitMatrix& m, Split s,
                                                       int64_t num_elements) {
  const auto& e = m[static_cast<int>(s)];
  if (!e) return std::nullopt;
  // int(round(x)) in Python rounds half to even: nearbyint in the default rounding mode.
  const auto begin = static_cast<int64_t>(std::nearbyint(e->first * static_cast<double>(num_elements)));
  const auto end = static_cast<int64_t>(std::nearbyint(e->second * static_cast<double>(num_elements)));
  return std::make_pair(begin, end);
}

}  // namespace moecore::data
