// Memory per rank of a layout, for every pipeline stage. One memory model: where the trainer
// builds the model and layout (no CP, no MLA, MTP beside the loss), the figures are the trainer's own
// planning pass (the stage's GPTModel chunks, its pipeline runner's buffers and AdamW sized in
// sizing-only arenas for this rank, EP dispatchers on sizing groups), and only what the arena
// cannot know is added by formula (communication scratch, device-library reservations). Otherwise every figure is a
// formula (Megatron's GPU accounting, written out in `formula`), and labelled so.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/grad_buckets.h"
#include "parallel/pipeline_layout.h"
#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/param_count.h"
#include "pipeline/pipeline_runner.h"

namespace moecore::plan {

enum class MemPart : uint8_t {
  Weights,
  Grads,
  Optimizer,
  Activations,
  Recomputed,
  State,
  Workspace,
  CommBuffers,
  Reserved,
  Count
};
constexpr int kNumMemParts = static_cast<int>(MemPart::Count);
const char* mem_part_name(MemPart p);

struct MemLine {
  MemPart part;
  double bytes = 0;     // may be negative (a correction)
  std::string what;
  std::string formula;  // empty: from the arena's planning pass
};

struct StageMemory {
  int stage = 0;
  int64_t first_layer = 0, num_layers = 0;  // its first chunk's first layer; all its layers
  std::vector<parallel::VirtualStage> chunks;  // its virtual stages (pipeline_layout)
  bool has_embedding = false, has_head = false, has_mtp = false;
  // Parameters held by one rank of this stage.
  int64_t params_dense = 0, params_expert = 0, params_embedding = 0, params_head = 0;
  bool from_arena = false;          // the trainer's planning pass ran for this rank
  std::string why_formula;          // why the formulas (when !from_arena)
  double arena_planned = 0;         // the trainer's planned bytes (arena block + optimizer)
  double sharing_saves = 0;         // what the arena's overlays save (inside arena_planned)
  std::vector<MemLine> lines;
  std::array<double, kNumMemParts> by_part{};  // requested bytes by part (lines summed)
  double total = 0;                 // what the rank needs: planned + every formula line
  double pipeline_planned = 0;      // the pipeline runner's arena (inside arena_planned)
  // The stage's schedule (pp > 1): warm-up forwards, micro-batches in flight per chunk, the
  // forwards the runner recomputes before their backward, and the bytes of one boundary
  // activation (what crosses to a neighbouring stage per micro-batch, each way).
  int64_t num_microbatches = 1, warmup_forwards = 0, recomputed_forwards = 0;
  std::vector<int64_t> in_flight;
  double boundary_bytes = 0;
  // Activations of one micro-batch of one layer, by formula, and the in-flight factor.
  double act_layer_bytes = 0;
  // Megatron's schedule: layer x micro-batch activations it keeps at the peak (it stores every
  // in-flight micro-batch's activations; moecore's runner keeps their inputs and recomputes).
  // The formula path's figure; informational beside the trainer's pass.
  double in_flight_layers = 0;
  std::string act_formula;
};

struct MemoryPlan {
  std::vector<StageMemory> stages;  // one per pipeline stage
  double max_total = 0;             // the worst stage
  int worst_stage = 0;
};

// Sizes one rank of each stage. micro-batches per step per dp rank = global / (micro x dp).
// trainer_cfg: the whole model as `moecore train` parses the same flags (null: built from m).
MemoryPlan plan_memory(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
                       const ModelConfig* trainer_cfg = nullptr);

// The trainer's per-kind plan for rank `rank` of `layout` (the sizing-only planning pass: the
// whole model, or with pipeline parallelism the rank's stage, its chunks as the trainer builds
// them): bytes_of each MemKind of the model arena plus the optimizer's (what the
// trainer's StepMetrics::mem_bytes reports), and the planned total (mem_planned_bytes).
struct ArenaSizes {
  std::array<double, 7> by_kind{};
  double planned = 0;
  double sharing_saves = 0;
  double recompute_saves = 0;
  int64_t numel_dense = 0, numel_expert = 0;
  // --bf16 on the native bf16 GEMM path: the elements with an f32 copy of their bf16 values
  // (the parameters f32 kernels read: norms, biases, routers, embeddings).
  int64_t numel_values32 = 0;
  // Whether the fp32 master weights are the optimizer's (--bf16, sharded: counted in its state).
  bool master_in_optimizer = false;
  // Pipeline parallelism: the runner's buffers for this rank's schedule (its own arena beside
  // the model's: PipelineRunner::planned_bytes()), and one boundary activation's elements.
  pipeline::PipelineBufferSizes pipeline;
  double pipeline_planned = 0;
  int64_t boundary_elems = 0;
  // The group size each kind's optimizer state is sharded over (dense, expert; 1: whole).
  std::array<int, 2> shard_degree{1, 1};
};
// device: the backend the pass sizes for (a context that is never run: nothing is allocated).
// ddp: --use-distributed-optimizer and --ddp-bucket-size (the shards follow the buckets).
// num_microbatches: per step per data-parallel rank (sizes the pipeline runner's stash).
ArenaSizes trainer_arena_sizes(const ModelConfig& cfg, int64_t micro_batch,
                               const parallel::ParallelConfig& parallel, int world, int rank,
                               Device device = Device::CPU,
                               const parallel::GradReduceConfig& ddp = {},
                               int64_t num_microbatches = 1);

}  // namespace moecore::plan
