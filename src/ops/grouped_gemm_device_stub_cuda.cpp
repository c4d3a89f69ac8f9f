// The device-table grouped GEMM (ops/cuda/grouped_gemm_device.h) in a build without one: the CPU
// build, and a CUDA build until its CUTLASS kernel is compiled in. Callers ask
// device_grouped_gemm_supported first and keep the host-table path.
#include "core/check.h"
#include "ops/cuda/grouped_gemm_device.h"

namespace moecore::ops::cuda {

bool device_grouped_gemm_supported(desc::GemmTypes, int64_t, int64_t, std::string* why) {
  if (why != nullptr) *why = "this build has no grouped GEMM that reads its sizes on the device";
  return false;
}

size_t device_grouped_gemm_workspace_bytes(int64_t) { return 0; }

void device_grouped_gemm_reserve_calls(int64_t) {}  // no parameters to keep

void device_grouped_gemm(const Exec&, desc::GemmTypes, const GroupedGemmProblem*, int64_t, float,
                         void*, size_t) {
  MOE_CHECK(false,
            "[gemm] this build has no grouped GEMM that reads its sizes on the device: the "
            "caller must take the host-table path (device_grouped_gemm_supported)");
}

}  // namespace moecore::ops::cuda
