// Megatron's rank generator: ranks are a mixed-radix number whose digits are the parallel
// dimensions in the order of an order string, fastest-varying first ("tp-cp-ep-dp-pp": tp
// neighbours are adjacent ranks, pp is the slowest digit). A group along some dimensions holds
// the ranks that differ only in those digits.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moecore::parallel {

using RankLists = std::vector<std::vector<int>>;

class RankGenerator {
 public:
  // Dimension names are tp, cp, ep, dp, pp. A name absent from `order` must have size 1 and is
  // appended; an unknown or repeated name is an error.
  RankGenerator(int tp, int cp, int ep, int dp, int pp, std::string_view order);

  // The groups along the '-'-separated dimensions of `dims` (e.g. "tp-ep"), each listing its
  // ranks with the dimensions in order-string order (fastest first); groups are listed by the
  // remaining digits, fastest first. Every rank is in exactly one group.
  RankLists ranks(std::string_view dims) const;
  int world_size() const { return world_size_; }
  const std::string& order() const { return order_; }

 private:
  std::vector<std::string> names_;  // digits, fastest first
  std::vector<int> sizes_;
  std::string order_;
  int world_size_ = 1;
};

}  // namespace moecore::parallel
