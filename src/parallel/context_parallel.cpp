// The attention layers' view of context parallelism, built from the process groups and the
// --cp-comm-type list (context_parallel.h).
#include "parallel/context_parallel.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::parallel {

CpCommType parse_cp_comm_type(const std::string& v) {
  if (v == "p2p") return CpCommType::P2P;
  if (v == "allgather" || v == "all_gather") return CpCommType::AllGather;
  MOE_CHECK(false, "[context parallel] --cp-comm-type {}: moecore builds p2p and allgather", v);
  return CpCommType::P2P;
}

ContextParallel ContextParallel::attention(const ProcessGroups* groups, int64_t layer) {
  if (groups == nullptr) return {};
  const ParallelConfig& cfg = groups->layout().config;
  const int64_t n = static_cast<int64_t>(cfg.cp_comm_type.size());
  const int64_t i = std::clamp<int64_t>(layer, 0, n - 1);
  return ContextParallel(&groups->group(GroupKind::Cp),
                         parse_cp_comm_type(cfg.layer_cp_comm_type(n == 1 ? 0 : i)));
}

}  // namespace moecore::parallel
