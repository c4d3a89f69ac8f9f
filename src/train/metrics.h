// What the trainer reports: the FLOPs model behind TFLOP/s and MFU, the memory breakdown, and the
// machine-readable metrics file (JSON lines, one object per logged iteration, losses with full
// round-trip precision so two runs can be compared exactly).
#pragma once

#include <array>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/profiler.h"
#include "model/config.h"
#include "ops/gemm_probe.h"
#include "ops/step_report.h"

namespace moecore::train {

// Per-token FLOPs of one training step (forward + backward = 3 x forward):
//   6 * N_active + 6 * L * Hq * D * (S + 1)
// N_active: matmul parameters a token passes through (QKV, attention output, router, the K
// routed experts' fc1/fc2, the shared expert or dense MLP, output head; not the embedding; each
// MTP depth's eh_proj, layer and the output head again).
// The attention term counts Q K^T and P V over the causal context, (S + 1) / 2 keys on average.
// With multi-latent attention N_active has its down and up projections and linear_proj, and the
// attention term is 3 * L * Hq * (qk + pe + v) * (S + 1) (the padded heads' zeros not counted).
struct FlopsModel {
  double active_matmul_params = 0;
  double attention_flops_per_token = 0;  // forward, all layers
  double train_flops_per_token() const {
    return 6.0 * active_matmul_params + 3.0 * attention_flops_per_token;
  }
};
FlopsModel flops_model(const ModelConfig& cfg);

// The GEMMs the MFU peak is probed at: the biggest dense ones (attention projection, dense MLP
// or shared expert, output head chunk) and the routed experts' fc1 at the balanced load
// (tokens * topk / E rows), each in its forward (x W^T), data-gradient (dy W) and
// weight-gradient (dy^T x) orientation. `tokens` per micro-batch; `head_chunk` as the model's.
std::vector<ops::GemmShape> peak_probe_shapes(const ModelConfig& cfg, int64_t tokens,
                                              int64_t head_chunk);

// MFU from what was achieved and the peak. The probe can under-measure (a noisy neighbour
// during the probe, or GEMM shapes that run faster in the step than in isolation); a step
// cannot beat the machine, so when the achieved rate exceeds the peak the peak is raised to
// it (MFU = 100%) and peak_raised says so. With --peak-tflops the given peak is used the same
// way. Pure: tested with synthetic numbers.
struct MfuReport {
  double achieved_gflops = 0;
  double peak_gflops = 0;  // the denominator used: max(probe or given peak, achieved)
  double mfu = 0;          // achieved / peak, in [0, 1]
  bool peak_raised = false;
};
MfuReport mfu_report(double flops, double seconds, double peak_gflops);

struct StepMetrics {
  int64_t iteration = 0;
  double lm_loss = 0;     // mean over the tokens of the global batch (interval mean when logged)
  // Multi-token prediction, depth k at [k - 1] (--mtp-num-layers of them): Megatron's mtp_k
  // loss, each micro-batch's mean cross entropy averaged over the global batch's micro-batches
  // (interval mean when logged).
  std::array<double, ops::kMaxMtpDepths> mtp_loss{};
  double aux_loss = 0;    // mean over MoE layers of aux / coeff (1.0 = balanced)
  double z_loss = 0;      // mean over MoE layers of mean(logsumexp^2) (z / coeff)
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;   // --iterations-to-skip, --skip-spiky-steps: nothing was updated
  double seconds = 0;     // wall time of the iteration (interval mean when logged)
  double tokens_per_s = 0;
  double tflops = 0;      // achieved, from flops_model
  double mfu = 0;         // tflops / measured (or given) peak
  double max_over_mean_load = 0;  // over experts, summed over layers and micro-batches
  int64_t dropped_tokens = 0;     // (token, slot) pairs dropped by capacity, all layers
  int64_t peak_mem_bytes = 0;     // peak resident set size of the process
  // Bytes this rank's EP all-to-alls sent to the other EP ranks in the step (tokens and probs of
  // dispatch, combine, their backwards and recomputation's reruns); 0 without EP.
  int64_t alltoall_bytes = 0;
  // Bytes this rank sent in the step's collectives over the attention TP group and the expert TP
  // group, by form (all-gather, reduce-scatter, all-reduce; counted by the ring algorithm,
  // parallel::CommBytesSent): TP regions, the vocab-parallel ends, the TP sums of partial
  // gradients, the experts' ETP traffic. Zeros on one-rank groups.
  struct FormBytes {
    int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
  };
  FormBytes tp_bytes, expt_tp_bytes;
  // Collectives this rank started in the step on the same two groups (Communicator::calls(),
  // CommCalls::collectives()): the TP regions' and vocab-parallel collectives, the TP sums of
  // partial gradients (one per gradient bucket), the experts' ETP collectives.
  int64_t tp_calls = 0, expt_tp_calls = 0;
  // Bytes this rank sent point-to-point over the pipeline group in the step (activations
  // forward, their gradients back, the shared table's gradient); 0 without PP.
  int64_t pp_bytes = 0;
  std::array<double, kNumPhases> phase_seconds{};  // exclusive time per phase (add up)
  // Planned bytes by kind (weights, grads, optimizer state, activations, recomputed, state,
  // workspace), as requested: buffers that share memory count in full.
  std::array<int64_t, static_cast<int>(MemKind::Count)> mem_bytes{};
  int64_t mem_planned_bytes = 0;          // what the arenas really hold
  int64_t mem_shared_saved_bytes = 0;     // saved by sharing per-layer buffers across layers
  int64_t mem_recompute_saved_bytes = 0;  // saved by activation recomputation
  // The optimizer state's sharding degree per kind (dense over dp x cp, expert over expt_dp;
  // 1: whole), and the bytes per parameter of weights + grads + optimizer state on this rank:
  // measured from the arenas, and moecore's formula (state_bytes_formula) for the same counts.
  std::array<int, 2> optim_shard_degree{1, 1};
  double state_bytes_per_param = 0;
  double state_bytes_per_param_formula = 0;
};

// What one rank holds per parameter in weights + grads + optimizer state (docs/parallel.md), for
// numel[k] parameters of each kind (dense, expert) whose sharded state is split over degree[k]
// ranks (1: whole):
//   replicated[k] + grad_bytes + sharded_bytes / d, averaged over the kinds by their counts.
// replicated[k]: the value buffers every rank holds whole, per parameter of the kind (fp32: the
// values, 4; the f64 trainer 8; --bf16: the fp32 master 4 unless the optimizer's shards hold it,
// the bf16 copy 2 (4 on the widened-bf16 GEMM path) and the f32 copies of the bf16 values that
// f32 kernels read). sharded_bytes: Adam's m and v (8), and under --bf16 with the distributed
// optimizer the fp32 master weights (4). fp32: 8 + 8/d; --bf16: 6 + 12/d with the distributed
// optimizer, 18 without (Megatron's rows), plus the f32 copies.
double state_bytes_formula(const int64_t numel[2], const int degree[2], const double replicated[2],
                           double grad_bytes, double sharded_bytes);
// The formula as text, e.g. "2 + 0.03 + 4 + 12/d (d = 4 dense, 2 expert)"; `replicated` is the
// replicated part's terms as text.
std::string state_bytes_formula_text(const int degree[2], const std::string& replicated,
                                     double grad_bytes, double sharded_bytes);

// Peak resident set size of this process in bytes.
int64_t peak_rss_bytes();

// One evaluation (--eval-interval, and after training): the mean lm loss over --eval-iters
// global batches of the validation (or test) split, and its perplexity exp(min(20, loss)) as
// Megatron logs it.
struct EvalMetrics {
  int64_t iteration = 0;
  std::string split;  // "valid" or "test"
  double lm_loss = 0;
  double ppl = 0;
  int64_t samples = 0;
};

class MetricsFile {
 public:
  // Empty path: disabled. mtp_depths: the mtp_k_loss keys each step writes (--mtp-num-layers).
  explicit MetricsFile(const std::string& path, int mtp_depths = 0);
  void write(const StepMetrics& m);
  // {"iteration", "<split>_lm_loss", "<split>_lm_loss_ppl", "<split>_samples"}
  void write(const EvalMetrics& m);

 private:
  std::ofstream out_;
  int mtp_depths_ = 0;
};

}  // namespace moecore::train
