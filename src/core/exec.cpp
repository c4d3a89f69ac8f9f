// The device-independent half of the execution context; creating a CUDA context lives in
// device_cuda.cpp (device_stub_cuda.cpp without the CUDA build).
#include "core/exec.h"

#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "core/device.h"
#include "core/host_memory.h"
#include "core/sync_audit.h"

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

std::string_view mem_space_name(MemSpace s) {
  return s == MemSpace::Device ? "device" : "pinned host";
}

void* exec_alloc(const Exec& ex, MemSpace space, size_t bytes) {
  MOE_CHECK(bytes > 0, "[exec] a {} block of 0 bytes", mem_space_name(space));
  if (!ex.on_cpu()) {
    // Inside a captured stream region: an error naming it (core/stream_graph.h).
    SyncAudit::instance().device_allocation(space == MemSpace::Device
                                                ? "device memory (exec_alloc)"
                                                : "pinned host memory (exec_alloc)",
                                            bytes);
    return cuda_alloc(ex, space, bytes);
  }
  constexpr size_t kAlign = 64;
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;  // aligned_alloc's contract
  const int64_t available = host_bytes_available();
  MOE_CHECK(available == 0 || rounded <= static_cast<uint64_t>(available),
            "[memory] {} of host memory is needed in one block but {} is available on this "
            "machine: lower --micro-batch-size, --seq-length or the model's sizes, or spread the "
            "model over more ranks (`moecore plan` with the same flags shows the memory per rank)",
            format_bytes(static_cast<double>(rounded)), format_bytes(static_cast<double>(available)));
  void* p = std::aligned_alloc(kAlign, rounded);
  MOE_CHECK(p != nullptr,
            "[memory] cannot allocate {} of host memory: lower --micro-batch-size, --seq-length "
            "or the model's sizes",
            format_bytes(static_cast<double>(rounded)));
  std::memset(p, 0, rounded);
  return p;
}

void exec_free(const Exec& ex, MemSpace space, void* p) {
  if (p == nullptr) return;
  if (!ex.on_cpu()) return cuda_free(ex, space, p);
  std::free(p);
}

void exec_synchronize(const Exec& ex) {
  if (ex.on_cpu()) return;
  SyncAudit::instance().not_capturable("exec_synchronize: the host waits for the stream");
  cuda_synchronize(ex);
}

void no_kernel(const Exec& ex, const char* op) {
  MOE_FAIL(
      "[{}] no {} kernel in this build: this op runs on the CPU only so far; use --device cpu",
      op, device_name(ex.device));
}

}  // namespace moecore
