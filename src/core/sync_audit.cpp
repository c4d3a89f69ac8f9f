// The sync audit's recording, and the global operator new that reports allocations to it. With
// no audited step running, operator new costs one relaxed atomic load over malloc.
#include "core/sync_audit.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "core/check.h"

namespace moecore {
namespace {

std::atomic<bool> g_armed{false};
std::mutex g_mutex;                  // recording from several threads
thread_local bool t_recording = false;  // a recording's own allocations are not events
thread_local const char* t_point = nullptr;  // the documented point this thread is inside
constexpr int kFrames = 16;

// "module(mangled+0x12) [0x...]" -> "demangled+0x12" where the frame has a symbol.
std::string symbolise(char* frame) {
  std::string s(frame);
  const size_t open = s.find('('), plus = s.find('+', open == std::string::npos ? 0 : open);
  if (open == std::string::npos || plus == std::string::npos || plus == open + 1) return s;
  const std::string mangled = s.substr(open + 1, plus - open - 1);
  int status = 0;
  char* name = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? std::string(name) : mangled;
  std::free(name);
  return out + s.substr(plus, s.find(')', plus) - plus);
}

}  // namespace

SyncAudit& SyncAudit::instance() {
  static SyncAudit* audit = new SyncAudit();  // never destroyed: operator new may outlive main
  return *audit;
}

void SyncAudit::begin_step() {
  MOE_CHECK(!g_armed.load(), "[sync-audit] a step is already being audited");
  allocations_ = 0;
  documented_.clear();
  violations_.clear();
  g_armed.store(true);
}

void SyncAudit::end_step_quietly() { g_armed.store(false); }

bool SyncAudit::in_step() const { return g_armed.load(std::memory_order_relaxed); }

void SyncAudit::end_step() {
  g_armed.store(false);
  if (violations_.empty()) return;
  std::string msg = "[sync-audit] the step did what a captured step cannot:";
  for (const Violation& v : violations_) {
    msg += fmt::format("\n  {} x{} at:\n{}", v.kind, v.count, v.where);
  }
  MOE_FAIL("{}", msg);
}

SyncAudit::Paused::Paused() : was_armed_(g_armed.exchange(false)) {}
SyncAudit::Paused::~Paused() { g_armed.store(was_armed_); }

SyncAudit::Point::Point(const char* documented) : outer_(t_point) {
  SyncAudit::instance().host_sync("a documented point", documented);
  t_point = documented;
}

SyncAudit::Point::~Point() { t_point = outer_; }

void SyncAudit::host_sync(const char* what, const char* documented) {
  if (capturing() && !t_recording) {
    capture_error("a host sync", documented != nullptr
                                     ? fmt::format("{} (a documented sync point)", documented)
                                     : std::string(what));
  }
  if (!in_step() || t_recording) return;
  if (documented == nullptr && t_point != nullptr) return;  // part of the point
  t_recording = true;  // what this records allocates: not an event
  if (documented != nullptr) {
    std::lock_guard<std::mutex> lock(g_mutex);
    ++documented_[documented];
  } else {
    void* frames[kFrames];
    const int n = backtrace(frames, kFrames);
    std::lock_guard<std::mutex> lock(g_mutex);
    record(std::string("host sync: ") + what, frames, n, 1);
  }
  t_recording = false;
}

void SyncAudit::on_allocation(std::size_t) {
  if (t_recording) return;
  t_recording = true;
  // The stack is walked before the lock is taken (the unwinder takes the loader's lock).
  void* frames[kFrames];
  const int n = backtrace(frames, kFrames);
  // oneDNN's sgemm (the CPU backend's BLAS) allocates its packing buffers inside each call: a
  // property of that library, counted apart and reported, not a moecore buffer. (A device
  // backend's GEMM library runs on a workspace planned in the arena and allocates nothing.)
  bool in_blas = false;
  for (int i = 2; i < n && i < 6 && !in_blas; ++i) {
    Dl_info info;
    in_blas = dladdr(frames[i], &info) != 0 && info.dli_fname != nullptr &&
              std::strstr(info.dli_fname, "libdnnl") != nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (in_blas) {
      ++documented_[kBlasAllocations];
    } else {
      ++allocations_;
      record("allocation", frames, n, 2);
    }
  }
  t_recording = false;
}

void SyncAudit::begin_capture(const std::string& region) {
  MOE_CHECK(!capturing(),
            "[cuda-graph] capturing {} while {} is being captured: one capture at "
            "a time",
            region, region_);
  region_ = region;
  capturing_.store(true);
}

void SyncAudit::end_capture() {
  capturing_.store(false);
}

void SyncAudit::device_allocation(const char* what, std::size_t bytes) {
  if (!capturing() || t_recording) return;
  capture_error("a device allocation", fmt::format("{} bytes of {}", bytes, what));
}

void SyncAudit::not_capturable(const char* what) {
  if (!capturing() || t_recording) return;
  capture_error("a call a graph cannot contain", what);
}

void SyncAudit::capture_error(const std::string& kind, const std::string& what) {
  // The stack first (the caller's site), then the message; what it allocates is not an event.
  t_recording = true;
  void* frames[kFrames];
  const int n = backtrace(frames, kFrames);
  char** names = backtrace_symbols(frames, n);
  std::string where;
  for (int i = 2; i < n && i < 12; ++i) {
    where += "    " + (names ? symbolise(names[i]) : std::string("?")) + "\n";
  }
  std::free(names);
  t_recording = false;
  MOE_FAIL(
      "[cuda-graph] {} inside the captured {}: {}. A CUDA graph replays the stream's work "
      "without the host, so it cannot contain it (docs/gpu.md, \"CUDA graphs\"); keep it out "
      "of the captured region, or train without --cuda-graph-impl. At:\n{}",
      kind, region_, what, where);
}

// Under g_mutex, with t_recording set.
void SyncAudit::record(const std::string& kind, void* const* frames, int n, int skip_frames) {
  char** names = backtrace_symbols(frames, n);
  std::string where;
  for (int i = skip_frames; i < n && i < skip_frames + 10; ++i) {
    where += "    " + (names ? symbolise(names[i]) : std::string("?")) + "\n";
  }
  std::free(names);
  for (Violation& v : violations_) {
    if (v.kind == kind && v.where == where) {
      ++v.count;
      return;
    }
  }
  violations_.push_back(Violation{kind, where, 1});
}

}  // namespace moecore

// The global allocation functions (the sized/aligned/nothrow forms keep their defaults, which
// either call these or bypass them: an allocation through them is not seen).
void* operator new(std::size_t n) {
  if (moecore::g_armed.load(std::memory_order_relaxed)) {
    moecore::SyncAudit::instance().on_allocation(n);
  }
  if (n == 0) n = 1;
  for (;;) {
    if (void* p = std::malloc(n)) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw std::bad_alloc();
    h();
  }
}

void* operator new[](std::size_t n) { return ::operator new(n); }

// Their partners: what the library's would do (free), written here so that the replaced new and
// its delete are visibly a malloc/free pair (GCC's -Wmismatched-new-delete sees through the
// inlined new to malloc, and cannot see the library's delete).
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
