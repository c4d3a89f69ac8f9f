#include "core/stream_graph.h"

#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "core/sync_audit.h"

namespace moecore {

StreamGraph::~StreamGraph() {
  cuda_graph_destroy(graph_);
}

StreamGraph::StreamGraph(StreamGraph&& o) noexcept
    : ex_(o.ex_), graph_(std::exchange(o.graph_, nullptr)), operations_(o.operations_) {}

StreamGraph& StreamGraph::operator=(StreamGraph&& o) noexcept {
  if (this != &o) {
    cuda_graph_destroy(graph_);
    ex_ = o.ex_;
    graph_ = std::exchange(o.graph_, nullptr);
    operations_ = o.operations_;
  }
  return *this;
}

StreamGraph StreamGraph::capture(const Exec& ex, const std::string& region,
                                 const std::function<void()>& work) {
  MOE_CHECK(!ex.on_cpu(),
            "[cuda-graph] capturing {} on the CPU backend: it has no stream to capture (its ops "
            "run when they are called)",
            region);
  SyncAudit& audit = SyncAudit::instance();
  {
    const SyncAudit::Paused driver;  // the backend's bookkeeping is not the step's
    cuda_capture_begin(ex);
  }
  audit.begin_capture(region);
  try {
    work();
  } catch (...) {
    audit.end_capture();
    const SyncAudit::Paused driver;
    cuda_capture_end(ex, /*keep=*/false, nullptr);
    throw;
  }
  audit.end_capture();
  StreamGraph g;
  g.ex_ = ex;
  const SyncAudit::Paused driver;
  g.graph_ = cuda_capture_end(ex, /*keep=*/true, &g.operations_);
  return g;
}

void StreamGraph::launch() const {
  MOE_CHECK(graph_ != nullptr, "[cuda-graph] launch of an empty graph (nothing was captured)");
  cuda_graph_launch(ex_, graph_);
}

}  // namespace moecore
