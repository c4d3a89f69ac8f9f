// make_dispatcher: the one place that picks a dispatcher for a layout. EP = 1 keeps the local
// dispatcher so single-rank runs stay bitwise what they were.
#include "moe/dispatcher.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/check.h"
#include "moe/allgather_dispatcher.h"
#include "moe/alltoall_dispatcher.h"
#include "ops/cast.h"
#include "parallel/process_groups.h"

namespace moecore::moe {

int64_t experts_per_ep_rank(int64_t num_experts, int64_t ep_size) {
  MOE_CHECK(ep_size >= 1 && num_experts > 0 && num_experts % ep_size == 0,
            "[dispatcher] --num-experts {} is not divisible by --expert-model-parallel-size {}: "
            "every EP rank holds E/EP experts; pick an EP that divides {}",
            num_experts, ep_size, num_experts);
  return num_experts / ep_size;
}

int64_t ep_max_rows(int64_t ep_size, int64_t max_tokens, int64_t topk, int64_t num_experts,
                    const EpRowBudget& budget, int64_t etp) {
  // Padded, every (local expert, source rank) block has exactly that source's capacity rows,
  // at most the capacity of max_tokens: the rows are static, whatever the routing.
  if (budget.pad_capacity_factor > 0) {
    const int64_t local = experts_per_ep_rank(num_experts, ep_size);
    return etp * ep_size * local *
           expert_capacity(max_tokens, topk, num_experts, budget.pad_capacity_factor);
  }
  const int64_t worst = etp * ep_size * max_tokens * topk;
  if (budget.rank_capacity_factor > 0) {
    // In double, as Megatron's capacities are computed.
    const auto rows = static_cast<int64_t>(
        std::ceil(static_cast<double>(etp * max_tokens * topk) * budget.rank_capacity_factor));
    return std::min(worst, rows);
  }
  return worst;
}

void fail_received_rows(int64_t ep_rank, int64_t rows, int64_t max_rows, int64_t ep_size,
                        int64_t max_tokens, int64_t topk, const EpRowBudget& budget) {
  const int64_t balanced = max_tokens * topk;
  if (budget.rank_capacity_factor > 0 && budget.pad_capacity_factor <= 0) {
    MOE_FAIL(
        "[dispatcher] EP rank {} receives {} rows for its experts in this step, {:.3f} x the "
        "balanced load of {} (T {} x top-k {}), over the {} rows planned by "
        "--moe-expert-rank-capacity-factor {}: the routing is more skewed than the factor "
        "allows. Resume from the last checkpoint with a factor of at least {:.2f} (at most "
        "--expert-model-parallel-size {} holds any step), or leave the flag out to plan the "
        "dropless worst case",
        ep_rank, rows, static_cast<double>(rows) / static_cast<double>(balanced), balanced,
        max_tokens, topk, max_rows, budget.rank_capacity_factor,
        static_cast<double>(rows) / static_cast<double>(balanced), ep_size);
  }
  MOE_FAIL(
      "[dispatcher] EP rank {} receives {} rows for its experts > the planned maximum {} "
      "(EP {} x {} tokens x top-k {}, or the padded capacity): every EP rank must be planned "
      "for the same maximum micro-batch and capacity",
      ep_rank, rows, max_rows, ep_size, max_tokens, topk);
}

template <typename T>
void round_rows_to_bf16(const Exec& ex, DevPtr<bf16> y16, DevPtr<const T> y, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    ops::cast_f32_to_bf16(ex, y16, y, n);
  } else {
    MOE_FAIL("[dispatcher] bf16 expert rows are for the f32 model under --bf16");
  }
}
template void round_rows_to_bf16<float>(const Exec&, DevPtr<bf16>, DevPtr<const float>, int64_t);
template void round_rows_to_bf16<double>(const Exec&, DevPtr<bf16>, DevPtr<const double>,
                                         int64_t);

template <typename T>
std::unique_ptr<TokenDispatcher<T>> make_dispatcher(const MoeLayerConfig& cfg,
                                                    const parallel::ProcessGroups* groups) {
  const RouterConfig& r = cfg.moe.router;
  const double pad_cf = r.pad_to_capacity ? r.capacity_factor : 0.0;
  const EpRowBudget budget{pad_cf, cfg.moe.expert_rank_capacity_factor};
  const int64_t E = cfg.num_experts;
  const int ep = groups ? groups->degrees().ep : 1;
  const int etp = groups ? groups->degrees().etp : 1;
  experts_per_ep_rank(E, ep);
  if (ep == 1 && etp == 1) return std::make_unique<LocalDispatcher<T>>(E, r.topk, cfg.hidden, pad_cf);
  // Rows and probs move in the context's memory (the device communicators); the counts the host
  // sizes the collectives from, in host memory (the host communicators).
  const parallel::ProcessGroup& ep_group = groups->group(parallel::GroupKind::Ep);
  parallel::Communicator& comm = ep_group.device_communicator();
  switch (cfg.moe.dispatcher_type) {
    case DispatcherType::AllGather: {
      if (etp == 1) {
        return std::make_unique<AllGatherDispatcher<T>>(E, r.topk, cfg.hidden, budget, comm,
                                                        &ep_group.communicator());
      }
      const parallel::ProcessGroup& tp_ep = groups->group(parallel::GroupKind::TpEp);
      return std::make_unique<AllGatherDispatcher<T>>(E, r.topk, cfg.hidden, budget,
                                                      tp_ep.device_communicator(), ep, comm.rank(),
                                                      &tp_ep.communicator());
    }
    case DispatcherType::AlltoAll: {
      const parallel::ProcessGroup& etp_group = groups->group(parallel::GroupKind::ExptTp);
      return std::make_unique<AlltoAllDispatcher<T>>(
          E, r.topk, cfg.hidden, budget, comm, etp > 1 ? &etp_group.device_communicator() : nullptr,
          &ep_group.communicator(), etp > 1 ? &etp_group.communicator() : nullptr);
    }
  }
  MOE_FAIL("[dispatcher] unknown dispatcher type {}", static_cast<int>(cfg.moe.dispatcher_type));
}

template std::unique_ptr<TokenDispatcher<float>> make_dispatcher<float>(
    const MoeLayerConfig&, const parallel::ProcessGroups*);
template std::unique_ptr<TokenDispatcher<double>> make_dispatcher<double>(
    const MoeLayerConfig&, const parallel::ProcessGroups*);

}  // namespace moecore::moe
