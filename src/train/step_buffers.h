// The training step's planned input and report memory, one slot per micro-batch of this rank:
// the host writes every micro-batch's token ids and targets before the step's work starts and
// reads the report once, after the step (after the optimizer update). Between the two, the
// step's ops read their inputs and write their results there and nothing returns to the host:
// the same path on every backend.
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "model/gpt_model.h"
#include "ops/step_report.h"

namespace moecore::train {

class StepBuffers {
 public:
  // n_micro micro-batches of `tokens` = B * S tokens; E experts (0: a dense model).
  StepBuffers(const Exec& ex, int64_t n_micro, int64_t tokens, int64_t E);

  int64_t micro_batches() const { return n_micro_; }
  // Micro-batch mb's inputs, [B, S] batch-major, for the host to fill before the step.
  int32_t* ids(int64_t mb) { return ids_ + mb * tokens_; }
  int32_t* targets(int64_t mb) { return targets_ + mb * tokens_; }
  // What the model's forward of micro-batch mb reads and writes.
  model::MicroBatchIO io(int64_t mb) const;
  // Host reads of the report, after the step.
  const ops::MicroBatchReport& report(int64_t mb) const { return report_[mb]; }
  const int64_t* tokens_per_expert(int64_t mb) const { return tokens_E_ + mb * E_; }
  const Arena& arena() const { return arena_; }

 private:
  void layout(Arena& a);

  int64_t n_micro_, tokens_, E_;
  Arena arena_;
  int32_t* ids_ = nullptr;                   // [n_micro, tokens]
  int32_t* targets_ = nullptr;               // [n_micro, tokens]
  ops::MicroBatchReport* report_ = nullptr;  // [n_micro]
  int64_t* tokens_E_ = nullptr;              // [n_micro, max(E, 1)]
};

}  // namespace moecore::train
