// The sync audit (`moecore train --sync-audit`): evidence that a training step never waits for
// the host. While an audited step runs, the events a captured step could not contain are
// recorded with their call site (a symbolised backtrace):
//   - a heap allocation (global operator new, any thread): a step allocates nothing;
//   - a host synchronisation that is not one of the documented sync points (host_sync()).
// A documented sync point (dropless EP's count exchange: the host needs the counts to size the
// all-to-all) is declared by its site with a name, and counted, not hidden. At the end of the
// step, end_step() throws naming every violation's kind, count and first call site.
// The host writing the step's inputs (token ids) is outside the audit (Paused).
// On the CPU backend the buffers are host memory, so a host read of step data is not an event
// the audit can see; on a device backend every device-to-host copy goes through host_sync().
//
// The same events decide what a CUDA graph may capture (core/stream_graph.h): while a stream is
// being captured (begin_capture .. end_capture), every host sync (a documented point's too: a
// replayed graph cannot stop for the host), a device allocation and the host waiting for the
// stream are errors at once, naming the event, the captured region and the call site. Paused
// does not lift that: it silences the step's audit, not a capture's rules.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moecore {

class SyncAudit {
 public:
  // The documented count of the allocations oneDNN's sgemm makes inside its calls.
  static constexpr const char* kBlasAllocations = "CPU BLAS (oneDNN sgemm) internal allocations";
  // The documented sync points (docs/design.md, "The execution model").
  static constexpr const char* kEpCountExchange =
      "dropless EP count exchange (the host sizes the all-to-all)";
  static constexpr const char* kEpTokenCounts = "allgather dispatcher token counts per EP rank";
  // Not a sync a stream-ordered backend has: CommHandle::wait_on, where the MPI backend completes
  // the collective on the host before the ops of a stream read its result.
  static constexpr const char* kHostCommWait =
      "collectives completed on the host for a stream's ops (the MPI backend; NCCL orders them "
      "on the stream)";
  struct Violation {
    std::string kind;   // "allocation", "host sync"
    std::string where;  // the first call site seen, symbolised
    int64_t count = 0;
  };

  // The audit of this process (one trainer per process).
  static SyncAudit& instance();

  // Arms recording until end_step(); only one step is audited at a time.
  void begin_step();
  // Disarms and throws moecore::Error listing every violation of the step, if any.
  void end_step();
  // Disarms without reporting (a step left by an exception).
  void end_step_quietly();
  bool in_step() const;

  // While alive, the audit records nothing (the host preparing the step's inputs).
  class Paused {
   public:
    Paused();
    ~Paused();
    Paused(const Paused&) = delete;
    Paused& operator=(const Paused&) = delete;

   private:
    bool was_armed_;
  };

  // Called by the code that makes the host wait for, or read, the step's data. `documented`
  // names a documented sync point (docs/design.md): counted per name; otherwise a violation,
  // unless it happens inside a Point (it is then part of that point).
  void host_sync(const char* what, const char* documented = nullptr);

  // The scope of one documented sync point: counted once per scope, and the host syncs inside
  // it (the collective's host wait, the host's read of what it returns) belong to it. Points
  // nest: the innermost one owns the syncs.
  class Point {
   public:
    explicit Point(const char* documented);
    ~Point();
    Point(const Point&) = delete;
    Point& operator=(const Point&) = delete;

   private:
    const char* outer_;
  };

  // ---- stream capture (core/stream_graph.h) ----
  // Arms the capture rules until end_capture(); `region` names what is captured in the errors.
  // One capture at a time, in the whole process (CUDA's global capture mode).
  void begin_capture(const std::string& region);
  void end_capture();
  bool capturing() const { return capturing_.load(std::memory_order_relaxed); }
  // A device allocation (exec_alloc; the emulated device's memory): while capturing, an error.
  void device_allocation(const char* what, std::size_t bytes);
  // A call a graph cannot contain that is not a host read (the host waiting for the stream, a
  // copy from pageable host memory): while capturing, an error naming `what`.
  void not_capturable(const char* what);

  // Counts of the last audited step.
  int64_t allocations() const { return allocations_; }
  const std::map<std::string, int64_t>& documented_syncs() const { return documented_; }
  const std::vector<Violation>& violations() const { return violations_; }

  // From the global operator new (sync_audit.cpp).
  void on_allocation(std::size_t bytes);

 private:
  void record(const std::string& kind, void* const* frames, int n, int skip_frames);
  // Throws the capture error: `kind` and `what` at the caller's call site.
  [[noreturn]] void capture_error(const std::string& kind, const std::string& what);

  std::atomic<bool> capturing_{false};
  std::string region_;  // what is being captured

  int64_t allocations_ = 0;
  std::map<std::string, int64_t> documented_;
  std::vector<Violation> violations_;
};

}  // namespace moecore
