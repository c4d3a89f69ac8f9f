// A roofline estimate of one training step: the rank's FLOPs at the hardware's dense peak, plus
// the communication that is not overlapped and the forwards the pipeline runner recomputes,
// stretched by the pipeline bubble; gradient
// reduction overlaps the backward and only what exceeds it shows. What it leaves out (kernel
// efficiency below peak, memory-bound ops, host overhead, load imbalance) is in docs/plan.md.
#pragma once

#include "plan/comm_model.h"
#include "plan/flops.h"
#include "plan/hardware.h"
#include "plan/model_spec.h"

namespace moecore::plan {

struct Roofline {
  double flops_per_step = 0;       // model FLOPs of the global batch (no recomputation)
  double compute_seconds = 0;      // per rank, recomputation included, at peak
  double exposed_comm_seconds = 0; // all-to-all, TP, CP, PP transfers
  double dp_exposed_seconds = 0;   // gradient reduction beyond the backward it overlaps
  double bubble_fraction = 0;      // (pp - 1) / (vpp x micro-batches)
  // The pipeline runner's recomputed forwards (pipeline::recomputed_forwards of the stage that
  // recomputes most) and their time: each a forward of one micro-batch through one chunk, a third
  // of that chunk's training FLOPs.
  int64_t recomputed_forwards = 0;
  double pipeline_recompute_seconds = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  double tflops_per_gpu = 0;       // model FLOPs / step / GPUs (Megatron's "TFLOP/s per GPU")
  double mfu = 0;
};

Roofline roofline(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
                  const PlanFlops& flops, const CommPlan& comm);

}  // namespace moecore::plan
