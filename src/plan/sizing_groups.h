// Process groups for sizing one rank of a layout in this process: the rank lists of the layout
// with communicators that know their size and position but refuse to communicate. The model's
// planning pass (which reads group sizes, never communicates) runs on them.
#pragma once

#include <memory>

#include "parallel/process_groups.h"

namespace moecore::plan {

std::unique_ptr<parallel::ProcessGroups> sizing_groups(const parallel::Layout& layout, int rank);

// parallel::make_layout(cfg, world), the last one kept: a layout search plans each parallel
// layout with several optimizers and recomputations in a row, and the rank lists of a large world
// take longer to build than the rest of a plan (256 GPUs ~20x). Per thread; valid until the
// thread's next call.
const parallel::Layout& planned_layout(const parallel::ParallelConfig& cfg, int world);

}  // namespace moecore::plan
