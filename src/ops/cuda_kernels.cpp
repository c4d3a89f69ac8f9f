// The table of ops and their CUDA paths (cuda_kernels.h), and the trainer's question whether the
// whole step has kernels on a device (core/exec.h declares it; the answer is the ops' to give).
#include "ops/cuda_kernels.h"

#include <string>

#include "core/exec.h"

namespace moecore {
namespace ops {

std::span<const OpKernel> op_kernels() {
  // Every op of the op headers, sorted by name. A kernel added to an op's switch flips its entry.
  // true without a kernel: the host-side queries that answer for any device (the bf16 GEMM path,
  // workspace sizes), and read_value (read_back's).
  static constexpr OpKernel kTable[] = {
    {"accumulate_counts", false}, {"activation_backward", true},
    {"activation_backward_bf16", false}, {"activation_backward_bf16w", false},
    {"activation_forward", true}, {"activation_forward_bf16", false},
    {"activation_forward_bf16w", false}, {"adamw_step", false}, {"add", true},
    {"add_from_f64", false}, {"apply_capacity", false}, {"attention_backward", false},
    {"attention_forward", false}, {"aux_loss_grad", false}, {"aux_loss_value", false},
    {"aux_scores_backward", false}, {"bf16_gemm_path", true}, {"bias_backward", true},
    {"bias_forward", true}, {"build_group_permutation", false}, {"build_permutation", false},
    {"cast_bf16_to_f32", true}, {"cast_f32_to_bf16", true}, {"copy", true},
    {"copy_row_chunks", false}, {"count_tokens_per_expert", false}, {"divide_in_place", false},
    {"dropout_add_forward", true}, {"dropout_backward", true}, {"dropout_forward", true},
    {"embedding_backward", true}, {"embedding_forward", true}, {"embedding_forward_bf16", true},
    {"expert_bias_update", false}, {"flag_at_least", false}, {"flag_nonfinite", false},
    {"fuse_qkv", false}, {"gather_row_probs", false}, {"gather_topk", false}, {"gemm", false},
    {"gemm_bf16", false}, {"gemm_bf16_workspace_elems", true}, {"grad_clip", false},
    {"group_limited_mask", false}, {"grouped_bias_backward", false},
    {"grouped_bias_forward", false}, {"grouped_gemm", false}, {"grouped_gemm_bf16", false},
    {"grouped_gemm_bf16_workspace_elems", true}, {"grouped_gemm_wgrad", false},
    {"grouped_gemm_wgrad_bf16", false}, {"grouped_gemm_wgrad_bf16_workspace_elems", true},
    {"head_loss_backward", false}, {"head_loss_bf16_workspace_elems", true},
    {"head_loss_forward", false}, {"input_jitter_advance", true}, {"input_jitter_backward", true},
    {"input_jitter_forward", true}, {"kept_prob_grads", false}, {"layernorm_backward", true},
    {"layernorm_forward", true}, {"layernorm_forward_bf16w", true}, {"linear_backward", false},
    {"linear_backward_bf16", false}, {"linear_bf16_workspace_elems", true},
    {"linear_forward", false}, {"linear_forward_bf16", false}, {"loss_grad_scale", false},
    {"narrow_from_f64", false}, {"pad_permutation", false}, {"permute_rows", false},
    {"quantile_beta_estimate", false}, {"quantile_beta_update", false}, {"read_back", true},
    {"read_value", true}, {"report_moe_layer", false}, {"rmsnorm_backward", true},
    {"rmsnorm_forward", true}, {"rmsnorm_forward_bf16w", true}, {"rope_backward", false},
    {"rope_forward", false}, {"round_f32_to_bf16", true}, {"router_scores", false},
    {"routing_key", false}, {"running_mean_counts", false}, {"scatter_row_probs", false},
    {"seq_aux_loss_grad", false}, {"seq_aux_loss_value", false}, {"sequence_positions", false},
    {"sigmoid_gate_backward", false}, {"sigmoid_gate_forward", false}, {"sinkhorn_balance", false},
    {"skip_if_flagged", false}, {"softmax_backward", false}, {"softmax_forward", false},
    {"split_qkv", false}, {"sum_squares", false}, {"sum_squares_ranges", false},
    {"swiglu_backward", true}, {"swiglu_backward_bf16", false}, {"swiglu_backward_bf16w", false},
    {"swiglu_forward", true}, {"swiglu_forward_bf16", false}, {"swiglu_forward_bf16w", false},
    {"tokens_to_sequence_major", false}, {"topk", false}, {"topk_prefix", false},
    {"topk_probs", false}, {"topk_probs_backward", false}, {"unpermute_rows", false},
    {"widen_to_f64", false}, {"z_loss_grad", false}, {"z_loss_value", false}, {"zero", true},
  };
  return kTable;
}

}  // namespace ops

bool training_step_supported(Device device, std::string* why) {
  if (device == Device::CPU) return true;
  if (!ops::kHaveCudaKernels) {
    if (why) {
      *why =
          "this moecore has no CUDA kernels (built without -DMOECORE_CUDA=ON); rebuild with it, "
          "or train with --device cpu";
    }
    return false;
  }
  std::string missing, present;
  int n_missing = 0, n_ops = 0;
  for (const ops::OpKernel& k : ops::op_kernels()) {
    std::string& list = k.cuda ? present : missing;
    list += (list.empty() ? "" : ", ") + std::string(k.op);
    n_missing += k.cuda ? 0 : 1;
    ++n_ops;
  }
  if (n_missing == 0) return true;
  if (why) {
    *why = "the CUDA backend has no kernel yet for " + std::to_string(n_missing) + " of its " +
           std::to_string(n_ops) + " ops: " + missing + " (those it runs: " + present +
           "); train with --device cpu";
  }
  return false;
}

}  // namespace moecore
