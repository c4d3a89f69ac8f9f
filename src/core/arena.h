// One arena, planned before step 0. Components describe their buffers with alloc() twice: a
// planning pass (returns nullptr, sums sizes) and an allocating pass over one block of exactly
// the planned size. After freeze() any alloc() is an error: nothing allocates inside a step.
//
// Overlays share memory between buffers that are never live at the same time. An overlay has
// members; the members' buffers start at the same address, so the overlay is as large as its
// largest member. A Share scope sends the allocations of chosen kinds into one member: a
// transformer layer puts its workspace and its recomputed activations into the member of its
// index (they are live only while that layer runs its forward or backward), and full
// recomputation puts a chunk's activations into the member of the chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore {

// What a buffer holds, for the memory breakdown in the logs.
//   Activations: saved in the forward for the backward, kept for the whole step.
//   Recomputed: activations the backward recomputes (activation recomputation): live only
//     while their layer (or chunk of layers) is being worked on.
//   State: small buffers kept across steps outside the parameters (routing statistics).
//   Workspace: scratch within one op or one layer's forward or backward.
enum class MemKind : uint8_t {
  Weights,
  Grads,
  OptimizerState,
  Activations,
  Recomputed,
  State,
  Workspace,
  Count
};
constexpr int kNumMemKinds = static_cast<int>(MemKind::Count);
std::string_view mem_kind_name(MemKind k);

class Arena {
 public:
  enum class Mode { Plan, Allocate, Frozen };
  static constexpr size_t kAlign = 64;

  // ex: the execution context whose memory the arena plans; the layers that allocate from it
  // run their ops on it (they keep arena.exec()). space: where its block lives (the step's
  // buffers on the device; the host's staging of inputs and reports in pinned host memory).
  explicit Arena(const Exec& ex = cpu_exec(), MemSpace space = MemSpace::Device)
      : exec_(ex), space_(space) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A buffer of n elements in the arena's memory space: an address for ops (no element access;
  // core/dev_ptr.h). Null in the planning pass.
  template <typename T>
  DevPtr<T> alloc(int64_t n, std::string_view name, MemKind kind = MemKind::Activations) {
    return dev_ptr_cast<T>(alloc_bytes(static_cast<size_t>(n) * sizeof(T), name, kind));
  }
  // The same, as a host pointer: only in a PinnedHost arena, whose memory the host reads and
  // writes (the staging of a step's inputs and report).
  template <typename T>
  T* alloc_host(int64_t n, std::string_view name, MemKind kind = MemKind::Activations) {
    MOE_CHECK(space_ == MemSpace::PinnedHost,
              "[arena] host buffer '{}' asked of an arena in {} memory: the host reads and "
              "writes only a pinned-host arena",
              name, mem_space_name(space_));
    return static_cast<T*>(raw_ptr(alloc_bytes(static_cast<size_t>(n) * sizeof(T), name, kind)));
  }
  DevPtr<void> alloc_bytes(size_t bytes, std::string_view name, MemKind kind);

  // Runs layout(arena) twice (planning, then allocating) and freezes: the usual way to set up.
  template <typename Layout>
  void plan(Layout&& layout) {
    layout(*this);
    commit();
    layout(*this);
    freeze();
  }

  // Runs only the planning pass: every size and breakdown below is valid, nothing is allocated
  // and the arena stays in Plan mode (allocated() is false). For sizing models that will not
  // be built here (`moecore plan`).
  template <typename Layout>
  void size_only(Layout&& layout) {
    layout(*this);
  }
  bool allocated() const { return block_ != nullptr; }

  // Plan -> Allocate: one zero-filled block of the planned size in the arena's memory space
  // (exec_alloc); the same alloc() sequence must follow.
  void commit();
  // Allocate -> Frozen: checks that the allocating pass matched the plan exactly.
  void freeze();

  // While alive, allocations of `kinds` go to member `member` of overlay `overlay` (created on
  // first use). Scopes nest; an inner scope overrides an outer one for the kinds it names.
  class Share {
   public:
    Share(Arena& arena, std::string_view overlay, int64_t member,
          std::initializer_list<MemKind> kinds);
    ~Share();
    Share(const Share&) = delete;
    Share& operator=(const Share&) = delete;

   private:
    struct Saved {
      MemKind kind;
      int overlay;
      int64_t member;
    };
    Arena& arena_;
    std::vector<Saved> saved_;
  };
  // While alive (and when `active`), allocations of kind `from` are made as kind `to`: a module
  // whose activations are recomputed in the backward marks them MemKind::Recomputed.
  class Retag {
   public:
    Retag(Arena& arena, MemKind from, MemKind to, bool active = true);
    ~Retag();
    Retag(const Retag&) = delete;
    Retag& operator=(const Retag&) = delete;

   private:
    Arena& arena_;
    MemKind from_, prev_;
  };

  Mode mode() const { return mode_; }
  const Exec& exec() const { return exec_; }
  MemSpace space() const { return space_; }
  // The block's size: the plain buffers plus every overlay at the size of its largest member
  // (valid from the end of the planning pass).
  size_t planned_bytes() const { return planned_ + overlay_bytes(); }
  // Bytes requested by buffers of kind k, as if nothing were shared.
  size_t bytes_of(MemKind k) const { return by_kind_[static_cast<int>(k)]; }
  // What the overlays save: bytes requested into overlays minus their size.
  size_t shared_saving_bytes() const;
  // What recomputation saves: the block's size if every Recomputed buffer were kept (plain, and
  // left out of the overlays), minus the block's size.
  size_t recompute_saving_bytes() const;

 private:
  struct Overlay {
    std::string name;
    std::vector<size_t> member_bytes;       // planned
    std::vector<size_t> member_recomputed;  // planned bytes of kind Recomputed
    std::vector<size_t> cursor;             // allocating pass
    size_t base = 0;                        // offset in the block
  };
  int overlay_index(std::string_view name);
  size_t overlay_bytes() const;  // sum over overlays of their largest member

  Exec exec_;
  MemSpace space_;
  Mode mode_ = Mode::Plan;
  size_t planned_ = 0;
  size_t cursor_ = 0;
  size_t plan_count_ = 0, alloc_count_ = 0;
  size_t by_kind_[kNumMemKinds] = {};
  // Routing of each kind: overlay index (-1: plain) and member; the retag of each kind.
  int route_overlay_[kNumMemKinds] = {-1, -1, -1, -1, -1, -1, -1};
  int64_t route_member_[kNumMemKinds] = {};
  MemKind retag_[kNumMemKinds] = {
      MemKind::Weights,    MemKind::Grads, MemKind::OptimizerState, MemKind::Activations,
      MemKind::Recomputed, MemKind::State, MemKind::Workspace};
  std::vector<Overlay> overlays_;
  char* block_ = nullptr;
};

}  // namespace moecore
