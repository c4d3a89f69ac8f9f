#include "train/step_buffers.h"

#include <algorithm>

#include "ops/memory.h"

namespace moecore::train {

StepBuffers::StepBuffers(const Exec& ex, int64_t n_micro, int64_t tokens, int64_t E,
                         int chunks, int64_t mtp_depths, int64_t routing)
    : n_micro_(n_micro),
      chunks_(chunks),
      tokens_(tokens),
      E_(std::max<int64_t>(E, 1)),
      D_(mtp_depths),
      R_(routing),
      host_arena_(ex, MemSpace::PinnedHost),
      dev_arena_(ex, MemSpace::Device) {
  MOE_CHECK(n_micro >= 1 && tokens >= 1 && E >= 0 && chunks >= 1 && mtp_depths >= 0 &&
                routing >= 0,
            "[train] step buffers for {} micro-batches of {} tokens and {} experts", n_micro,
            tokens, E);
  host_arena_.plan([this](Arena& a) { layout(a, host_); });
  dev_arena_.plan([this](Arena& a) { layout(a, dev_); });
}

namespace {
// A slot in the host's staging (alloc_host) or on the device (alloc).
template <typename T>
void alloc_slot(Arena& a, T*& p, int64_t n, const char* name, MemKind kind) {
  p = a.alloc_host<T>(n, name, kind);
}
template <typename T>
void alloc_slot(Arena& a, DevPtr<T>& p, int64_t n, const char* name, MemKind kind) {
  p = a.alloc<T>(n, name, kind);
}
}  // namespace

template <typename S>
void StepBuffers::layout(Arena& a, S& s) const {
  alloc_slot(a, s.ids, n_micro_ * tokens_, "step.ids", MemKind::Activations);
  alloc_slot(a, s.targets, n_micro_ * tokens_, "step.targets", MemKind::Activations);
  alloc_slot(a, s.report, n_micro_ * chunks_, "step.report", MemKind::State);
  alloc_slot(a, s.tokens_E, n_micro_ * chunks_ * E_, "step.tokens_per_expert", MemKind::State);
  alloc_slot(a, s.dropout, n_micro_, "step.dropout_counters", MemKind::State);
  if (D_ > 0) {
    alloc_slot(a, s.mtp_ids, n_micro_ * D_ * tokens_, "step.mtp_ids", MemKind::Activations);
    alloc_slot(a, s.mtp_targets, n_micro_ * D_ * tokens_, "step.mtp_targets",
               MemKind::Activations);
  }
  if (R_ > 0) alloc_slot(a, s.routing, n_micro_ * R_, "step.routing_tables", MemKind::State);
}

void StepBuffers::upload() {
  const Exec& ex = dev_arena_.exec();
  ops::copy<int32_t>(ex, dev_.ids, host_.ids, n_micro_ * tokens_);
  ops::copy<int32_t>(ex, dev_.targets, host_.targets, n_micro_ * tokens_);
  ops::copy<ops::DropoutCounters>(ex, dev_.dropout, host_.dropout, n_micro_);
  if (D_ > 0) {
    ops::copy<int32_t>(ex, dev_.mtp_ids, host_.mtp_ids, n_micro_ * D_ * tokens_);
    ops::copy<int32_t>(ex, dev_.mtp_targets, host_.mtp_targets, n_micro_ * D_ * tokens_);
  }
  if (R_ > 0) ops::copy<int32_t>(ex, dev_.routing, host_.routing, n_micro_ * R_);
}

void StepBuffers::download_routing() {
  if (R_ == 0) return;
  const Exec& ex = dev_arena_.exec();
  ops::copy<int32_t>(ex, host_.routing, dev_.routing, n_micro_ * R_);
  exec_synchronize(ex, "the step's routing tables (StepBuffers::download_routing)");
}

void StepBuffers::download() {
  const Exec& ex = dev_arena_.exec();
  ops::copy<ops::MicroBatchReport>(ex, host_.report, dev_.report, n_micro_ * chunks_);
  ops::copy<int64_t>(ex, host_.tokens_E, dev_.tokens_E, n_micro_ * chunks_ * E_);
  exec_synchronize(ex, "the step's report (StepBuffers::download)");  // read next
}

model::MicroBatchIO StepBuffers::io(int64_t mb, int chunk) const {
  MOE_CHECK(mb >= 0 && mb < n_micro_ && chunk >= 0 && chunk < chunks_,
            "[train] micro-batch {} of {}, chunk {} of {}", mb, n_micro_, chunk, chunks_);
  const int64_t slot = mb * chunks_ + chunk;
  model::MicroBatchIO io{dev_.ids + mb * tokens_, dev_.targets + mb * tokens_,
                         dev_.report + slot, dev_.tokens_E + slot * E_, dev_.dropout + mb};
  if (D_ > 0) {
    io.mtp_ids_BS = dev_.mtp_ids + mb * D_ * tokens_;
    io.mtp_targets_BS = dev_.mtp_targets + mb * D_ * tokens_;
  }
  if (R_ > 0) io.routing_BSK = dev_.routing + mb * R_;
  return io;
}

}  // namespace moecore::train
