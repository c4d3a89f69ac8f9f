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
  // workspace sizes), read_value (read_back's) and make_rope_cache (ops::copy's).
  static constexpr OpKernel kTable[] = {
    {"accumulate_counts", true}, {"activation_backward", true},
    {"activation_backward_bf16", false}, {"activation_backward_bf16w", false},
    {"activation_forward", true}, {"activation_forward_bf16", false},
    {"activation_forward_bf16w", false}, {"adamw_step", false}, {"add", true},
    {"add_from_f64", false}, {"apply_capacity", false}, {"attention_backward", true},
    {"attention_forward", true}, {"aux_loss_grad", true}, {"aux_loss_value", true},
    {"aux_scores_backward", false}, {"bf16_gemm_path", true}, {"bias_backward", true},
    {"bias_forward", true}, {"build_group_permutation", true}, {"build_permutation", true},
    {"cast_bf16_to_f32", true}, {"cast_f32_to_bf16", true}, {"copy", true},
    {"copy_row_chunks", true}, {"count_tokens_per_expert", true}, {"divide_in_place", true},
    {"dropout_add_forward", false}, {"dropout_backward", false}, {"dropout_forward", false},
    {"embedding_backward", false}, {"embedding_forward", false}, {"embedding_forward_bf16", false},
    {"expert_bias_update", true}, {"flag_at_least", false}, {"flag_nonfinite", false},
    {"fuse_qkv", true}, {"gather_row_probs", true}, {"gather_topk", true}, {"gemm", false},
    {"gemm_bf16", false}, {"gemm_bf16_workspace_elems", true}, {"grad_clip", false},
    {"group_limited_mask", false}, {"grouped_bias_backward", false},
    {"grouped_bias_forward", false}, {"grouped_gemm", false}, {"grouped_gemm_bf16", false},
    {"grouped_gemm_bf16_workspace_elems", true}, {"grouped_gemm_wgrad", false},
    {"grouped_gemm_wgrad_bf16", false}, {"grouped_gemm_wgrad_bf16_workspace_elems", true},
    {"head_loss_backward", false}, {"head_loss_bf16_workspace_elems", true},
    {"head_loss_forward", false}, {"input_jitter_advance", false}, {"input_jitter_backward", false},
    {"input_jitter_forward", false}, {"kept_prob_grads", true}, {"layernorm_backward", false},
    {"layernorm_forward", false}, {"layernorm_forward_bf16w", false}, {"linear_backward", false},
    {"linear_backward_bf16", false}, {"linear_bf16_workspace_elems", true},
    {"linear_forward", false}, {"linear_forward_bf16", false}, {"loss_grad_scale", false},
    {"make_rope_cache", true}, {"narrow_from_f64", false}, {"pad_permutation", true},
    {"permute_rows", true},
    {"quantile_beta_estimate", true}, {"quantile_beta_update", true}, {"read_back", true},
    {"read_value", true}, {"report_moe_layer", false}, {"rmsnorm_backward", true},
    {"rmsnorm_forward", true}, {"rmsnorm_forward_bf16w", false}, {"rope_backward", true},
    {"rope_forward", true}, {"round_f32_to_bf16", true}, {"router_scores", false},
    {"routing_key", false}, {"running_mean_counts", true}, {"scatter_row_probs", true},
    {"seq_aux_loss_grad", true}, {"seq_aux_loss_value", true}, {"sequence_positions", true},
    {"sigmoid_gate_backward", true}, {"sigmoid_gate_forward", true}, {"sinkhorn_balance", false},
    {"skip_if_flagged", false}, {"softmax_backward", false}, {"softmax_forward", false},
    {"split_qkv", true}, {"sum_squares", false}, {"sum_squares_ranges", false},
    {"swiglu_backward", true}, {"swiglu_backward_bf16", false}, {"swiglu_backward_bf16w", false},
    {"swiglu_forward", true}, {"swiglu_forward_bf16", false}, {"swiglu_forward_bf16w", false},
    {"tokens_to_sequence_major", true}, {"topk", false}, {"topk_prefix", false},
    {"topk_probs", true}, {"topk_probs_backward", true}, {"unpermute_rows", true},
    {"widen_to_f64", false}, {"z_loss_grad", true}, {"z_loss_value", true}, {"zero", true},
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
