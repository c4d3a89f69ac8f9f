// The execution context: the backend that runs the ops of a step, with its stream and library
// handles. It is chosen once per process (--device cpu|cuda), planned into the arena with the
// memory it places, held by every layer and optimizer, and passed first to every op in
// src/ops/, whose one small switch calls the CPU fast path or the backend's kernel. Layers never
// branch on the device; the plain-loop `_ref` functions are never dispatched (they are the
// oracle every backend is tested against).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moecore {

enum class Device : uint8_t { CPU, CUDA };

struct Exec {
  Device device = Device::CPU;
  void* stream = nullptr;  // the backend's stream (a cudaStream_t on CUDA); null on the CPU
  bool on_cpu() const { return device == Device::CPU; }
};

// The CPU context: what a component that is not given one runs on.
const Exec& cpu_exec();

std::string_view device_name(Device d);  // "cpu", "cuda"
// "cpu" or "cuda" (as --device spells them) -> the device; anything else names the choices.
Device parse_device(std::string_view name);
// The context for a device. CUDA needs the CUDA build and a visible device: otherwise this is
// an error saying which is missing and how to get it.
Exec make_exec(Device device);
// Whether the whole training step has kernels on this device: the trainer refuses a device
// without them before step 0, naming what is missing.
bool training_step_supported(Device device, std::string* why);

// Where an arena's block lives. Device: where the context's ops run (host memory on the CPU
// backend). PinnedHost: host memory the device can copy to and from asynchronously (the host's
// staging of the step's inputs and report); plain host memory on the CPU backend.
enum class MemSpace : uint8_t { Device, PinnedHost };
std::string_view mem_space_name(MemSpace s);  // "device", "pinned host"
// One zero-filled block of `bytes` (> 0, aligned to 64) in `space` of the context's device;
// throws naming the size when it cannot be had (a host block above host_bytes_available() too). exec_free takes the same context and space.
void* exec_alloc(const Exec& ex, MemSpace space, size_t bytes);
void exec_free(const Exec& ex, MemSpace space, void* p);
// Blocks the host until the context's stream has run everything enqueued on it: the host's one
// wait per step, before it reads the step's report (nothing to wait for on the CPU). `what` names
// the wait in the hang watchdog's report (set_stream_wait_limit).
void exec_synchronize(const Exec& ex, const char* what = "a wait for the stream");

// The hang watchdog of the host's waits on a device stream (exec_synchronize, ops::read_back):
// such a wait polls the stream (cudaStreamQuery) instead of blocking in the driver, against a
// deadline of `seconds` from its start. Past it, with the stream still busy (a kernel that never
// ends; a collective on the stream whose peers never reach it, which the communicator's own
// timeout does not see once the host has moved on), it prints which wait, at which iteration
// (fault::iteration(), the trainer's step), on which process (`who`, e.g. "world rank 3") and how
// long, and ends the process (std::abort, as an NCCL collective's timeout does: mpirun then ends
// the job). The trainer sets it from --distributed-timeout-minutes on a device; 0 (the default)
// leaves the waits unbounded.
void set_stream_wait_limit(double seconds, std::string who);
// Polls idle(arg) (true once the stream has run what was enqueued before the wait; it throws on
// a failed stream) until it holds, under that deadline: the backends' waits on a stream.
void wait_for_stream(const char* what, bool (*idle)(void* arg), void* arg);

// An op reached with a context whose backend has no kernel for it: the error names both.
[[noreturn]] void no_kernel(const Exec& ex, const char* op);

}  // namespace moecore
