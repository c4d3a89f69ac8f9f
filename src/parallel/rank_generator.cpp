// Masked orthogonal rank groups over a mixed-radix rank numbering.
#include "parallel/rank_generator.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::parallel {
namespace {

std::vector<std::string> split_dims(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find('-', start);
    if (end == std::string_view::npos) end = s.size();
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

RankGenerator::RankGenerator(int tp, int cp, int ep, int dp, int pp, std::string_view order) {
  const std::vector<std::pair<std::string, int>> dims = {
      {"tp", tp}, {"cp", cp}, {"ep", ep}, {"dp", dp}, {"pp", pp}};
  for (const std::string& name : split_dims(order)) {
    auto it = std::find_if(dims.begin(), dims.end(), [&](auto& d) { return d.first == name; });
    MOE_CHECK(it != dims.end(),
              "[parallel] order '{}' has unknown dimension '{}' (known: tp, cp, ep, dp, pp)",
              order, name);
    MOE_CHECK(std::find(names_.begin(), names_.end(), name) == names_.end(),
              "[parallel] order '{}' repeats dimension '{}'", order, name);
    names_.push_back(name);
    sizes_.push_back(it->second);
  }
  for (const auto& [name, size] : dims) {
    if (std::find(names_.begin(), names_.end(), name) != names_.end()) continue;
    MOE_CHECK(size == 1, "[parallel] order '{}' lacks dimension '{}' whose size is {} (not 1)",
              order, name, size);
    names_.push_back(name);
    sizes_.push_back(1);
  }
  order_.clear();
  for (size_t i = 0; i < names_.size(); ++i) {
    if (i) order_ += '-';
    order_ += names_[i];
  }
  world_size_ = 1;
  for (int s : sizes_) {
    MOE_CHECK(s >= 1, "[parallel] dimension size {} must be >= 1 (order '{}')", s, order_);
    world_size_ *= s;
  }
}

RankLists RankGenerator::ranks(std::string_view dims) const {
  std::vector<bool> in_group(names_.size(), false);
  for (const std::string& name : split_dims(dims)) {
    auto it = std::find(names_.begin(), names_.end(), name);
    MOE_CHECK(it != names_.end(), "[parallel] unknown dimension '{}' in group '{}'", name, dims);
    in_group[it - names_.begin()] = true;
  }
  // stride of digit i = product of the sizes of faster digits.
  std::vector<int> stride(names_.size());
  int s = 1;
  for (size_t i = 0; i < names_.size(); ++i) {
    stride[i] = s;
    s *= sizes_[i];
  }
  std::vector<size_t> inner, outer;  // digits inside a group / digits that pick the group
  for (size_t i = 0; i < names_.size(); ++i) (in_group[i] ? inner : outer).push_back(i);
  int group_size = 1;
  for (size_t i : inner) group_size *= sizes_[i];
  const int num_groups = world_size_ / group_size;

  // Offset of the idx-th combination of `digits` (mixed radix, first digit fastest).
  auto offset = [&](const std::vector<size_t>& digits, int idx) {
    int off = 0;
    for (size_t i : digits) {
      off += (idx % sizes_[i]) * stride[i];
      idx /= sizes_[i];
    }
    return off;
  };
  RankLists groups(num_groups, std::vector<int>(group_size));
  for (int g = 0; g < num_groups; ++g) {
    const int base = offset(outer, g);
    for (int j = 0; j < group_size; ++j) groups[g][j] = base + offset(inner, j);
  }
  return groups;
}

}  // namespace moecore::parallel
