// The step report's ops from their definitions: the oracle.
#include "ops/step_report.h"

namespace moecore::ops {

template <typename T>
void loss_grad_scale_ref(T* dloss, const int64_t* counted, double scale) {
  *dloss = *counted > 0 ? static_cast<T>(scale / static_cast<double>(*counted)) : T(0);
}

void report_moe_layer_ref(MicroBatchReport* r, int64_t* tokens_E, const double* aux_value,
                          const double* z_value, const int64_t* dropped,
                          const int64_t* layer_tokens_E, int64_t E) {
  if (aux_value) r->aux_value = r->aux_value + *aux_value;  // no aux type: unchanged
  r->z_value = r->z_value + *z_value;
  r->dropped = r->dropped + *dropped;
  r->moe_layers = r->moe_layers + 1;
  for (int64_t e = 0; e < E; ++e) tokens_E[e] = tokens_E[e] + layer_tokens_E[e];
}

template void loss_grad_scale_ref<float>(float*, const int64_t*, double);
template void loss_grad_scale_ref<double>(double*, const int64_t*, double);

}  // namespace moecore::ops
