// The whole model against its two pipeline stages, as the pipeline-composition tests run them.
#pragma once

#include <cstdint>
#include <vector>

#include "common/layer_testing.h"
#include "model/gpt_model.h"

namespace moecore::testing {

struct StageReports {
  std::vector<ops::MicroBatchReport> whole, first, last;  // per micro-batch
};

// The micro-batches `m` through the whole model (forward, backward(0.5) each) and through its
// two stages in 1F1B's order with two micro-batches: the first stage's F0 F1; the last stage
// runs F then B on each activation at once; then the first stage's B0 (after F1: replayed) and
// B1 from the last stage's input gradients. Every model's gradients are zeroed first. E: the
// models' experts (the token counts' stride).
template <typename T>
StageReports run_whole_and_two_stages(model::GPTModel<T>& whole, model::GPTModel<T>& first,
                                      model::GPTModel<T>& last, const MicroBatches& m,
                                      int64_t E) {
  const size_t n_mb = m.ids.size();
  StageReports r{std::vector<ops::MicroBatchReport>(n_mb), std::vector<ops::MicroBatchReport>(n_mb),
                 std::vector<ops::MicroBatchReport>(n_mb)};
  std::vector<int64_t> tw(n_mb * E), tf(n_mb * E), tl(n_mb * E);
  const auto io = [&](std::vector<ops::MicroBatchReport>& rep, std::vector<int64_t>& t, size_t mb) {
    return model::MicroBatchIO{m.ids[mb].data(), m.targets[mb].data(), &rep[mb], &t[mb * E],
                               &m.counters[mb]};
  };
  for (model::GPTModel<T>* g : {&whole, &first, &last}) g->params().zero_grads();
  for (size_t mb = 0; mb < n_mb; ++mb) {
    whole.forward(io(r.whole, tw, mb));
    whole.backward(0.5);
  }
  std::vector<std::vector<T>> grad(n_mb);
  for (size_t mb = 0; mb < n_mb; ++mb) {
    first.forward_chunk(0, io(r.first, tf, mb), nullptr, static_cast<int>(mb));
    const T* out = host(first.chunk_output(0));
    const std::vector<T> act(out, out + first.boundary_elems());
    last.forward_chunk(0, io(r.last, tl, mb), act.data(), static_cast<int>(mb));
    last.backward_chunk(0, 0.5, nullptr, static_cast<int>(mb));
    const T* g = host(last.input_grad());
    grad[mb].assign(g, g + last.boundary_elems());
  }
  for (size_t mb = 0; mb < n_mb; ++mb) {
    first.forward_chunk(0, io(r.first, tf, mb), nullptr, static_cast<int>(mb), /*replay=*/true);
    first.backward_chunk(0, 0.5, grad[mb].data(), static_cast<int>(mb));
  }
  return r;
}

}  // namespace moecore::testing
