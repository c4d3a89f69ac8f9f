// The grid emulator's scheduler (cuda_emu.h): blocks one after another, a block's threads as
// ucontext fibers on the calling OS thread, switched only where a thread waits (barrier, warp
// collective) or exits. Between switches nothing else runs, so atomics need no locking.
#include "emu/cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/sync_audit.h"

#ifdef MOECORE_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace moecore::emu {

namespace {

// A fiber's stack: ASan's redzones and fake frames need more room.
#ifdef MOECORE_EMU_ASAN
constexpr size_t kStackBytes = size_t(512) << 10;
#else
constexpr size_t kStackBytes = size_t(128) << 10;
#endif
constexpr size_t kSmemGuard = 64;  // poisoned bytes on each side of the dynamic shared memory
constexpr unsigned char kSmemGuardByte = 0xA5;
constexpr unsigned char kSmemPoisonByte = 0xFF;  // NaN in every float lane: unwritten reads show

using detail::Collective;

enum class State : uint8_t { Runnable, AtBarrier, AtWarp, Exited };

struct Fiber {
  ucontext_t ctx;
  uint3 idx{};
  int id = 0;  // linear thread index in the block
  State state = State::Runnable;
  std::source_location where;  // of the barrier or collective it waits at
  Collective kind = Collective::SyncWarp;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
  void* stack = nullptr;
  void* fake_stack = nullptr;  // ASan's, while switched out
};

// Stacks with a PROT_NONE page below each, so an overflow faults; kept for the thread's launches.
struct StackPool {
  std::vector<void*> stacks;
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  void* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      MOE_CHECK(p != MAP_FAILED, "[emu] cannot map a fiber stack of {} bytes", kStackBytes);
      mprotect(p, page, PROT_NONE);
      stacks.push_back(static_cast<char*>(p) + page);
    }
    return stacks[i];
  }
  ~StackPool() {
    for (void* s : stacks) munmap(static_cast<char*>(s) - page, kStackBytes + page);
  }
};

// One launch in progress on this OS thread.
struct Grid {
  const char* name = "";
  dim3 grid, block;
  uint3 block_idx{};
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  ucontext_t scheduler;
  unsigned char* smem = nullptr;  // the block's dynamic shared memory
  size_t smem_bytes = 0;
  std::string error;  // set by a fiber that found an error before switching back
#ifdef MOECORE_EMU_ASAN
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_bytes = 0;
#endif
};

thread_local Grid* t_grid = nullptr;
thread_local ResumeOrder t_order = ResumeOrder::Forward;
thread_local uint64_t t_seed = 0;
thread_local Stats t_stats;
thread_local StackPool t_stacks;

Grid& grid() {
  if (t_grid == nullptr || t_grid->current == nullptr) {
    MOE_FAIL(
        "[emu] a CUDA built-in (threadIdx, __syncthreads, a shuffle, ...) used outside a "
        "kernel launched through the emulator");
  }
  return *t_grid;
}

std::string site(const std::source_location& w) {
  std::string file = w.file_name();
  const size_t slash = file.rfind('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return fmt::format("{}:{}", file, w.line());
}

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::SyncWarp:
      return "__syncwarp";
    case Collective::Shfl:
      return "__shfl_sync";
    case Collective::ShflUp:
      return "__shfl_up_sync";
    case Collective::ShflDown:
      return "__shfl_down_sync";
    case Collective::ShflXor:
      return "__shfl_xor_sync";
    case Collective::Ballot:
      return "__ballot_sync";
  }
  return "?";
}

// Switches from the running fiber to the scheduler; returns when the scheduler resumes it.
void switch_to_scheduler(Grid& g, Fiber& f, bool exiting) {
#ifdef MOECORE_EMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, g.scheduler_stack,
                                 g.scheduler_stack_bytes);
#endif
  swapcontext(&f.ctx, &g.scheduler);
#ifdef MOECORE_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void resume(Grid& g, Fiber& f) {
  g.current = &f;
  ++t_stats.switches;
#ifdef MOECORE_EMU_ASAN
  __sanitizer_start_switch_fiber(&g.scheduler_fake_stack, f.stack, kStackBytes);
#endif
  swapcontext(&g.scheduler, &f.ctx);
#ifdef MOECORE_EMU_ASAN
  __sanitizer_finish_switch_fiber(g.scheduler_fake_stack, nullptr, nullptr);
#endif
  g.current = nullptr;
}

