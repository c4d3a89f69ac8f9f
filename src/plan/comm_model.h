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

struct CommPlan {
  std::vector<CommItem> items;
  double alltoall_bytes_per_step = 0;        // per rank
  double alltoall_bytes_per_layer_fwd = 0;   // per MoE layer per micro-batch, one direction
  double exposed_seconds = 0;                // not overlapped
  double overlapped_seconds = 0;
};

CommPlan plan_comm(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw);

}  // namespace moecore::plan
