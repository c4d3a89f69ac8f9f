// Stream capture on the emulated CUDA device (the emulated CUDA graphs behind core/stream_graph.h;
// tests/emu/device/device_cuda_emu.cpp calls these for cuda_capture_begin / end and
// cuda_graph_launch). The emulated device has one stream per process, so a capture is the
// process's, as CUDA's global capture mode makes it.
//
// While a capture is open, every operation that would run on the stream is recorded instead, in
// order, with its arguments by value: a kernel launch (the kernel, its parameters converted to
// their types and copied, the grid, the block, the dynamic shared memory: tests/emu/cuda_emu.h),
// a copy or set (cudaMemcpyAsync, cudaMemsetAsync: their addresses and byte counts), an emulated
// library call (tests/emu/blas_emu.cpp: the descriptor and the operand addresses). Nothing runs.
// Replaying a graph runs the recorded operations in that order, each with the checks it has when
// it runs eagerly (pointer arguments in device memory, the collectives in flight), reading and
// writing device memory as it is at the replay: a replay of a step equals the eager step exactly
// when nothing the step's host code decides changes between replays.
//
// What a graph cannot contain is an error during the capture (core/sync_audit.h's capture rules
// name it and its call site): the host reading device memory (ops::read_back: a host sync), the
// host waiting for the stream (cudaStreamSynchronize, exec_synchronize), a device allocation
// (device_alloc), a copy from or to pageable host memory (a CUDA graph's copy nodes take device
// and pinned memory).
//
// The emulated NCCL's collectives are recorded too (tests/emu/device/communicator_nccl_emu.cpp):
// each call's plan with its buffers, counts and peers, and each join of its completion onto the
// captured stream (CommHandle::wait_on), in the order the host issued them, so a replay issues
// the same calls in the same groups. As on a GPU, where NCCL runs on the communicator's own
// stream forked from the captured one (an event recorded on it, waited on by the NCCL stream),
// every collective begun in the capture is a fork that must be joined back before the capture
// ends (cudaErrorStreamCaptureUnjoined): one that is not would complete outside the graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace moecore::emu {

// A recorded graph: its operations in order.
struct Graph;

// Whether a capture is open (relaxed: a cheap test on every launch).
bool capturing();
// Opens the capture (an error if one is open).
void capture_begin();
// Closes it: with `keep` returns the graph (*operations set to its size); without, discards the
// recording and returns null. With `keep`, a fork not joined (capture_fork) discards the
// recording and throws naming it; without, it never throws.
Graph* capture_end(bool keep, int64_t* operations);
// Work that leaves the captured stream (an NCCL collective on its communicator's stream), named
// `what` in the error: a token for capture_join, which must come before the capture ends.
int64_t capture_fork(const std::string& what);
void capture_join(int64_t fork);
// Runs a graph's operations in order (a replay inside an open capture is recorded as one
// operation that replays it).
void graph_replay(const Graph& g);
void graph_destroy(Graph* g);

// Appends an operation to the open capture; `what` names it ("kernel add_kernel",
// "cudaMemcpyAsync"). The recording's own allocations are the device's, not the host step's
// (the sync audit does not count them).
void record(const char* what, std::function<void()> op);

// A copy or set of [p, p + bytes) recorded into a capture: an error unless it lies in device or
// pinned host memory (device_memory_emu.h's allocations), naming `who`.
void check_capturable_range(const char* who, const void* p, size_t bytes);

// cudaStreamSynchronize on the emulated device: nothing to wait for (every operation has run),
// but while a capture is open an error (the host cannot wait for a stream being captured).
void stream_synchronize();

}  // namespace moecore::emu
