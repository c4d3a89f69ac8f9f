// The step report's ops on the GPU: the loss gradient's scale from the counted tokens on the
// device, and one MoE layer's results added into its micro-batch's slot, on one thread (scalars)
// and one thread per expert (the token counts). Each output element has one writer: the same
// arithmetic as the CPU's, bitwise.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/step_report.h"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void loss_grad_scale(T* dloss, const int64_t* counted, double scale) {
  const int64_t n = *counted;
  *dloss = static_cast<T>(n > 0 ? scale / static_cast<double>(n) : 0.0);
}

// Thread 0 of block 0 adds the scalars; every thread with an expert adds its count.
__global__ void report_moe_layer(MicroBatchReport* r, int64_t* tokens_E, const double* aux_value,
                                 const double* z_value, const int64_t* dropped,
                                 const int64_t* layer_tokens_E, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e == 0) {
    if (aux_value) r->aux_value += *aux_value;
    r->z_value += *z_value;
    r->dropped += *dropped;
    ++r->moe_layers;
  }
  if (e < E) tokens_E[e] += layer_tokens_E[e];
}
}  // namespace kernels

template <typename T>
void loss_grad_scale(void* stream, T* dloss, const int64_t* counted, double scale) {
  launch("loss_grad_scale", kernels::loss_grad_scale<T>, dim3(1), dim3(1), 0, stream, dloss,
         counted, scale);
}

void report_moe_layer(void* stream, MicroBatchReport* r, int64_t* tokens_E,
                      const double* aux_value, const double* z_value, const int64_t* dropped,
                      const int64_t* layer_tokens_E, int64_t E) {
  MOE_KERNEL_CHECK(E >= 0 && E <= (int64_t{1} << 31),
                   "[report] E=" + std::to_string(E) + " experts (0 to 2^31)");
  constexpr int64_t kBlock = 256;
  const int64_t blocks = std::max<int64_t>(1, (E + kBlock - 1) / kBlock);
  launch("report_moe_layer", kernels::report_moe_layer, dim3(unsigned(blocks)),
         dim3(unsigned(kBlock)), 0, stream, r, tokens_E, aux_value, z_value, dropped,
         layer_tokens_E, E);
}

template void loss_grad_scale<float>(void*, float*, const int64_t*, double);
template void loss_grad_scale<double>(void*, double*, const int64_t*, double);

}  // namespace moecore::ops::cuda
