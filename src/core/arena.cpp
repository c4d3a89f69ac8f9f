#include "core/arena.h"

#include <cstdlib>
#include <cstring>

namespace moecore {

std::string_view mem_kind_name(MemKind k) {
  switch (k) {
    case MemKind::Weights: return "weights";
    case MemKind::Grads: return "grads";
    case MemKind::OptimizerState: return "optimizer";
    case MemKind::Activations: return "activations";
    case MemKind::Workspace: return "workspace";
    case MemKind::Count: break;
  }
  return "?";
}

Arena::~Arena() { std::free(block_); }

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

void* Arena::alloc_bytes(size_t bytes, std::string_view name, MemKind kind) {
  size_t sz = round_up(bytes, kAlign);
  switch (mode_) {
    case Mode::Plan:
      planned_ += sz;
      ++plan_count_;
      by_kind_[static_cast<int>(kind)] += sz;
      return nullptr;
    case Mode::Allocate: {
      MOE_CHECK(cursor_ + sz <= planned_,
                "[arena] buffer '{}' ({} bytes) overflows the plan ({} of {} bytes used): the "
                "allocating pass must repeat the planning pass",
                name, bytes, cursor_, planned_);
      void* p = block_ + cursor_;
      cursor_ += sz;
      ++alloc_count_;
      return p;
    }
    case Mode::Frozen:
      MOE_FAIL("[arena] buffer '{}' ({} bytes) requested after freeze(): memory must be planned "
               "before step 0",
               name, bytes);
  }
  return nullptr;
}

void Arena::commit() {
  MOE_CHECK(mode_ == Mode::Plan, "[arena] commit() called twice");
  size_t total = planned_ > 0 ? planned_ : kAlign;
  block_ = static_cast<char*>(std::aligned_alloc(kAlign, total));
  MOE_CHECK(block_ != nullptr, "[arena] cannot allocate {} bytes: reduce the model or batch", total);
  std::memset(block_, 0, total);
  mode_ = Mode::Allocate;
}

void Arena::freeze() {
  MOE_CHECK(mode_ == Mode::Allocate, "[arena] freeze() before commit()");
  MOE_CHECK(cursor_ == planned_ && alloc_count_ == plan_count_,
            "[arena] allocating pass used {} bytes in {} buffers, plan said {} in {}", cursor_,
            alloc_count_, planned_, plan_count_);
  mode_ = Mode::Frozen;
}

}  // namespace moecore
