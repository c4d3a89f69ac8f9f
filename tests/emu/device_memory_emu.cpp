// Emulated device memory kept apart from the host (device_memory_emu.h): mmap'd regions toggled
// between PROT_NONE and read-write by DeviceAccess, and a SIGSEGV handler that names a host access
// to them.
#include "emu/device_memory_emu.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/sync_audit.h"

namespace moecore::emu {

namespace {

struct Region {
  size_t bytes = 0;   // as asked for
  size_t mapped = 0;  // rounded up to pages
  bool pinned = false;
};

// A collective's buffer in flight (device_memory_emu.h).
struct Pending {
  uint64_t ticket = 0;
  uintptr_t lo = 0, hi = 0;  // bytes [lo, hi)
  PendingUse use = PendingUse::Recv;
  std::string what;
};

struct State {
  std::mutex mu;
  std::map<uintptr_t, Region> regions;  // by base address
  std::vector<Pending> pending;         // few at a time: a linear search
  uint64_t next_ticket = 1;
  std::atomic<size_t> pending_count{0};  // read without the mutex: free when none
  int access_depth = 0;                 // live DeviceAccess objects
  bool mode_fixed = false;
  DeviceMemoryMode mode = DeviceMemoryMode::Shared;
};

State& state() {
  static State* s = new State;  // never destroyed: frees may come during static destruction
  return *s;
}

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// The region holding address a, if any (the caller holds the mutex, or is the signal handler).
const std::pair<const uintptr_t, Region>* find_region(const State& s, uintptr_t a) {
  auto it = s.regions.upper_bound(a);
  if (it == s.regions.begin()) return nullptr;
  --it;
  return a < it->first + it->second.mapped ? &*it : nullptr;
}

void protect(uintptr_t base, const Region& r, bool accessible) {
  if (r.pinned) return;
  const int rc = mprotect(reinterpret_cast<void*>(base), r.mapped,
                          accessible ? PROT_READ | PROT_WRITE : PROT_NONE);
  MOE_CHECK(rc == 0, "[emu] mprotect of {} bytes of emulated device memory failed: {}", r.mapped,
            std::strerror(errno));
}

void write_str(std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = write(STDERR_FILENO, s.data(), s.size());
    if (n <= 0) return;
    s.remove_prefix(static_cast<size_t>(n));
  }
}

// Decimal or hex digits of v into buf (async-signal-safe).
std::string_view digits(char* buf, size_t cap, uint64_t v, unsigned base) {
  size_t i = cap;
  do {
    buf[--i] = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0 && i > 0);
  return std::string_view(buf + i, cap - i);
}

struct sigaction g_previous;

void on_segv(int sig, siginfo_t* info, void* context) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  const auto* r = find_region(state(), a);
  if (r != nullptr && !r->second.pinned) {
    char b1[32], b2[32], b3[32];
    write_str("[emu] the host touched emulated device memory at 0x");
    write_str(digits(b1, sizeof b1, a, 16));
    write_str(" (byte ");
    write_str(digits(b2, sizeof b2, a - r->first, 10));
    write_str(" of a device allocation of ");
    write_str(digits(b3, sizeof b3, r->second.bytes, 10));
    write_str(
        " bytes) outside a kernel, a copy or a library call: on a GPU this is an illegal access. "
        "Host code moves device memory with ops::copy / ops::read_back. Backtrace (addr2line -e "
        "the binary for lines):\n");
    void* frames[64];
    const int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
  }
  // Not ours, or reported: the previous handler (the default: the process dies of SIGSEGV).
  sigaction(SIGSEGV, &g_previous, nullptr);
  if (r == nullptr && (g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  raise(sig);
}

void install_handler() {
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not inside the handler
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
}

void fix_mode(State& s) {
  if (s.mode_fixed) return;
  s.mode_fixed = true;
  const char* env = std::getenv("MOECORE_EMU_DEVICE_MEMORY");
  const std::string_view v = env ? env : "strict";
  MOE_CHECK(v == "strict" || v == "shared",
            "[emu] MOECORE_EMU_DEVICE_MEMORY={}: strict (the default: device memory apart from "
            "the host) or shared (device memory is host memory)",
            v);
  s.mode = v == "strict" ? DeviceMemoryMode::Strict : DeviceMemoryMode::Shared;
  if (s.mode == DeviceMemoryMode::Strict) install_handler();
}

}  // namespace

DeviceMemoryMode device_memory_mode() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  fix_mode(s);
  return s.mode;
}

void* device_alloc(size_t bytes, bool pinned) {
  // Inside a stream capture: an error naming it (cudaMalloc is not capturable).
  SyncAudit::instance().device_allocation(pinned ? "emulated pinned host memory (cudaMallocHost)"
                                                 : "emulated device memory (cudaMalloc)",
                                          bytes);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  fix_mode(s);
  const size_t page = page_size();
  const size_t mapped = std::max<size_t>(page, (bytes + page - 1) / page * page);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MOE_CHECK(p != MAP_FAILED, "[emu] cannot map {} bytes of emulated {} memory: {}", mapped,
            pinned ? "pinned host" : "device", std::strerror(errno));
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const Region r{bytes, mapped, pinned};
  s.regions.emplace(base, r);
  if (s.mode == DeviceMemoryMode::Strict && s.access_depth == 0) protect(base, r, false);
  return p;
}

void device_free(void* p) {
  if (p == nullptr) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.regions.find(reinterpret_cast<uintptr_t>(p));
  MOE_CHECK(it != s.regions.end(), "[emu] free of {} which is no emulated device allocation", p);
  munmap(p, it->second.mapped);
  s.regions.erase(it);
}

