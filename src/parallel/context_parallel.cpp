// The attention layers' view of context parallelism, built from the process groups and the
// --cp-comm-type list (context_parallel.h).
#include "parallel/context_parallel.h"

#include <algorithm>

#include "core/check.h"
#include "ops/memory.h"
#include "ops/token_layout.h"

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

void global_positions(const Exec& ex, const ContextParallel& cp, DevPtr<int32_t> pos_T,
                      DevPtr<int32_t> whole, int64_t S_local, int64_t B) {
  if (!cp.active()) return ops::sequence_positions(ex, pos_T, S_local * B, B);
  // The whole sequence's positions, then this rank's two chunks of them (rows are sequence-major,
  // so a chunk of C positions is C * B consecutive tokens).
  const ContextSplit sp = cp.split(S_local * cp.size());
  const int64_t C = sp.chunk();
  ops::sequence_positions(ex, whole, S_local * cp.size() * B, B);
  for (int h = 0; h < 2; ++h)
    ops::copy<int32_t>(ex, pos_T + h * C * B, whole + sp.chunk_index(h) * C * B, C * B);
}

}  // namespace moecore::parallel
