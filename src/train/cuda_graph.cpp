// The trainer's CUDA graph (--cuda-graph-impl full_iteration, docs/gpu.md "CUDA graphs"): what
// is refused before step 0 because a graph could not contain it, and the step's forward and
// backward of every micro-batch with the gradient reduction, eager for the warm-up steps,
// captured on the next (core/stream_graph.h) and replayed after.
#include <fmt/format.h>

#include <functional>
#include <type_traits>

#include "core/check.h"
#include "core/fault_injection.h"
#include "core/sync_audit.h"
#include "moe/config.h"
#include "ops/activation.h"
#include "ops/gemm.h"
#include "ops/memory.h"
#include "train/trainer.h"

namespace moecore::train {

// --cuda-graph-impl full_iteration: what is known before step 0 not to be capturable is refused
// here, naming it and the fix; anything else a capture cannot contain stops the capture step,
// naming the call (core/sync_audit.h's capture rules).
template <typename T>
void BasicTrainer<T>::check_cuda_graph_support() {
  if (cfg_.cuda_graph_impl == "none") return;
  MOE_CHECK(cfg_.cuda_graph_impl == "full_iteration",
            "[train] --cuda-graph-impl {}: moecore captures full_iteration only (the flags "
            "refuse the others)",
            cfg_.cuda_graph_impl);
  MOE_CHECK(cfg_.cuda_graph_warmup_steps >= 1,
            "[train] --cuda-graph-warmup-steps {}: at least 1 eager step before the capture",
            cfg_.cuda_graph_warmup_steps);
  if (exec_.on_cpu()) return;  // no effect: print_header says so
  const auto refuse = [](bool bad, const std::string& what) {
    MOE_CHECK(!bad,
              "[train] --cuda-graph-impl full_iteration: {}; train without --cuda-graph-impl "
              "(docs/gpu.md, \"CUDA graphs\")",
              what);
  };
  // Several processes: NCCL's calls are captured (NCCL >= 2.9, each on its communicator's stream
  // forked from the captured one and joined back by CommHandle::wait_on); what the host decides
  // from other ranks' data inside the region cannot be. The MoE dispatchers over EP (or expert
  // TP) size their collectives on the host from every rank's counts, a documented sync point,
  // except the all-to-all with padded dispatch, whose splits are the capacity.
  // Pipeline and context parallelism have not been run under a capture (their point-to-point
  // schedules and the CP ring's exchanges would be recorded like any NCCL call, but no test has
  // compared their replays with the eager steps): refused until one does.
  const int pp = groups_ != nullptr ? groups_->degrees().pp : 1;
  const int cp = groups_ != nullptr ? groups_->degrees().cp : 1;
  refuse(pp > 1 || cp > 1,
         fmt::format("pipeline parallel {} x context parallel {}: capture with PP or CP > 1 has not "
                     "been tested against the eager steps yet; use PP = CP = 1 (DP, TP + SP and "
                     "padded EP are captured)",
                     pp, cp));
  const int ep = groups_ != nullptr ? groups_->degrees().ep : 1;
  const int etp = groups_ != nullptr ? groups_->degrees().etp : 1;
  if (model_cfg_.num_experts > 0 && (ep > 1 || etp > 1)) {
    const bool allgather = model_cfg_.moe.dispatcher_type == DispatcherType::AllGather;
    refuse(allgather,
           fmt::format("--moe-token-dispatcher-type allgather with EP {} x expert TP {}: the host "
                       "reads every rank's token counts to size the gathers (the sync point "
                       "\"{}\"), which a graph cannot contain; use the alltoall dispatcher with "
                       "--moe-expert-capacity-factor C --moe-pad-expert-input-to-capacity",
                       ep, etp, SyncAudit::kEpTokenCounts));
    refuse(!model_cfg_.moe.router.pad_to_capacity,
           fmt::format("dropless MoE with EP {} x expert TP {}: the host sizes the all-to-all from "
                       "every rank's rows per expert (the sync point \"{}\"), which a graph "
                       "cannot contain; use --moe-expert-capacity-factor C "
                       "--moe-pad-expert-input-to-capacity (static splits)",
                       ep, etp, SyncAudit::kEpCountExchange));
  }
  // MoE layers whose grouped GEMMs read their group sizes on the host: dropless or dropping
  // dispatch (the rows per expert are the routing's) where the experts' grouped GEMMs take the
  // host-table path (ops/gemm.h: the device-table backend does not take their shapes, or
  // MOECORE_GROUPED_GEMM=host); padded dispatch's rows are the capacity, known on the host.
  if (model_cfg_.num_experts > 0 && !model_cfg_.moe.router.pad_to_capacity) {
    const ops::desc::GemmTypes types = model_cfg_.bf16 && !std::is_same_v<T, double>
                                           ? ops::desc::GemmTypes::Bf16F32
                                           : ops::grouped_gemm_types<T>(exec_);  // TF32 under high
    const int64_t H = model_cfg_.hidden, F = model_cfg_.moe.ffn_hidden;
    const int64_t F1 = ops::activation_fc1_width(model_cfg_.activation, F);
    const bool host_tables = ops::grouped_gemm_path(types, F1, H) == ops::GroupedGemmPath::Host ||
                             ops::grouped_gemm_path(types, H, F) == ops::GroupedGemmPath::Host;
    refuse(host_tables,
           fmt::format("MoE layers without --moe-pad-expert-input-to-capacity whose grouped GEMMs "
                       "(hidden {}, expert FFN {}) take the host-table path here: they read the "
                       "rows per expert on the host (the sync point \"{}\"), which a graph cannot "
                       "contain; use --moe-expert-capacity-factor C "
                       "--moe-pad-expert-input-to-capacity (static rows per expert), or a build "
                       "whose grouped GEMM runs from device tables for these shapes (docs/gpu.md, "
                       "\"GEMMs on CUDA\")",
                       H, F, ops::kGroupedGemmSizes));
  }
  // Injected faults that the host decides per iteration inside the captured region.
  for (const char* kind : {"nan_loss", "spike_loss", "inf_grad"}) {
    refuse(fault::find(kind) != nullptr,
           fmt::format("MOECORE_FAULT {}: the injected fault is the host's per-iteration decision "
                       "inside the captured forward-backward (a replay would repeat the capture "
                       "step's choice)",
                       kind));
  }
  graphs_ = true;
}

// Every micro-batch's forward and backward in the pipeline schedule (one rank: each forward then
// its backward), then the gradients summed over their data-parallel groups. Megatron averages
// the loss over micro-batches and the gradients over dp x cp replicas: each backward carries
// 1 / (micro-batches x dp), so the all-reduce is a plain sum. A gradient is final after its
// chunk's last micro-batch: that backward launches its buckets. With --cuda-graph-impl
// full_iteration this is the captured region (Megatron's FullCudaGraphWrapper around
// forward_backward_func): eager for the warm-up steps, captured on the next, replayed after.
template <typename T>
void BasicTrainer<T>::forward_backward(int64_t n_global) {
  const double scale = 1.0 / static_cast<double>(n_global);
  // MOECORE_FAULT nccl_wait_after_region: a collective begun inside this region and waited for by
  // the host after it, outside what a graph records (the test that a capture refuses it by name).
  parallel::CommHandle planted;
  const auto work = [this, scale, &planted] {
    runner_->train(scale, pipeline_hooks());
    buckets_->finish();  // every gradient summed over its data-parallel group (checked before)
    // MOECORE_FAULT host_read_in_step: a host read of step data planted in this region (the
    // test that a capture refuses it by name).
    if (fault::find("host_read_in_step", groups_ != nullptr ? groups_->rank() : 0, iteration_)) {
      (void)ops::read_value<double>(exec_, member_ptr(step_->io(0, model_->num_chunks() - 1).report,
                                                      &ops::MicroBatchReport::lm_loss_sum));
    }
    if (groups_ != nullptr &&
        fault::find("nccl_wait_after_region", groups_->rank(), iteration_) != nullptr) {
      planted = groups_->world().device_communicator().barrier_async();
    }
  };
  graph_replayed_ = false;
  if (graphs_) {
    graph_region(std::ref(work));  // (by reference: a step allocates nothing)
  } else {
    work();
  }
  planted.wait();  // nccl_wait_after_region's host wait (eager: the barrier completes here)
}

// The region of forward_backward under --cuda-graph-impl full_iteration: eager for the warm-up
// steps, captured on the next, replayed on every later step.
template <typename T>
void BasicTrainer<T>::graph_region(const std::function<void()>& work) {
  // --overlap-param-gather: the parameter all-gathers the last optimizer step began (eager, on
  // NCCL's stream) are ordered on the stream before the graph; a capture cannot depend on work
  // issued before it, and a replay would not wait for them.
  if (graph_ != nullptr || graph_eager_steps_ >= cfg_.cuda_graph_warmup_steps) {
    buckets_->wait_params();
  }
  if (graph_ != nullptr) {
    graph_->launch();
    graph_replayed_ = true;
    // The host side of the region did not run: the routers' counts as the captured step left
    // (the pointers kept at the capture: a replayed step allocates nothing).
    for (size_t i = 0; i < graph_routers_.size(); ++i) {
      graph_routers_[i]->set_step_counts(graph_router_counts_[i]);
    }
    return;
  }
  if (graph_eager_steps_ < cfg_.cuda_graph_warmup_steps) {
    ++graph_eager_steps_;
    work();
    return;
  }
  {
    // The capture's own bookkeeping is not the step's (--sync-audit), and no phase event is
    // recorded into the graph: a replay is timed as one region of the step.
    const SyncAudit::Paused capture;
    const ActiveProfiler no_phases(nullptr);
    const StepComm before = step_comm();
    graph_ = std::make_unique<StreamGraph>(StreamGraph::capture(
        exec_, "forward and backward of every micro-batch (--cuda-graph-impl full_iteration)",
        work));
    graph_comm_ = step_comm() - before;
    graph_routers_ = model_->routers();
    for (const moe::Router<T>* r : graph_routers_) graph_router_counts_.push_back(r->step_counts());
    graph_note_ = fmt::format(
        "[cuda-graph] iteration {}: the forward and backward of {} micro-batch{} captured as one "
        "graph of {} operations after {} eager step{}; replayed from this step on",
        iteration_, n_micro_, n_micro_ == 1 ? "" : "es", graph_->operations(), graph_eager_steps_,
        graph_eager_steps_ == 1 ? "" : "s");
  }
  graph_->launch();
}

template <typename T>
typename BasicTrainer<T>::StepComm BasicTrainer<T>::step_comm() const {
  StepComm c;
  if (groups_ == nullptr) return c;
  if (groups_->degrees().ep > 1) {
    c.alltoall_bytes =
        groups_->group(parallel::GroupKind::Ep).device_communicator().all_to_all_bytes_sent();
  }
  const auto& tp = groups_->group(parallel::GroupKind::Tp);
  if (tp.size() > 1) {
    c.tp_bytes = tp.device_communicator().bytes_sent();
    c.tp_calls = tp.device_communicator().calls().collectives();
  }
  const auto& etp = groups_->group(parallel::GroupKind::ExptTp);
  if (etp.size() > 1) {
    c.etp_bytes = etp.device_communicator().bytes_sent();
    c.etp_calls = etp.device_communicator().calls().collectives();
  }
  const auto& pp = groups_->group(parallel::GroupKind::Pp);
  if (pp.size() > 1) c.pp_bytes = pp.device_communicator().bytes_sent().send;
  return c;
}

template void BasicTrainer<float>::check_cuda_graph_support();
template void BasicTrainer<double>::check_cuda_graph_support();
template void BasicTrainer<float>::forward_backward(int64_t);
template void BasicTrainer<double>::forward_backward(int64_t);
template void BasicTrainer<float>::graph_region(const std::function<void()>&);
template void BasicTrainer<double>::graph_region(const std::function<void()>&);
template BasicTrainer<float>::StepComm BasicTrainer<float>::step_comm() const;
template BasicTrainer<double>::StepComm BasicTrainer<double>::step_comm() const;

}  // namespace moecore::train
