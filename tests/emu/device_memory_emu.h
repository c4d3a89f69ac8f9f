// The emulated CUDA build's device memory (tests/emu/device/device_cuda_emu.cpp allocates through
// it): host pages, but kept apart from the host as a GPU's are, so that code which would fail on a
// GPU fails here too.
//
// In strict mode (the default of the emulated device; MOECORE_EMU_DEVICE_MEMORY=shared turns it
// off) device allocations are mapped PROT_NONE except while a kernel, a copy or set, or an
// emulated library call runs (DeviceAccess), so a host read or write of device memory anywhere else
// stops the process with the address, the allocation and a backtrace; and every pointer argument
// of a kernel must point into device or pinned host memory (a host pointer handed to a kernel is
// an error naming the kernel and the argument). Pinned host memory stays readable by both, as on
// a GPU. In shared mode device memory is plain host memory and kernels may take host pointers (the
// grid emulator's own tests, which hand kernels host buffers, run so).
//
// Collectives in flight (the emulated NCCL, strict mode): the buffers a collective was handed
// must be device allocations, and until the collective is completed (CommHandle::wait, wait_on
// or a test() that returned true) its receive range is inaccessible and its send range read-only
// to kernels, copies and sets. A kernel's pointer argument is checked at its address (the
// emulator cannot know how far the kernel reaches): pointing into a pending receive range is a
// missing wait; pointing into a pending send range, through a non-const pointer parameter, is a
// send buffer reused too early. Copies and sets are checked over their whole byte ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moecore::emu {

enum class DeviceMemoryMode { Shared, Strict };
// The mode of the process: Strict unless MOECORE_EMU_DEVICE_MEMORY=shared, fixed by the first
// call of this or of device_alloc (the emulated device calls it when it creates a context);
// Shared until then, so a process that never asks (the grid emulator's tests) hands kernels
// host buffers freely.
DeviceMemoryMode device_memory_mode();

// Zero-filled, page-aligned (so 256-byte aligned, as cudaMalloc's) memory; `pinned`: host memory
// the device may read (cudaMallocHost), never protected.
void* device_alloc(size_t bytes, bool pinned);
void device_free(void* p);

// Whether [p, p + bytes) lies inside one allocation of device_alloc (device or pinned).
bool in_allocation(const void* p, size_t bytes);

// While one lives (on any thread; nested freely), device memory is readable and writable: the
// emulator's launches, the runtime's copies and sets, and the emulated library calls hold one.
class DeviceAccess {
 public:
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};

// Strict mode: throws moecore::Error unless p is null or points into device or pinned memory,
// and if p points into a pending collective's receive range, or (`writes`: a non-const pointer
// parameter) into its send range. `index`: the argument's position in the kernel's parameter
// list (from 0).
void check_kernel_pointer(const char* kernel, int index, const void* p, bool writes);

// ---- collectives in flight (strict mode; the emulated NCCL) ----
enum class PendingUse : uint8_t {
  Recv,  // the collective writes it: inaccessible until completion
  Send,  // the collective reads it: read-only until completion
};
// Registers [p, p + bytes) of the collective `what` ("all_reduce on group 'tp'"); returns the
// ticket that ends it (0: nothing registered: shared mode or no bytes).
uint64_t pending_begin(const void* p, size_t bytes, PendingUse use, std::string what);
void pending_end(uint64_t ticket);
// Throws naming `who` (a copy, a set, a collective) if [p, p + bytes) overlaps a pending receive
// range, or (`writes`) a pending send range. Free when nothing is pending.
void check_pending(const char* who, const void* p, size_t bytes, bool writes);
// Strict mode: throws unless [p, p + bytes) lies inside one device allocation (not pinned host
// memory, not the host's): NCCL takes device buffers. `call`: "all_reduce on group 'tp'";
// `arg`: the argument's name ("send", "recv", "data").
void check_collective_buffer(const std::string& call, const char* arg, const void* p,
                             size_t bytes);

// In every mode: throws unless [p, p + bytes) lies inside one device allocation (not pinned host
// memory, not the host's, not across two allocations). For the ranges a library call reaches
// through a table in device memory (the device-table grouped GEMM,
// tests/emu/grouped_gemm_device_emu.cpp), which no check of a kernel's pointer arguments sees.
// `who` names the call and the range ("device grouped GEMM: problem 3's A"). bytes 0: no check.
void check_device_range(std::string_view who, const void* p, size_t bytes);

}  // namespace moecore::emu
