// The device-independent half of the execution context; creating a CUDA context lives in
// device_cuda.cpp (device_stub_cuda.cpp without the CUDA build).
#include "core/exec.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/check.h"
#include "core/device.h"
#include "core/fault_injection.h"
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

namespace {
// The stream-wait watchdog's setting (one execution context per process).
double g_stream_wait_limit_s = 0;
std::string g_stream_wait_who;

bool cuda_idle(void* ex) {
  return cuda_stream_idle(*static_cast<const Exec*>(ex));
}
}  // namespace

void set_stream_wait_limit(double seconds, std::string who) {
  MOE_CHECK(seconds >= 0, "[exec] a stream wait limit of {} s", seconds);
  g_stream_wait_limit_s = seconds;
  g_stream_wait_who = std::move(who);
}

void wait_for_stream(const char* what, bool (*idle)(void*), void* arg) {
  if (idle(arg)) return;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // A short spin for the common wait (a step's tail), then sleeps: a hung stream costs no core.
  for (int polls = 1;; ++polls) {
    if (idle(arg)) return;
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    const double limit = g_stream_wait_limit_s;
    if (limit > 0 && waited > limit) {
      const int64_t it = fault::iteration();
      const std::string at = it >= 0 ? "at iteration " + std::to_string(it) : "outside a step";
      const std::string who = g_stream_wait_who.empty() ? "this process" : g_stream_wait_who;
      std::fprintf(stderr,
                   "error: [exec] timeout: %s waited %.1f s for its device stream in %s, %s, "
                   "over the %.1f s limit (--distributed-timeout-minutes): the stream has not run "
                   "what was enqueued before the wait (a kernel that does not end, or a "
                   "collective on the stream whose peers never reached it); ending the process\n",
                   who.c_str(), waited, what, at.c_str(), limit);
      std::fflush(stderr);
      std::fflush(stdout);
      std::abort();
    }
    if (polls < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void exec_synchronize(const Exec& ex, const char* what) {
  if (ex.on_cpu()) return;
  SyncAudit::instance().not_capturable("exec_synchronize: the host waits for the stream");
  wait_for_stream(what, cuda_idle, const_cast<Exec*>(&ex));
}

void no_kernel(const Exec& ex, const char* op) {
  MOE_FAIL(
      "[{}] no {} kernel in this build: this op runs on the CPU only so far; use --device cpu",
      op, device_name(ex.device));
}

}  // namespace moecore
