// Memory per rank of a layout, for every pipeline stage. One memory model: where the trainer
// builds the model and layout (no TP / CP / ETP, no MLA / MTP), the figures are the trainer's own
// planning pass (GPTModel and AdamW sized in a sizing-only arena for this rank, EP dispatchers
// on sizing groups), and only what the arena cannot know is added by formula: micro-batches in
// flight under pipeline schedules, the distributed optimizer's sharding, the embedding / head
// that a pipeline stage does not hold, device-library reservations. Otherwise every figure is a
// formula (Megatron's GPU accounting, written out in `formula`), and labelled so.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/grad_buckets.h"
#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/param_count.h"

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
  int64_t first_layer = 0, num_layers = 0;
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
  // Activations of one micro-batch of one layer, by formula, and the in-flight factor.
  double act_layer_bytes = 0;
  double in_flight_layers = 0;      // layer x micro-batch activations held at the peak
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

// The trainer's per-kind plan for the whole model on rank `rank` of `layout` (the sizing-only
// planning pass): bytes_of each MemKind of the model arena plus the optimizer's (what the
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
  // The group size each kind's optimizer state is sharded over (dense, expert; 1: whole).
  std::array<int, 2> shard_degree{1, 1};
};
// device: the backend the pass sizes for (a context that is never run: nothing is allocated).
// ddp: --use-distributed-optimizer and --ddp-bucket-size (the shards follow the buckets).
ArenaSizes trainer_arena_sizes(const ModelConfig& cfg, int64_t micro_batch,
                               const parallel::ParallelConfig& parallel, int world, int rank,
                               Device device = Device::CPU,
                               const parallel::GradReduceConfig& ddp = {});

}  // namespace moecore::plan