bool in_allocation(const void* p, size_t bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const auto* r = find_region(s, a);
  return r != nullptr && a + bytes <= r->first + r->second.bytes;
}

DeviceAccess::DeviceAccess() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.access_depth++ == 0 && s.mode == DeviceMemoryMode::Strict) {
    for (const auto& [base, r] : s.regions) protect(base, r, true);
  }
}

DeviceAccess::~DeviceAccess() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (--s.access_depth == 0 && s.mode == DeviceMemoryMode::Strict) {
    for (const auto& [base, r] : s.regions) protect(base, r, false);
  }
}

namespace {

// The first pending range overlapping [lo, hi) that the access may not touch: a receive range
// always, a send range when written (the caller holds the mutex).
const Pending* conflict(const State& s, uintptr_t lo, uintptr_t hi, bool writes) {
  const Pending* found = nullptr;
  for (const Pending& p : s.pending) {
    if (!(lo < p.hi && p.lo < hi)) continue;
    if (p.use == PendingUse::Recv) return &p;  // the stricter rule names it first
    if (writes && found == nullptr) found = &p;
  }
  return found;
}

[[noreturn]] void report_conflict(std::string_view who, const Pending& p) {
  if (p.use == PendingUse::Recv) {
    MOE_FAIL(
        "[emu] {} touches the receive buffer of {} (bytes [{:#x}, {:#x})) before the "
        "collective completed: a missing wait. Complete it first (CommHandle::wait, "
        "wait_on(ex) before the ops that read it, or a test() that returned true)",
        who, p.what, p.lo, p.hi);
  }
  MOE_FAIL(
      "[emu] {} writes into the send buffer of {} (bytes [{:#x}, {:#x})): send buffer "
      "reused before the collective completed. Wait for the collective (CommHandle::wait "
      "or wait_on) before writing its send buffer",
      who, p.what, p.lo, p.hi);
}

}  // namespace

void check_kernel_pointer(const char* kernel, int index, const void* p, bool writes) {
  if (p == nullptr) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.mode != DeviceMemoryMode::Strict) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const auto* r = find_region(s, a);
  // One past the end of an allocation is a valid (empty) range too.
  const auto* before = a > 0 ? find_region(s, a - 1) : nullptr;
  MOE_CHECK(r != nullptr || (before != nullptr && a == before->first + before->second.bytes),
            "[emu] kernel {}: pointer argument {} ({}) points into no device or pinned "
            "allocation: a host pointer handed to a kernel, an illegal address on a GPU",
            kernel, index, p);
  if (s.pending_count.load(std::memory_order_relaxed) == 0) return;
  // The kernel's reach is unknown: its first element stands for it.
  if (const Pending* c = conflict(s, a, a + 1, writes)) {
    report_conflict(fmt::format("kernel {} (pointer argument {}, {}{})", kernel, index, p,
                                writes ? ", not const: written" : ", const: read"),
                    *c);
  }
}

uint64_t pending_begin(const void* p, size_t bytes, PendingUse use, std::string what) {
  if (bytes == 0 || p == nullptr) return 0;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.mode != DeviceMemoryMode::Strict) return 0;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  const uint64_t ticket = s.next_ticket++;
  s.pending.push_back(Pending{ticket, lo, lo + bytes, use, std::move(what)});
  s.pending_count.store(s.pending.size(), std::memory_order_relaxed);
  return ticket;
}

void pending_end(uint64_t ticket) {
  if (ticket == 0) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::erase_if(s.pending, [ticket](const Pending& p) { return p.ticket == ticket; });
  s.pending_count.store(s.pending.size(), std::memory_order_relaxed);
}

void check_pending(const char* who, const void* p, size_t bytes, bool writes) {
  State& s = state();
  if (bytes == 0 || s.pending_count.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(s.mu);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  if (const Pending* c = conflict(s, lo, lo + bytes, writes)) report_conflict(who, *c);
}

void check_collective_buffer(const std::string& call, const char* arg, const void* p,
                             size_t bytes) {
  if (bytes == 0) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.mode != DeviceMemoryMode::Strict) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const auto* r = find_region(s, a);
  const char* what = r == nullptr       ? "host memory"
                     : r->second.pinned ? "pinned host memory"
                     : a + bytes > r->first + r->second.bytes
                         ? "a range running past the end of its device allocation"
                         : nullptr;
  MOE_CHECK(what == nullptr,
            "[emu] {}: argument '{}' ({}, {} bytes) is {}: NCCL takes device memory only; "
            "allocate the buffer on the device (MemSpace::Device) and stage host data through "
            "ops::copy",
            call, arg, p, bytes, what);
}

void check_device_range(std::string_view who, const void* p, size_t bytes) {
  if (bytes == 0) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const auto* r = find_region(s, a);
  const char* what = r == nullptr       ? "host memory (no device allocation)"
                     : r->second.pinned ? "pinned host memory"
                     : a + bytes > r->first + r->second.bytes
                         ? "a range running past the end of its device allocation"
                         : nullptr;
  MOE_CHECK(what == nullptr,
            "[emu] {}: bytes [{}, +{}) are {}: a library call reads and writes device memory "
            "only, each range inside one allocation (allocation [{:#x}, +{}))",
            who, p, bytes, what, r == nullptr ? uintptr_t{0} : r->first,
            r == nullptr ? size_t{0} : r->second.bytes);
}

}  // namespace moecore::emu