void fiber_main() {
  Grid& g = *t_grid;
#ifdef MOECORE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.scheduler_stack, &g.scheduler_stack_bytes);
#endif
  g.body(g.arg);
  Fiber& f = *g.current;
  f.state = State::Exited;
  switch_to_scheduler(g, f, /*exiting=*/true);
  __builtin_unreachable();
}

// Reports an error found inside a fiber: never throws across a context switch.
[[noreturn]] void fiber_error(Grid& g, std::string msg) {
  g.error = std::move(msg);
  Fiber& f = *g.current;
  f.state = State::Exited;
  switch_to_scheduler(g, f, /*exiting=*/true);
  __builtin_unreachable();
}

std::string where_block(const Grid& g) {
  return fmt::format("[emu] kernel {} block ({},{},{})", g.name, g.block_idx.x, g.block_idx.y,
                     g.block_idx.z);
}

// "0-15, 17, 20-31"
std::string ranges(const std::vector<int>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", ids[i]) : fmt::format("{}-{}", ids[i], ids[j]);
    i = j + 1;
  }
  return out;
}

// Who waits where, for a deadlock message: "threads 0-15 at __syncthreads (k.cu:12); ...".
std::string waits(const Grid& g) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const Fiber& f : g.fibers) {
    std::string key;
    if (f.state == State::Exited)
      key = "exited";
    else if (f.state == State::AtBarrier)
      key = fmt::format("at __syncthreads ({})", site(f.where));
    else if (f.state == State::AtWarp)
      key = fmt::format("at {} mask {:#010x} ({})", collective_name(f.kind), f.mask, site(f.where));
    else
      key = "runnable";
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& p) { return p.first == key; });
    if (it == groups.end())
      groups.push_back({key, {f.id}});
    else
      it->second.push_back(f.id);
  }
  std::string out;
  for (auto& [key, ids] : groups) {
    out += fmt::format("{}threads {} {}", out.empty() ? "" : "; ", ranges(ids), key);
  }
  return out;
}

// The lane a collective of `f` reads (its own for votes and out-of-segment shuffles).
int source_lane(const Fiber& f, int lane) {
  const int w = f.width, base = lane & ~(w - 1);
  switch (f.kind) {
    case Collective::Shfl:
      return base + (((f.arg % w) + w) % w);
    case Collective::ShflUp:
      return lane - base >= f.arg ? lane - f.arg : lane;
    case Collective::ShflDown:
      return lane - base + f.arg < w ? lane + f.arg : lane;
    case Collective::ShflXor: {
      const int src = lane ^ f.arg;
      return src >= base && src < base + w ? src : lane;
    }
    default:
      return lane;
  }
}

// Completes every warp collective whose mask's live lanes all wait at it. Returns whether one
// completed; throws on a read of an exited lane or one outside the mask.
bool complete_warp_collectives(Grid& g) {
  bool done = false;
  const int n = int(g.fibers.size());
  for (int w0 = 0; w0 < n; w0 += 32) {
    for (int l = 0; l < 32 && w0 + l < n; ++l) {
      Fiber& f = g.fibers[w0 + l];
      if (f.state != State::AtWarp) continue;
      bool all_here = true;
      for (int m = 0; m < 32; ++m) {
        if (!(f.mask >> m & 1u) || w0 + m >= n) continue;
        const Fiber& o = g.fibers[w0 + m];
        if (o.state == State::Exited) continue;
        if (o.state != State::AtWarp || o.kind != f.kind || o.mask != f.mask ||
            o.width != f.width) {
          all_here = false;
          break;
        }
      }
      if (!all_here) continue;
      uint64_t ballot = 0;
      for (int m = 0; m < 32; ++m) {
        if (!(f.mask >> m & 1u) || w0 + m >= n) continue;
        const Fiber& o = g.fibers[w0 + m];
        if (o.state != State::Exited && o.value != 0) ballot |= uint64_t(1) << m;
      }
      std::vector<uint64_t> results(32, 0);
      for (int m = 0; m < 32; ++m) {
        if (!(f.mask >> m & 1u) || w0 + m >= n) continue;
        Fiber& o = g.fibers[w0 + m];
        if (o.state == State::Exited) continue;
        if (o.kind == Collective::Ballot) {
          results[m] = ballot;
          continue;
        }
        const int src = source_lane(o, m);
        const char* why = nullptr;
        if (!(o.mask >> src & 1u))
          why = "outside the mask";
        else if (w0 + src >= n)
          why = "beyond the block's last thread";
        else if (g.fibers[w0 + src].state == State::Exited)
          why = "an exited thread";
        if (why != nullptr) {
          MOE_FAIL("{}: {} at {} in thread {} (warp {}, lane {}) reads lane {}, {} (mask {:#010x})",
                   where_block(g), collective_name(o.kind), site(o.where), w0 + m, w0 / 32, m, src,
                   why, o.mask);
        }
        results[m] = g.fibers[w0 + src].value;
      }
      for (int m = 0; m < 32; ++m) {
        if (!(f.mask >> m & 1u) || w0 + m >= n) continue;
        Fiber& o = g.fibers[w0 + m];
        if (o.state == State::Exited) continue;
        o.result = results[m];
        o.state = State::Runnable;
      }
      done = true;
    }
  }
  return done;
}

