#include "parallel/pipeline_layout.h"

#include <fmt/format.h>

namespace moecore::parallel {

std::string PipelineLayout::describe() const { return fmt::format("pp {} vp {}", pp, vp); }

PipelineLayout pipeline_layout(const ParallelConfig& cfg, int64_t num_layers, int64_t) {
  PipelineLayout l;
  l.pp = cfg.pp;
  l.vp = 1;
  int64_t first = 0;
  for (int s = 0; s < cfg.pp; ++s) {
    VirtualStage v;
    v.first_layer = first;
    v.num_layers = stage_num_layers(cfg, static_cast<int>(num_layers), s);
    v.embedding = s == 0;
    v.loss = s == cfg.pp - 1;
    first += v.num_layers;
    l.stages.push_back(v);
  }
  return l;
}

}  // namespace moecore::parallel
