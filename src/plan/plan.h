// One plan: a model and a run on a world of ranks and a hardware description, and everything
// the planner says about it (parameters, memory per stage, communication, FLOPs, roofline).
#pragma once

#include <optional>
#include <string>

#include "plan/comm_model.h"
#include "plan/flops.h"
#include "plan/hardware.h"
#include "plan/memory_model.h"
#include "plan/model_spec.h"
#include "plan/param_count.h"
#include "plan/roofline.h"

namespace moecore::plan {

struct Plan {
  ModelSpec model;
  RunSpec run;
  int world = 1;
  Hardware hw;
  parallel::Degrees degrees;
  ParamCounts params;
  MemoryPlan memory;
  CommPlan comm;
  PlanFlops flops;
  Roofline roof;
  bool fits = false;  // the worst stage fits in hw.memory_gib
  std::vector<std::string> notes;  // what the user can change about the figures, one line each
};

// Validates the layout as `moecore groups` does (parallel::validate_layout against the model)
// and the batch (global batch a multiple of micro batch x dp); throws naming the numbers.
void validate_run(const ModelSpec& m, const RunSpec& run, int world);

// trainer_cfg: the whole model as `moecore train` parses the same flags (null: derived).
Plan make_plan(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
               const ModelConfig* trainer_cfg = nullptr);

// The readable report and the JSON object (`--json`).
std::string plan_text(const Plan& p);
std::string plan_json(const Plan& p);

}  // namespace moecore::plan