std::vector<int> order_of(size_t n, std::mt19937_64& rng) {
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (t_order == ResumeOrder::Reversed) std::reverse(order.begin(), order.end());
  if (t_order == ResumeOrder::Shuffled) std::shuffle(order.begin(), order.end(), rng);
  return order;
}

// The context fibers start from (makecontext gives each its stack and entry). In a function of its
// own: getcontext returns twice in principle, which the caller's locals need not survive.
ucontext_t fresh_context() {
  ucontext_t c;
  getcontext(&c);
  return c;
}

void run_block(Grid& g, const ucontext_t& context, std::mt19937_64& rng) {
  const int n = int(g.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f = Fiber{};
    f.id = i;
    f.idx = uint3{unsigned(i) % g.block.x, unsigned(i) / g.block.x % g.block.y,
                  unsigned(i) / (g.block.x * g.block.y)};
    f.stack = t_stacks.get(size_t(i));
    f.ctx = context;  // one getcontext per launch: each is a system call
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  if (g.smem_bytes > 0) std::memset(g.smem, kSmemPoisonByte, g.smem_bytes);
  ++t_stats.blocks;
  t_stats.threads += n;
  for (;;) {
    // Every runnable thread runs to its next wait or its end.
    for (int i : order_of(g.fibers.size(), rng)) {
      if (g.fibers[i].state != State::Runnable) continue;
      resume(g, g.fibers[i]);
      if (!g.error.empty()) MOE_FAIL("{}", g.error);
    }
    if (std::all_of(g.fibers.begin(), g.fibers.end(),
                    [](const Fiber& f) { return f.state == State::Exited; })) {
      break;
    }
    if (complete_warp_collectives(g)) continue;
    // A barrier completes when every live thread waits at it.
    const Fiber* first = nullptr;
    bool all_at_barrier = true, same_site = true;
    for (const Fiber& f : g.fibers) {
      if (f.state == State::Exited) continue;
      if (f.state != State::AtBarrier) {
        all_at_barrier = false;
        break;
      }
      if (first == nullptr)
        first = &f;
      else if (f.where.line() != first->where.line() || f.where.column() != first->where.column() ||
               std::strcmp(f.where.file_name(), first->where.file_name()) != 0) {
        same_site = false;
      }
    }
    if (all_at_barrier && same_site) {
      for (Fiber& f : g.fibers) {
        if (f.state == State::AtBarrier) f.state = State::Runnable;
      }
      continue;
    }
    MOE_FAIL(
        "{}: deadlock: a barrier or warp collective that not every live thread reaches "
        "(divergent barrier): {}",
        where_block(g), waits(g));
  }
#ifndef MOECORE_EMU_ASAN  // ASan reports a write into the poisoned guards where it happens
  if (g.smem_bytes > 0) {
    for (size_t i = 0; i < kSmemGuard; ++i) {
      if (g.smem[-1 - ptrdiff_t(i)] != kSmemGuardByte ||
          g.smem[g.smem_bytes + i] != kSmemGuardByte) {
        MOE_FAIL("{}: written outside its {} bytes of dynamic shared memory", where_block(g),
                 g.smem_bytes);
      }
    }
  }
#endif
}

}  // namespace

const char* resume_order_name(ResumeOrder o) {
  switch (o) {
    case ResumeOrder::Forward:
      return "forward";
    case ResumeOrder::Reversed:
      return "reversed";
    case ResumeOrder::Shuffled:
      return "shuffled";
  }
  return "?";
}

void set_resume_order(ResumeOrder order, uint64_t seed) {
  t_order = order;
  t_seed = seed;
}
ResumeOrder resume_order() {
  return t_order;
}
ScopedResumeOrder::ScopedResumeOrder(ResumeOrder order, uint64_t seed)
    : saved_order_(t_order), saved_seed_(t_seed) {
  set_resume_order(order, seed);
}
ScopedResumeOrder::~ScopedResumeOrder() {
  set_resume_order(saved_order_, saved_seed_);
}

