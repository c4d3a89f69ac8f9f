// Communication per training step, per rank, by collective: the EP all-to-all (dispatch and
// combine, forward and backward), TP / SP collectives, CP key-value exchange, DP / expert-DP
// gradient reduction (and the distributed optimizer's parameter all-gather), PP point-to-point.
// Each travels on the scale-up links (NVLink) when its group fits in one node of
// --gpus-per-node ranks, else on the scale-out links; times are bytes / that link's bandwidth.
#pragma once

#include <string>
#include <vector>

#include "plan/hardware.h"
#include "plan/model_spec.h"

namespace moecore::plan {

struct CommItem {
  std::string name;      // "ep all-to-all", "tp all-gather + reduce-scatter", ...
  std::string group;     // the process group ("ep", "tp", "dp_cp", "expt_dp", "pp", "cp")
  double bytes = 0;      // sent per rank per step
  bool internode = false;
  double seconds = 0;
  bool overlapped = false;  // hidden behind compute in the roofline (gradient reduction)
  std::string formula;
};

// Bytes one rank sends per step over one group, by collective form: what
// parallel::Communicator::bytes_sent() counts on that group's communicator (the ring algorithm:
// an all-gather or reduce-scatter of M bytes in all over g ranks sends M (g-1)/g, an all-reduce
// 2 M (g-1)/g).
struct GroupBytes {
  double all_gather = 0;
  double reduce_scatter = 0;
  double all_reduce = 0;
  double total() const { return all_gather + reduce_scatter + all_reduce; }
};

// The tensor-parallel traffic of one step of one rank (docs/plan.md, "Tensor, sequence and
// expert-tensor parallelism"), by group and collective form.
struct TpCommBytes {
  GroupBytes tp_regions;     // tp: attention, MLP and shared-expert regions, the MoE layer's gather
  GroupBytes tp_vocab;       // tp: vocab-parallel embedding, output head and cross entropy
  GroupBytes tp_grads;       // tp: the all-reduce of ReplicatedPartialGrad gradients
  GroupBytes expt_tp;        // expt_tp: alltoall dispatcher's ETP gather / scatter, expert grads
  GroupBytes tp_ep;          // tp_ep: the allgather dispatcher's (or the counts') collectives
  GroupBytes tp() const {
    return {tp_regions.all_gather + tp_vocab.all_gather + tp_grads.all_gather,
            tp_regions.reduce_scatter + tp_vocab.reduce_scatter + tp_grads.reduce_scatter,
            tp_regions.all_reduce + tp_vocab.all_reduce + tp_grads.all_reduce};
  }
};

// token_bytes: the bytes of an activation element on the wire (the CPU backend's activations are
// f32 also with --bf16; a GPU's are bf16 with it); under --bf16 the all-gathers entering a TP
// region with SP move 2 bytes an element on either (parallel::TensorParallel::enter's bf16
// staging). Averaged over the pipeline stages (/ pp).
TpCommBytes plan_tp_comm(const ModelSpec& m, const RunSpec& run, const parallel::Degrees& d,
                         double token_bytes);

struct CommPlan {
  std::vector<CommItem> items;
  TpCommBytes tp;                            // per rank per step
  double alltoall_bytes_per_step = 0;        // per rank
  double alltoall_bytes_per_layer_fwd = 0;   // per MoE layer per micro-batch, one direction
  // What pp rank 0 (the first stage, whose metrics the trainer logs: `pp_bytes`) sends over the
  // pipeline group per step: its activations forward (bf16 under --bf16 without
  // --fp32-residual-connection), its later chunks' gradients back, the tied table's gradient.
  double pp_first_stage_bytes_per_step = 0;
  double exposed_seconds = 0;                // not overlapped
  double overlapped_seconds = 0;
};

CommPlan plan_comm(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw);

}  // namespace moecore::plan
