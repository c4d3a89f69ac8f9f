#include "plan/roofline.h"

#include <algorithm>

#include "parallel/parallel_config.h"
#include "pipeline/schedule.h"

namespace moecore::plan {

Roofline roofline(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
                  const PlanFlops& flops, const CommPlan& comm) {
  const parallel::Degrees d = parallel::resolve_degrees(run.parallel, world);
  const int64_t global = run.global_batch > 0 ? run.global_batch : run.micro_batch * d.dp;
  const double n_micro = std::max<int64_t>(1, global / (run.micro_batch * d.dp));
  const double tokens = static_cast<double>(global * m.seq_length);
  const double peak = (run.bf16 ? hw.peak_tflops_bf16 : hw.peak_tflops_fp32) * 1e12;
  Roofline r;
  r.flops_per_step = flops.train_flops_per_token() * tokens;
  const double rank_flops =
      (flops.train_flops_per_token() + flops.recompute_flops_per_token) * tokens / world;
  r.compute_seconds = rank_flops / peak;
  r.exposed_comm_seconds = comm.exposed_seconds;
  r.dp_exposed_seconds = std::max(0.0, comm.overlapped_seconds - r.compute_seconds * 2.0 / 3.0);
  r.bubble_fraction = d.pp > 1 ? (d.pp - 1.0) / (virtual_stages(m, run) * n_micro) : 0.0;
  if (d.pp > 1) {
    const int vp = virtual_stages(m, run);
    for (int s = 0; s < d.pp; ++s) {
      pipeline::ScheduleConfig c;
      c.pp = d.pp;
      c.rank = s;
      c.vp = vp;
      c.num_microbatches = static_cast<int64_t>(n_micro);
      c.group_size = run.parallel.microbatch_group_size;
      r.recomputed_forwards = std::max(r.recomputed_forwards, pipeline::recomputed_forwards(c));
    }
    // One (micro-batch, chunk) forward: a third of the rank's model FLOPs of one of its M x vp
    // (micro-batch, chunk) passes.
    const double forward = flops.train_flops_per_token() * tokens / world / peak / 3.0 /
                           (n_micro * vp);
    r.pipeline_recompute_seconds = static_cast<double>(r.recomputed_forwards) * forward;
  }
  r.step_seconds = (r.compute_seconds + r.pipeline_recompute_seconds + r.exposed_comm_seconds) *
                       (1 + r.bubble_fraction) +
                   r.dp_exposed_seconds;
  r.tokens_per_second = tokens / r.step_seconds;
  r.tflops_per_gpu = r.flops_per_step / r.step_seconds / world / 1e12;
  r.mfu = r.tflops_per_gpu * 1e12 / peak;
  return r;
}

}  // namespace moecore::plan