Stats stats() {
  return t_stats;
}
void reset_stats() {
  t_stats = Stats{};
}

namespace detail {

const uint3& thread_idx() {
  return grid().current->idx;
}
const uint3& block_idx() {
  return grid().block_idx;
}
const dim3& block_dim() {
  return grid().block;
}
const dim3& grid_dim() {
  return grid().grid;
}
void* dynamic_shared() {
  Grid& g = grid();
  return g.smem_bytes > 0 ? g.smem : nullptr;
}

void sync_threads(const std::source_location& where) {
  Grid& g = grid();
  Fiber& f = *g.current;
  f.state = State::AtBarrier;
  f.where = where;
  switch_to_scheduler(g, f, false);
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width,
                         const std::source_location& where) {
  Grid& g = grid();
  Fiber& f = *g.current;
  const int lane = f.id % 32;
  if (!(mask >> lane & 1u)) {
    fiber_error(g,
                fmt::format("{}: {} at {} in thread {}: its own lane {} is not in the mask "
                            "{:#010x}",
                            where_block(g), collective_name(kind), site(where), f.id, lane, mask));
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    fiber_error(g, fmt::format("{}: {} at {}: width {} is not a power of two in [1, 32]",
                               where_block(g), collective_name(kind), site(where), width));
  }
  f.state = State::AtWarp;
  f.where = where;
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  switch_to_scheduler(g, f, false);
  return f.result;
}

void launch(const char* name, dim3 grid_dim, dim3 block, size_t dynamic_smem, void (*body)(void*),
            void* arg) {
  MOE_CHECK(t_grid == nullptr,
            "[emu] kernel {} launched from inside kernel {}: dynamic "
            "parallelism is not emulated",
            name, t_grid ? t_grid->name : "");
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  MOE_CHECK(block.x >= 1 && block.y >= 1 && block.z >= 1 && threads <= kMaxThreadsPerBlock &&
                block.x <= 1024 && block.y <= 1024 && block.z <= 64,
            "[emu] kernel {}: block ({},{},{}) = {} threads: a block has 1 to {} threads "
            "(x, y <= 1024, z <= 64)",
            name, block.x, block.y, block.z, threads, kMaxThreadsPerBlock);
  MOE_CHECK(grid_dim.x >= 1 && grid_dim.y >= 1 && grid_dim.z >= 1 && grid_dim.x <= 0x7fffffffu &&
                grid_dim.y <= 65535 && grid_dim.z <= 65535,
            "[emu] kernel {}: grid ({},{},{}): each dimension >= 1 (skip the launch when there "
            "is no work), x < 2^31, y and z <= 65535",
            name, grid_dim.x, grid_dim.y, grid_dim.z);
  MOE_CHECK(dynamic_smem <= kMaxSharedBytes,
            "[emu] kernel {}: {} bytes of dynamic shared memory > the {} a block may have", name,
            dynamic_smem, kMaxSharedBytes);

  // What the emulator allocates (fibers, stacks, shared storage) is the device's work, not the
  // host's: an audited step (--sync-audit) counts only the host code around the launches.
  const SyncAudit::Paused device_work;
  Grid g;
  g.name = name;
  g.grid = grid_dim;
  g.block = block;
  g.body = body;
  g.arg = arg;
  g.fibers.resize(threads);
  g.smem_bytes = dynamic_smem;
  std::vector<unsigned char> smem;
  if (dynamic_smem > 0) {
    // 16-byte aligned, as CUDA's; guard bytes on both sides.
    smem.assign(dynamic_smem + 2 * kSmemGuard + 16, kSmemGuardByte);
    const uintptr_t p = reinterpret_cast<uintptr_t>(smem.data()) + kSmemGuard;
    g.smem = reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t(15));
#ifdef MOECORE_EMU_ASAN
    ASAN_POISON_MEMORY_REGION(g.smem - kSmemGuard, kSmemGuard);
    ASAN_POISON_MEMORY_REGION(g.smem + dynamic_smem, kSmemGuard);
#endif
  }
  ++t_stats.launches;
  std::mt19937_64 rng(t_seed);
  const uint64_t n_blocks = uint64_t(grid_dim.x) * grid_dim.y * grid_dim.z;
  std::vector<uint64_t> blocks(n_blocks);
  std::iota(blocks.begin(), blocks.end(), uint64_t(0));
  if (t_order == ResumeOrder::Reversed) std::reverse(blocks.begin(), blocks.end());
  if (t_order == ResumeOrder::Shuffled) std::shuffle(blocks.begin(), blocks.end(), rng);

