// The device-table grouped GEMM's cache of host-built kernel parameters (the CUTLASS backend,
// ops/cuda/grouped_gemm_cutlass_sm90a.cu): a call's parameters (TMA descriptor templates among
// them, built on the host by the driver) depend only on its key (workspace, G, beta, device,
// types), so
// they are built on the key's first call and kept. The slots are fixed storage that a call never
// allocates; the plan sizes them (reserve: the distinct calls a step makes, layers x forms, from
// ops::grouped_gemm_workspace_bytes) so that after a step's first calls none misses. When more
// keys arrive than there are slots, the least recently used one is rebuilt: a step cycling through
// more keys than slots would miss on every call, which the plan's size prevents. Plain C++ (no
// CUDA), so its policy is tested on the CPU (tests/emu/test_emu_grouped_gemm_device.cpp, which
// also runs the emulated backend's model of it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moecore::ops::cuda {

struct GroupedGemmParamsKey {
  const void* workspace = nullptr;
  int64_t G = -1;
  float beta = 0.f;
  int device = -1;
  uint8_t types = 0;  // desc::GemmTypes: the f32 and the bf16 output run different kernels
  bool operator==(const GroupedGemmParamsKey&) const = default;
};

template <class Params>
class GroupedGemmParamsCache {
 public:
  // The slots before any plan: as many as one call site per layer of a small model needs.
  static constexpr size_t kDefaultSlots = 32;

  GroupedGemmParamsCache() : slots_(kDefaultSlots) {}

  // At least `slots` slots (never fewer): allocates, so only while planning, before a step.
  void reserve(size_t slots) {
    if (slots > slots_.size()) slots_.resize(slots);
  }
  size_t slots() const { return slots_.size(); }

  // The parameters kept for `key`, or null (a miss: build them and keep()).
  const Params* find(const GroupedGemmParamsKey& key) {
    for (Slot& s : slots_) {
      if (s.valid && s.key == key) {
        s.last_use = ++clock_;
        return &s.params;
      }
    }
    return nullptr;
  }

  // Keeps `params` for `key` in a free slot or in place of the least recently used one. `build`
  // fills the slot's parameters (it may throw: the slot then holds nothing).
  template <class Build>
  const Params& keep(const GroupedGemmParamsKey& key, Build&& build) {
    Slot* victim = &slots_[0];
    for (Slot& s : slots_) {
      if (!s.valid) {
        victim = &s;
        break;
      }
      if (s.last_use < victim->last_use) victim = &s;
    }
    ++misses_;
    victim->valid = false;
    build(victim->params);
    victim->key = key;
    victim->last_use = ++clock_;
    victim->valid = true;
    return victim->params;
  }

  uint64_t misses() const { return misses_; }  // parameters built (every keep)

 private:
  struct Slot {
    bool valid = false;
    GroupedGemmParamsKey key;
    uint64_t last_use = 0;
    Params params{};
  };
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace moecore::ops::cuda
