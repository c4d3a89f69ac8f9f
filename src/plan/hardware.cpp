#include "plan/hardware.h"

#include "core/check.h"

namespace moecore::plan {

// Datasheet numbers (NVIDIA H100/H200 SXM, DGX B200, GB200/GB300 NVL72 product pages): dense
// bf16 tensor-core peak; NVLink 4 = 900 GB/s and NVLink 5 = 1.8 TB/s bidirectional per GPU, halved
// here per direction; one 400 Gb/s NIC per GPU (800 Gb/s ConnectX-8 on GB300). The reserved
// memory (CUDA context, cuBLAS / cuDNN workspaces, NCCL buffers) is an estimate, not measured.
static const std::vector<Hardware>& presets() {
  static const std::vector<Hardware> p = {
      {"h100", 989, 67, 80, 3.35, 450, 50, 8, 2.0},
      {"h200", 989, 67, 141, 4.8, 450, 50, 8, 2.0},
      {"b200", 2250, 80, 180, 8.0, 900, 50, 8, 2.5},
      {"gb200", 2500, 80, 186, 8.0, 900, 50, 72, 2.5},
      {"gb300", 2500, 80, 279, 8.0, 900, 100, 72, 2.5},
      // One CPU socket as moecore trains on it today: the GEMM peak is what bench_gemm measures
      // on a 16-core machine, the "links" shared memory between processes.
      {"cpu", 1.0, 1.0, 128, 0.2, 20, 12.5, 1, 0.0, Device::CPU},
  };
  return p;
}

std::vector<std::string> hardware_preset_names() {
  std::vector<std::string> out;
  for (const Hardware& h : presets()) out.push_back(h.name);
  return out;
}

Hardware hardware_preset(const std::string& name) {
  for (const Hardware& h : presets()) {
    if (h.name == name) return h;
  }
  MOE_FAIL("[plan] unknown --hardware '{}': choose h100, h200, b200, gb200, gb300 or cpu (and "
           "override with --peak-tflops, --device-memory-gib, --hbm-tbps, --nvlink-gbps, "
           "--internode-gbps, --gpus-per-node)",
           name);
}

}  // namespace moecore::plan
