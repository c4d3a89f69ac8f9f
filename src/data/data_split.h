// Megatron's --split: "969, 30, 1" -> normalised ratios -> book-ends per split (a zero share is
// no split at all) -> the range of documents each split takes, rounded as Python's round()
// (half to even).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace moecore::data {

enum class Split { Train = 0, Valid = 1, Test = 2 };
inline constexpr int kNumSplits = 3;
const char* split_name(Split s);  // "train", "valid", "test" (Megatron's Split enum names)

using SplitMatrix = std::array<std::optional<std::pair<double, double>>, kNumSplits>;

// parse_and_normalize_split: every number in the string, padded with zeros to three, >= 0,
// divided by their sum.
std::array<double, kNumSplits> parse_split(const std::string& split);
SplitMatrix split_matrix(const std::array<double, kNumSplits>& ratios);
// [begin, end) of the num_elements documents that split `s` exposes; nullopt: no such split.
std::optional<std::pair<int64_t, int64_t>> split_range(const SplitMatrix& m, Split s,
                                                       int64_t num_elements);

}  // namespace moecore::data
