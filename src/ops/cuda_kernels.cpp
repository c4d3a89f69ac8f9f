// The table of ops and their CUDA paths (cuda_kernels.h), and the trainer's question whether the
// whole step has kernels on a device (core/exec.h declares it; the answer is the ops' to give).
#include "ops/cuda_kernels.h"

#include <string>

#include "core/device.h"
#include "core/exec.h"

namespace moecore {
namespace ops {

std::span<const OpKernel> op_kernels() {
  // Every op of the op headers, sorted by name. A kernel added to an op's switch flips its entry.
  // true without a kernel: the host-side queries that answer for any device (the bf16 GEMM path,
  // workspace sizes, attention_path_line and grouped_gemm_path_line, attention_prepare: cuDNN's
  // plans, none elsewhere),
  // read_value (read_back's), make_rope_cache and make_rope_mla_cache
  // (ops::copy's).
  static constexpr OpKernel kTable[] = {
    {"accumulate_counts", true}, {"activation_backward", true},
    {"activation_backward_bf16", true}, {"activation_backward_bf16w", true},
    {"activation_forward", true}, {"activation_forward_bf16", true},
    {"activation_forward_bf16w", true}, {"adamw_step", true}, {"add", true},
    {"add_from_f64", true}, {"apply_capacity", true}, {"attention_backward", true},
    {"attention_forward", true}, {"attention_merge", true}, {"attention_path_line", true},
    {"attention_prepare", true}, {"aux_loss_grad", true},
    {"aux_loss_value", true},
    {"aux_scores_backward", true}, {"bf16_gemm_path", true}, {"bias_backward", true},
    {"bias_forward", true}, {"build_group_permutation", true}, {"build_permutation", true},
    {"cast_bf16_to_f32", true}, {"cast_f32_to_bf16", true}, {"copy", true},
    {"copy_row_chunks", true}, {"count_tokens_per_expert", true}, {"divide_in_place", true},
    {"dropout_add_forward", true}, {"dropout_backward", true}, {"dropout_forward", true},
    {"embedding_backward", true}, {"embedding_backward_shard", true}, {"embedding_forward", true},
    {"embedding_forward_bf16", true}, {"embedding_forward_shard", true},
    {"expert_bias_update", true}, {"flag_at_least", true}, {"flag_nonfinite", true},
    {"fuse_qkv", true}, {"gather_row_probs", true}, {"gather_topk", true}, {"gemm", true},
    {"gemm_bf16", true}, {"gemm_bf16_workspace_elems", true}, {"grad_clip", true},
    {"group_limited_mask", true}, {"grouped_bias_backward", true},
    {"grouped_bias_forward", true}, {"grouped_bias_round_bf16", true}, {"grouped_gemm", true},
    {"grouped_gemm_bf16", true},
    {"grouped_gemm_bf16_out", true}, {"grouped_gemm_bf16_workspace_elems", true},
    {"grouped_gemm_path_line", true},
    {"grouped_gemm_tables", true}, {"grouped_gemm_types", true},
    {"grouped_gemm_wgrad", true},
    {"grouped_gemm_wgrad_bf16", true}, {"grouped_gemm_wgrad_bf16_workspace_elems", true},
    {"grouped_gemm_widened_bf16_out", true}, {"grouped_gemm_workspace_bytes", true},
    {"head_loss_backward", true}, {"head_loss_bf16_workspace_elems", true},
    {"head_loss_forward", true}, {"input_jitter_advance", true}, {"input_jitter_backward", true},
    {"input_jitter_forward", true}, {"kept_prob_grads", true}, {"layernorm_backward", true},
    {"layernorm_forward", true}, {"layernorm_forward_bf16w", true}, {"linear_backward", true},
    {"linear_backward_bf16", true}, {"linear_bf16_workspace_elems", true},
    {"linear_forward", true}, {"linear_forward_bf16", true}, {"loss_grad_scale", true},
    {"make_rope_cache", true}, {"make_rope_mla_cache", true}, {"mla_merge", true},
    {"mla_split", true}, {"narrow_from_f64", true},
    {"pad_permutation", true},
    {"permute_rows", true},
    {"quantile_beta_estimate", true}, {"quantile_beta_update", true}, {"read_back", true},
    {"read_value", true}, {"report_moe_layer", true}, {"rmsnorm_backward", true},
    {"rmsnorm_forward", true}, {"rmsnorm_forward_bf16w", true}, {"roll_tokens", true},
    {"rope_backward", true},
    {"rope_forward", true}, {"rope_mla_backward", true}, {"rope_mla_forward", true},
    {"round_f32_to_bf16", true}, {"router_scores", true},
    {"routing_key", true}, {"routing_table_load", true}, {"routing_table_store", true},
    {"running_mean_counts", true}, {"scatter_row_probs", true},
    {"seq_aux_loss_grad", true}, {"seq_aux_loss_value", true}, {"sequence_positions", true},
    {"sigmoid_gate_backward", true}, {"sigmoid_gate_forward", true}, {"sinkhorn_balance", true},
    {"skip_if_flagged", true}, {"softmax_backward", true}, {"softmax_forward", true},
    {"split_qkv", true}, {"sum_squares", true}, {"sum_squares_ranges", true},
    {"swiglu_backward", true}, {"swiglu_backward_bf16", true}, {"swiglu_backward_bf16w", true},
    {"swiglu_forward", true}, {"swiglu_forward_bf16", true}, {"swiglu_forward_bf16w", true},
    {"tokens_to_sequence_major", true}, {"topk", true}, {"topk_prefix", true},
    {"topk_probs", true}, {"topk_probs_backward", true}, {"unpermute_rows", true},
    {"vocab_ce_finish", true}, {"vocab_ce_grad", true}, {"vocab_ce_row_max", true},
    {"vocab_ce_row_sums", true}, {"widen_to_f64", true}, {"z_loss_grad", true},
    {"z_loss_value", true}, {"zero", true},
  };
  return kTable;
}

}  // namespace ops

bool training_step_supported(Device device, std::string* why) {
  if (device == Device::CPU) return true;
  if (!cuda_built()) {
    if (why) {
      *why =
          "this moecore was built without CUDA (-DMOECORE_CUDA=ON); rebuild with it, or train "
          "with --device cpu";
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