  const ucontext_t context = fresh_context();
  t_grid = &g;
  struct Reset {
    std::vector<unsigned char>& smem;
    ~Reset() {
      t_grid = nullptr;
#ifdef MOECORE_EMU_ASAN
      if (!smem.empty()) ASAN_UNPOISON_MEMORY_REGION(smem.data(), smem.size());
#endif
    }
  } reset{smem};
  for (uint64_t b : blocks) {
    g.block_idx = uint3{unsigned(b % grid_dim.x), unsigned(b / grid_dim.x % grid_dim.y),
                        unsigned(b / (uint64_t(grid_dim.x) * grid_dim.y))};
    run_block(g, context, rng);
  }
}

}  // namespace detail

// ---- stream capture (stream_capture_emu.h) ----

struct Graph {
  std::vector<std::pair<const char*, std::function<void()>>> ops;
  // While capturing: the forks not joined yet, by token (capture_fork).
  std::map<int64_t, std::string> forks;
  int64_t next_fork = 0;
};

namespace {
std::atomic<bool> g_capturing{false};
std::mutex g_capture_mutex;
Graph* g_capture = nullptr;  // the open capture's recording
}  // namespace

bool capturing() {
  return g_capturing.load(std::memory_order_relaxed);
}

void capture_begin() {
  const SyncAudit::Paused device_work;
  std::lock_guard<std::mutex> lock(g_capture_mutex);
  MOE_CHECK(g_capture == nullptr,
            "[emu] a stream capture begun while another is open (one capture at a time)");
  g_capture = new Graph();
  g_capturing.store(true);
}

Graph* capture_end(bool keep, int64_t* operations) {
  const SyncAudit::Paused device_work;
  std::lock_guard<std::mutex> lock(g_capture_mutex);
  Graph* g = g_capture;
  g_capture = nullptr;
  g_capturing.store(false);
  if (!keep) {
    delete g;
    return nullptr;
  }
  if (g != nullptr && !g->forks.empty()) {
    const std::string what = g->forks.begin()->second;
    const size_t n = g->forks.size();
    delete g;
    MOE_FAIL(
        "[emu] stream capture ended with {} collective{} begun in it and never joined back to "
        "the captured stream, the first {}: its completion would lie outside the graph (CUDA: "
        "cudaErrorStreamCaptureUnjoined); order it on the stream inside the captured region "
        "(CommHandle::wait_on), not by a host wait after it",
        n, n == 1 ? "" : "s", what);
  }
  if (g != nullptr && operations != nullptr) *operations = static_cast<int64_t>(g->ops.size());
  return g;
}

int64_t capture_fork(const std::string& what) {
  const SyncAudit::Paused device_work;
  std::lock_guard<std::mutex> lock(g_capture_mutex);
  MOE_CHECK(g_capture != nullptr, "[emu] {} forked from a stream with no capture open", what);
  const int64_t id = g_capture->next_fork++;
  g_capture->forks.emplace(id, what);
  return id;
}

void capture_join(int64_t fork) {
  const SyncAudit::Paused device_work;
  std::lock_guard<std::mutex> lock(g_capture_mutex);
  if (g_capture != nullptr) g_capture->forks.erase(fork);
}

void record(const char* what, std::function<void()> op) {
  const SyncAudit::Paused device_work;
  std::lock_guard<std::mutex> lock(g_capture_mutex);
  MOE_CHECK(g_capture != nullptr, "[emu] {} recorded with no stream capture open", what);
  g_capture->ops.emplace_back(what, std::move(op));
}

void graph_replay(const Graph& g) {
  if (capturing()) {  // a graph launched into a capture: one operation that replays it
    const Graph* inner = &g;
    record("a graph launch", [inner] { graph_replay(*inner); });
    return;
  }
  for (const auto& op : g.ops) op.second();
}

void graph_destroy(Graph* g) {
  const SyncAudit::Paused device_work;
  delete g;
}

void check_capturable_range(const char* who, const void* p, size_t bytes) {
  if (bytes == 0 || in_allocation(p, bytes)) return;
  MOE_FAIL(
      "[emu] {} of {} bytes at {} during a stream capture: it is pageable host memory (not a "
      "device or pinned allocation), which a CUDA graph's copy cannot take; copy through pinned "
      "staging (MemSpace::PinnedHost), or out of the captured region",
      who, bytes, p);
}

void stream_synchronize() {
  SyncAudit::instance().not_capturable("cudaStreamSynchronize: the host waits for the stream");
}

}  // namespace moecore::emu
