#include "core/arena.h"

#include <algorithm>

namespace moecore {

std::string_view mem_kind_name(MemKind k) {
  switch (k) {
    case MemKind::Weights: return "weights";
    case MemKind::Grads: return "grads";
    case MemKind::OptimizerState: return "optimizer";
    case MemKind::Activations: return "activations";
    case MemKind::Recomputed: return "recomputed";
    case MemKind::State: return "state";
    case MemKind::Workspace: return "workspace";
    case MemKind::Count: break;
  }
  return "?";
}

Arena::~Arena() { exec_free(exec_, space_, block_); }

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

int Arena::overlay_index(std::string_view name) {
  for (size_t i = 0; i < overlays_.size(); ++i) {
    if (overlays_[i].name == name) return static_cast<int>(i);
  }
  MOE_CHECK(mode_ == Mode::Plan,
            "[arena] overlay '{}' first used in the allocating pass: it must repeat the plan",
            name);
  overlays_.push_back(Overlay{std::string(name), {}, {}, {}, 0});
  return static_cast<int>(overlays_.size()) - 1;
}

DevPtr<void> Arena::alloc_bytes(size_t bytes, std::string_view name, MemKind kind) {
  MOE_CHECK(mode_ != Mode::Frozen,
            "[arena] buffer '{}' ({} bytes) requested after freeze(): memory must be planned "
            "before step 0",
            name, bytes);
  kind = retag_[static_cast<int>(kind)];
  const size_t sz = round_up(bytes, kAlign);
  const int ov = route_overlay_[static_cast<int>(kind)];
  if (mode_ == Mode::Plan) {
    ++plan_count_;
    by_kind_[static_cast<int>(kind)] += sz;
    if (ov < 0) {
      planned_ += sz;
    } else {
      Overlay& o = overlays_[ov];
      const size_t m = static_cast<size_t>(route_member_[static_cast<int>(kind)]);
      if (o.member_bytes.size() <= m) {
        o.member_bytes.resize(m + 1, 0);
        o.member_recomputed.resize(m + 1, 0);
      }
      o.member_bytes[m] += sz;
      if (kind == MemKind::Recomputed) o.member_recomputed[m] += sz;
    }
    return nullptr;
  }
  ++alloc_count_;
  if (ov < 0) {
    MOE_CHECK(cursor_ + sz <= planned_,
              "[arena] buffer '{}' ({} bytes) overflows the plan ({} of {} bytes used): the "
              "allocating pass must repeat the planning pass",
              name, bytes, cursor_, planned_);
    void* p = block_ + cursor_;
    cursor_ += sz;
    return p;
  }
  Overlay& o = overlays_[ov];
  const size_t m = static_cast<size_t>(route_member_[static_cast<int>(kind)]);
  MOE_CHECK(m < o.member_bytes.size() && o.cursor[m] + sz <= o.member_bytes[m],
            "[arena] buffer '{}' ({} bytes) overflows member {} of overlay '{}': the allocating "
            "pass must repeat the planning pass",
            name, bytes, m, o.name);
  void* p = block_ + o.base + o.cursor[m];
  o.cursor[m] += sz;
  return p;
}

static size_t largest(const std::vector<size_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

size_t Arena::overlay_bytes() const {
  size_t total = 0;
  for (const Overlay& o : overlays_) total += largest(o.member_bytes);
  return total;
}

void Arena::commit() {
  MOE_CHECK(mode_ == Mode::Plan, "[arena] commit() called twice");
  size_t base = planned_;
  for (Overlay& o : overlays_) {
    o.base = base;
    o.cursor.assign(o.member_bytes.size(), 0);
    base += largest(o.member_bytes);
  }
  const size_t total = std::max(planned_bytes(), kAlign);
  block_ = static_cast<char*>(exec_alloc(exec_, space_, total));  // zero-filled, 64-aligned
  mode_ = Mode::Allocate;
}

void Arena::freeze() {
  MOE_CHECK(mode_ == Mode::Allocate, "[arena] freeze() before commit()");
  MOE_CHECK(cursor_ == planned_ && alloc_count_ == plan_count_,
            "[arena] allocating pass used {} bytes in {} buffers, plan said {} in {}", cursor_,
            alloc_count_, planned_, plan_count_);
  for (const Overlay& o : overlays_) {
    MOE_CHECK(o.cursor == o.member_bytes,
              "[arena] the allocating pass filled overlay '{}' differently from the plan",
              o.name);
  }
  mode_ = Mode::Frozen;
}

size_t Arena::shared_saving_bytes() const {
  size_t requested = 0;
  for (const Overlay& o : overlays_) {
    for (size_t b : o.member_bytes) requested += b;
  }
  return requested - overlay_bytes();
}

size_t Arena::recompute_saving_bytes() const {
  // Without recomputation the Recomputed buffers are plain and each overlay keeps the rest.
  size_t without = planned_ + bytes_of(MemKind::Recomputed);
  for (const Overlay& o : overlays_) {
    size_t largest = 0;
    for (size_t m = 0; m < o.member_bytes.size(); ++m) {
      largest = std::max(largest, o.member_bytes[m] - o.member_recomputed[m]);
    }
    without += largest;
  }
  const size_t with = planned_bytes();
  return without > with ? without - with : 0;
}

Arena::Share::Share(Arena& arena, std::string_view overlay, int64_t member,
                    std::initializer_list<MemKind> kinds)
    : arena_(arena) {
  MOE_CHECK(member >= 0, "[arena] overlay '{}' member {} < 0", overlay, member);
  const int ov = arena.overlay_index(overlay);
  for (MemKind k : kinds) {
    const int i = static_cast<int>(k);
    saved_.push_back(Saved{k, arena.route_overlay_[i], arena.route_member_[i]});
    arena.route_overlay_[i] = ov;
    arena.route_member_[i] = member;
  }
}

Arena::Share::~Share() {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
    arena_.route_overlay_[static_cast<int>(it->kind)] = it->overlay;
    arena_.route_member_[static_cast<int>(it->kind)] = it->member;
  }
}

Arena::Retag::Retag(Arena& arena, MemKind from, MemKind to, bool active)
    : arena_(arena), from_(from), prev_(arena.retag_[static_cast<int>(from)]) {
  if (active) arena.retag_[static_cast<int>(from)] = to;
}

Arena::Retag::~Retag() { arena_.retag_[static_cast<int>(from_)] = prev_; }

}  // namespace moecore
