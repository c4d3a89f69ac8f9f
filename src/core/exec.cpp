// The device-independent half of the execution context; creating a CUDA context lives in
// device_cuda.cpp (device_stub_cuda.cpp without the CUDA build).
#include "core/exec.h"

#include "core/check.h"
#include "core/device.h"

namespace moecore {

const Exec& cpu_exec() {
  static const Exec ex{};
  return ex;
}

std::string_view device_name(Device d) {
  return d == Device::CPU ? "cpu" : "cuda";
}

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::CPU;
  if (name == "cuda") return Device::CUDA;
  MOE_FAIL("[exec] --device {}: unknown device; the choices are cpu and cuda", name);
}

Exec make_exec(Device device) {
  if (device == Device::CPU) return cpu_exec();
  return make_cuda_exec();
}

bool training_step_supported(Device device, std::string* why) {
  if (device == Device::CPU) return true;
  if (why) {
    *why =
        "the CUDA kernels of the training step's ops are not written yet (issue 12: the CUDA "
        "backend); train with --device cpu";
  }
  return false;
}

void no_kernel(const Exec& ex, const char* op) {
  MOE_FAIL(
      "[{}] no {} kernel: this op runs on the CPU only so far (issue 12 adds the CUDA "
      "kernels); use --device cpu",
      op, device_name(ex.device));
}

}  // namespace moecore
