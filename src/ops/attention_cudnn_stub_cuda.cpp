// cuDNN's fused attention where there is no cuDNN: the CPU build (no CUDA context is ever made)
// and the emulated CUDA build, whose device runs the own kernel through the grid emulator.
#include "ops/attention.h"

namespace moecore::ops::cuda {

const CudnnAttentionProbe& cudnn_attention_probe() {
  static const CudnnAttentionProbe probe{false, "emulated build: no cuDNN"};
  return probe;
}

void cudnn_attention_prepare(void*, const AttentionShape&, const AttentionDropout*) {}

bool cudnn_attention_forward(void*, float*, float*, const float*, const float*, const float*,
                             const AttentionShape&, const AttentionDropout*) {
  return false;
}

bool cudnn_attention_backward(void*, float*, float*, float*, const float*, const float*,
                              const float*, const float*, const float*, const float*,
                              const AttentionShape&, const AttentionDropout*) {
  return false;
}

}  // namespace moecore::ops::cuda
