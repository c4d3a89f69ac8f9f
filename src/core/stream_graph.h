// CUDA graphs of a context's stream (--cuda-graph-impl full_iteration, train/trainer.cpp): the
// work a function enqueues on the stream, captured once and replayed with one launch.
//
// Capturing records what the work enqueues (each kernel with its arguments by value and its
// grid, each copy, set and library call, in order) without running any of it; a launch runs the
// same operations on the same addresses again. So whatever changes from one launch to the next
// must be read from device memory by those operations (the step's inputs copied into the buffers
// the graph reads before the launch, the dropout counters, the router's jitter step), never passed
// by value or decided by the host inside the captured region: a value passed by value is frozen
// at capture. What a graph cannot contain is refused while capturing, naming it and its call
// site, through the sync audit's capture rules (core/sync_audit.h): a host sync of any kind
// (ops::read_back, CommHandle::wait, a documented sync point such as ops::kGroupedGemmSizes), the
// host waiting for the stream (exec_synchronize), a device allocation (exec_alloc), a copy from
// pageable host memory (the emulated device). NCCL's calls are captured with the work: each on
// its communicator's stream, forked from the captured one and joined back by its handle's
// CommHandle::wait_on inside the region; one left unjoined fails the capture when it ends.
//
// Backends (core/device.h): CUDA's stream capture in the CUDA build (core/device_cuda.cpp:
// cudaStreamBeginCapture in global mode, cudaStreamEndCapture, cudaGraphInstantiate,
// cudaGraphLaunch); the emulated device's recorder (tests/emu/stream_capture_emu.h); none on the
// CPU, whose ops run when they are called (a capture there is an error).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/exec.h"

namespace moecore {

class StreamGraph {
 public:
  StreamGraph() = default;
  ~StreamGraph();
  StreamGraph(StreamGraph&& o) noexcept;
  StreamGraph& operator=(StreamGraph&& o) noexcept;
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  // Captures what `work` enqueues on ex's stream (nothing of it runs); `region` names it in the
  // errors ("the forward and backward of every micro-batch"). An error inside `work` (a capture
  // rule, or its own) ends the capture, discards it and propagates.
  static StreamGraph capture(const Exec& ex, const std::string& region,
                             const std::function<void()>& work);

  // Enqueues one replay on the stream it was captured on (asynchronous, as the work was).
  void launch() const;
  bool empty() const { return graph_ == nullptr; }
  // The operations captured (the graph's nodes).
  int64_t operations() const { return operations_; }

 private:
  Exec ex_;
  void* graph_ = nullptr;  // the backend's instantiated graph
  int64_t operations_ = 0;
};

}  // namespace moecore
