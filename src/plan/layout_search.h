// `moecore plan --search`: every layout of a world size (TP, CP, PP, VPP, EP, ETP, distributed
// optimizer, recompute) that the layout rules accept and that fits in device memory, ranked by
// the roofline's throughput; the others with the reason each was rejected.
#pragma once

#include <string>
#include <vector>

#include "plan/plan.h"

namespace moecore::plan {

struct SearchResult {
  std::vector<Plan> fits;                // best first
  std::vector<std::pair<RunSpec, std::string>> rejected;  // with the reason
  int64_t tried = 0;
};

// base: the batch, precision and the recompute modules to try; its layout is ignored.
// trainer_cfg: the model as `moecore train` parses it (null: derived), as for make_plan.
SearchResult search_layouts(const ModelSpec& m, const RunSpec& base, int world,
                            const Hardware& hw, const ModelConfig* trainer_cfg = nullptr);

// A layout's Megatron flags ("--tensor-model-parallel-size 2 ..."): all of them, and the
// process-group ones alone (what `moecore groups` takes).
std::string layout_flags(const RunSpec& run);
std::string groups_flags(const RunSpec& run);

std::string search_text(const SearchResult& r, int top);
std::string search_json(const SearchResult& r, int top);

}  // namespace moecore::plan
