// Where every decoder layer goes over the pipeline stages (placeholder: even split).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/parallel_config.h"

namespace moecore::parallel {

struct VirtualStage {
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  int64_t num_mtp_layers = 0;
  bool embedding = false;
  bool loss = false;
};
struct PipelineLayout {
  int pp = 1, vp = 1;
  std::vector<VirtualStage> stages;
  const VirtualStage& stage(int rank, int chunk) const { return stages[chunk * pp + rank]; }
  std::string describe() const;
};
PipelineLayout pipeline_layout(const ParallelConfig& cfg, int64_t num_layers, int64_t mtp_layers = 0);

}  // namespace moecore::parallel
