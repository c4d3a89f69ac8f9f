// Hardware descriptions for the roofline: dense peak, device memory, HBM and link bandwidths.
// Presets are vendor datasheet numbers (dense, no sparsity), per GPU; every field can be
// overridden on the command line.
#pragma once

#include <string>
#include <vector>

#include "core/exec.h"

namespace moecore::plan {

struct Hardware {
  std::string name;
  double peak_tflops_bf16 = 0;   // dense tensor-core peak
  double peak_tflops_fp32 = 0;   // what fp32 GEMMs reach (CPU: the BLAS peak)
  double memory_gib = 0;         // device (HBM) memory per GPU
  double hbm_tbps = 0;           // HBM bandwidth, TB/s
  double nvlink_gbps = 0;        // scale-up link, GB/s per GPU per direction
  double internode_gbps = 0;     // scale-out (InfiniBand / Ethernet), GB/s per GPU per direction
  int gpus_per_node = 8;         // size of the scale-up (NVLink) domain
  double reserved_gib = 0;       // CUDA context, cuBLAS / NCCL workspaces (not the arena's)
  // The backend the trainer's planning pass sizes for: its paths decide some buffers (the CPU's
  // widened-bf16 GEMM path keeps f32 copies of the bf16 weights and f32 GEMM workspace; CUDA's
  // bf16 GEMMs need neither), so a GPU plan must not depend on the host that runs the planner.
  Device device = Device::CUDA;
};

// h100, h200, b200, gb200, gb300, cpu. Throws listing the presets for another name.
Hardware hardware_preset(const std::string& name);
std::vector<std::string> hardware_preset_names();

}  // namespace moecore::plan
