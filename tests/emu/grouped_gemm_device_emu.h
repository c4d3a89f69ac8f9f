// What the emulated device-table grouped GEMM (grouped_gemm_device_emu.cpp) tells its tests: its
// model of the CUDA backend's parameter cache (ops/cuda/grouped_gemm_params_cache.h), whose slots
// the plan reserves (ops::grouped_gemm_workspace_bytes) and whose misses are the calls a GPU
// would rebuild parameters for on the host.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecore::emu {

struct GroupedGemmParamsCounts {
  size_t slots = 0;    // the cache's slots (the plan's count of distinct calls, or the default)
  uint64_t built = 0;  // the calls that missed (parameters built), since the process began
};
GroupedGemmParamsCounts grouped_gemm_params_counts();

}  // namespace moecore::emu
