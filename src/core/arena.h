// One arena, planned before step 0. Components describe their buffers with alloc() twice: a
// planning pass (returns nullptr, sums sizes) and an allocating pass over one block of exactly
// the planned size. After freeze() any alloc() is an error: nothing allocates inside a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"

namespace moecore {

// What a buffer holds, for the memory breakdown in the logs.
enum class MemKind : uint8_t { Weights, Grads, OptimizerState, Activations, Workspace, Count };
std::string_view mem_kind_name(MemKind k);

class Arena {
 public:
  enum class Mode { Plan, Allocate, Frozen };
  static constexpr size_t kAlign = 64;

  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  template <typename T>
  T* alloc(int64_t n, std::string_view name, MemKind kind = MemKind::Activations) {
    return static_cast<T*>(alloc_bytes(static_cast<size_t>(n) * sizeof(T), name, kind));
  }
  void* alloc_bytes(size_t bytes, std::string_view name, MemKind kind);

  // Runs layout(arena) twice (planning, then allocating) and freezes: the usual way to set up.
  template <typename Layout>
  void plan(Layout&& layout) {
    layout(*this);
    commit();
    layout(*this);
    freeze();
  }

  // Plan -> Allocate: one zero-filled block of the planned size; the same alloc() sequence
  // must follow.
  void commit();
  // Allocate -> Frozen: checks that the allocating pass matched the plan exactly.
  void freeze();

  Mode mode() const { return mode_; }
  size_t planned_bytes() const { return planned_; }
  size_t bytes_of(MemKind k) const { return by_kind_[static_cast<int>(k)]; }

 private:
  Mode mode_ = Mode::Plan;
  size_t planned_ = 0;
  size_t cursor_ = 0;
  size_t plan_count_ = 0, alloc_count_ = 0;
  size_t by_kind_[static_cast<int>(MemKind::Count)] = {};
  char* block_ = nullptr;
};

}  // namespace moecore
