// The step report's ops on the CPU: scalar arithmetic and one [E] pass.
#include "ops/step_report.h"

#include "core/check.h"

namespace moecore::ops::cpu {

template <typename T>
void loss_grad_scale(T* dloss, const int64_t* counted, double scale) {
  const int64_t n = *counted;
  *dloss = static_cast<T>(n > 0 ? scale / static_cast<double>(n) : 0.0);
}

void report_moe_layer(MicroBatchReport* r, int64_t* tokens_E, const double* aux_value,
                      const double* z_value, const int64_t* dropped, const int64_t* layer_tokens_E,
                      int64_t E) {
  MOE_CHECK(E >= 0, "[report] E={} < 0", E);
  if (aux_value) r->aux_value += *aux_value;
  r->z_value += *z_value;
  r->dropped += *dropped;
  ++r->moe_layers;
  for (int64_t e = 0; e < E; ++e) tokens_E[e] += layer_tokens_E[e];
}

template void loss_grad_scale<float>(float*, const int64_t*, double);
template void loss_grad_scale<double>(double*, const int64_t*, double);

}  // namespace moecore::ops::cpu
