// Process groups for sizing one rank of a layout in this process: the rank lists of the layout
// with communicators that know their size and position but refuse to communicate. The model's
// planning pass (which reads group sizes, never communicates) runs on them.
#pragma once

#include <memory>

#include "parallel/process_groups.h"

namespace moecore::plan {

std::unique_ptr<parallel::ProcessGroups> sizing_groups(const parallel::Layout& layout, int rank);

}  // namespace moecore::plan
