// The training step's input and report memory, one slot per micro-batch of this rank, in two
// planned arenas: the host's staging in pinned host memory, and the buffers the step's ops read
// and write on the device. The host writes every micro-batch's token ids and targets into the
// staging before the step's work starts, upload() copies them to the device (an op on the
// stream), the step's ops write the report there, and download() copies it back once, after
// the step (after the optimizer update), for the host to read. Between the two copies nothing of
// the step returns to the host: the same path on every backend (on the CPU both arenas are host
// memory and the copies are memcpys of a few KiB).
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "model/gpt_model.h"
#include "ops/dropout.h"
#include "ops/step_report.h"

namespace moecore::train {

class StepBuffers {
 public:
  // n_micro micro-batches of `tokens` = B * S tokens; E experts (0: a dense model); chunks:
  // the model chunks (virtual pipeline stages) of this rank, each with its own report slot.
  // mtp_depths: the MTP depths whose rolled ids and targets the host writes too (context
  // parallelism: rolled on the whole sequences before the split); 0: the model rolls its own.
  // routing: the routing replay's tables of a micro-batch (GPTModel::routing_layers() x B x S x
  // K int32; 0: no routing replay), uploaded with the inputs and downloaded on request.
  StepBuffers(const Exec& ex, int64_t n_micro, int64_t tokens, int64_t E, int chunks = 1,
              int64_t mtp_depths = 0, int64_t routing = 0);

  int64_t micro_batches() const { return n_micro_; }
  // Micro-batch mb's inputs in the host's staging, [B, S] batch-major, for the host to fill
  // before the step.
  int32_t* ids(int64_t mb) { return host_.ids + mb * tokens_; }
  int32_t* targets(int64_t mb) { return host_.targets + mb * tokens_; }
  // MTP depth j's (k = j + 1) rolled ids and targets of micro-batch mb, [B, S] like ids().
  int32_t* mtp_ids(int64_t mb, int64_t j) { return host_.mtp_ids + (mb * D_ + j) * tokens_; }
  int32_t* mtp_targets(int64_t mb, int64_t j) {
    return host_.mtp_targets + (mb * D_ + j) * tokens_;
  }
  // Micro-batch mb's routing tables in the host's staging (MicroBatchIO::routing_BSK's layout).
  int32_t* routing(int64_t mb) { return host_.routing + mb * R_; }
  // Micro-batch mb's dropout counters (its iteration and first sample in the global batch).
  ops::DropoutCounters& dropout(int64_t mb) { return host_.dropout[mb]; }
  // The staged inputs of every micro-batch to the device buffers the forwards read.
  void upload();
  // What the model's forward of micro-batch mb (in model chunk `chunk`) reads and writes
  // (device buffers).
  model::MicroBatchIO io(int64_t mb, int chunk = 0) const;
  // The report of every micro-batch back to the host's staging, after the step.
  void download();
  // The routing tables back to the host's staging (routing replay's record), after the step.
  void download_routing();
  // Host reads of the downloaded report.
  const ops::MicroBatchReport& report(int64_t mb, int chunk = 0) const {
    return host_.report[mb * chunks_ + chunk];
  }
  const int64_t* tokens_per_expert(int64_t mb, int chunk = 0) const {
    return host_.tokens_E + (mb * chunks_ + chunk) * E_;
  }
  int chunks() const { return chunks_; }

 private:
  // The same slots in the host's staging (P = a host pointer) and on the device (DevPtr).
  template <template <typename> class P>
  struct Slots {
    P<int32_t> ids = nullptr;                   // [n_micro, tokens]
    P<int32_t> targets = nullptr;               // [n_micro, tokens]
    P<ops::MicroBatchReport> report = nullptr;  // [n_micro]
    P<int64_t> tokens_E = nullptr;              // [n_micro, max(E, 1)]
    P<ops::DropoutCounters> dropout = nullptr;  // [n_micro]
    P<int32_t> mtp_ids = nullptr;               // [n_micro, D, tokens] (D = mtp_depths)
    P<int32_t> mtp_targets = nullptr;           // [n_micro, D, tokens]
    P<int32_t> routing = nullptr;               // [n_micro, R]
  };
  template <typename T>
  using HostPtr = T*;
  template <typename S>
  void layout(Arena& a, S& s) const;

  int64_t n_micro_;
  int chunks_;
  int64_t tokens_, E_, D_, R_;
  Arena host_arena_, dev_arena_;
  Slots<HostPtr> host_;
  Slots<DevPtr> dev_;
};

}  // namespace moecore::train
