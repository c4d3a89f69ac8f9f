// The configuration a `moecore train` run uses, field by field as text: what train_command hands
// on after parse_train_args (the model config, the training config, the parallel layout), not
// TrainFlags' intermediate values (a flag parsed into one of those and never resolved reaches
// nothing). Tests compare two parses with it: a flag that is given must change the field it
// binds. Every field of those structs is listed; a field missing here fails the tests of the
// flags bound to it (their field is not found), so add it here when a config struct grows.
// Left out: TrainConfig::ckpt.run_args (the command line itself, recorded in checkpoints) and
// TrainConfig::live_progress (set from the terminal after parsing).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <string>
#include <vector>

#include "cli/train_flags.h"

namespace moecore::testing {

using RunConfigFields = std::map<std::string, std::string>;

namespace run_config_detail {

inline std::string text(bool v) { return v ? "true" : "false"; }
inline std::string text(int v) { return std::to_string(v); }
inline std::string text(int64_t v) { return std::to_string(v); }
inline std::string text(uint64_t v) { return std::to_string(v); }
inline std::string text(double v) { return fmt::format("{}", v); }
inline std::string text(const std::string& v) { return v; }
inline std::string text(const std::vector<std::string>& v) { return fmt::format("{}", fmt::join(v, " ")); }
inline std::string text(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, " ")); }
inline std::string text(const std::vector<int64_t>& v) { return fmt::format("{}", fmt::join(v, " ")); }

}  // namespace run_config_detail

inline RunConfigFields run_config_fields(const cli::TrainFlags& f) {
  using run_config_detail::text;
  RunConfigFields out;
  auto add = [&](const std::string& name, std::string value) { out[name] = std::move(value); };

  const ModelConfig& m = f.model;
  add("model.vocab_size", text(m.vocab_size));
  add("model.padded_vocab_size", text(m.padded_vocab_size));
  add("model.hidden", text(m.hidden));
  add("model.num_layers", text(m.num_layers));
  add("model.num_heads", text(m.num_heads));
  add("model.num_query_groups", text(m.num_query_groups));
  add("model.kv_channels", text(m.kv_channels));
  add("model.ffn_hidden", text(m.ffn_hidden));
  add("model.seq_length", text(m.seq_length));
  add("model.max_position_embeddings", text(m.max_position_embeddings));
  add("model.rotary_base", text(m.rotary_base));
  add("model.norm_eps", text(m.norm_eps));
  add("model.init_std", text(m.init_std));
  add("model.add_qkv_bias", text(m.add_qkv_bias));
  add("model.add_attention_output_bias", text(m.add_attention_output_bias));
  add("model.qk_layernorm", text(m.qk_layernorm));
  add("model.multi_latent_attention", text(m.multi_latent_attention));
  add("model.mla.q_lora_rank", text(m.mla.q_lora_rank));
  add("model.mla.kv_lora_rank", text(m.mla.kv_lora_rank));
  add("model.mla.qk_head_dim", text(m.mla.qk_head_dim));
  add("model.mla.qk_pos_emb_head_dim", text(m.mla.qk_pos_emb_head_dim));
  add("model.mla.v_head_dim", text(m.mla.v_head_dim));
  add("model.mla.rope_type", m.mla.rope_type == ops::RopeType::Yarn ? "yarn" : "rope");
  add("model.mla.yarn.scaling_factor", text(m.mla.yarn.scaling_factor));
  add("model.mla.yarn.original_max_position_embeddings",
      text(m.mla.yarn.original_max_position_embeddings));
  add("model.mla.yarn.beta_fast", text(m.mla.yarn.beta_fast));
  add("model.mla.yarn.beta_slow", text(m.mla.yarn.beta_slow));
  add("model.mla.yarn.mscale", text(m.mla.yarn.mscale));
  add("model.mla.yarn.mscale_all_dim", text(m.mla.yarn.mscale_all_dim));
  add("model.activation", ops::activation_name(m.activation));
  add("model.add_mlp_bias", text(m.add_mlp_bias));
  add("model.normalization", m.normalization == Normalization::LayerNorm ? "LayerNorm" : "RMSNorm");
  add("model.layernorm_1p", text(m.layernorm_1p));
  add("model.position_embedding",
      m.position_embedding == PositionEmbedding::Rope            ? "rope"
      : m.position_embedding == PositionEmbedding::LearnedAbsolute ? "learned_absolute"
                                                                   : "none");
  add("model.hidden_dropout", text(m.hidden_dropout));
  add("model.attention_dropout", text(m.attention_dropout));
  add("model.tie_embeddings", text(m.tie_embeddings));
  add("model.bf16", text(m.bf16));
  add("model.fp32_residual_connection", text(m.fp32_residual_connection));
  add("model.mtp_num_layers", text(m.mtp_num_layers));
  add("model.mtp_loss_scaling_factor", text(m.mtp_loss_scaling_factor));
  add("model.num_experts", text(m.num_experts));
  add("model.moe_layer_pattern", text(m.moe_layer_pattern));
  const MoeConfig& moe = m.moe;
  add("model.moe.ffn_hidden", text(moe.ffn_hidden));
  add("model.moe.shared_ffn_hidden", text(moe.shared_ffn_hidden));
  add("model.moe.shared_expert_gate", text(moe.shared_expert_gate));
  add("model.moe.shared_expert_overlap", text(moe.shared_expert_overlap));
  add("model.moe.dispatcher_type", dispatcher_type_name(moe.dispatcher_type));
  add("model.moe.expert_rank_capacity_factor", text(moe.expert_rank_capacity_factor));
  const RouterConfig& r = moe.router;
  add("model.moe.router.num_experts", text(r.num_experts));
  add("model.moe.router.topk", text(r.topk));
  add("model.moe.router.score", score_function_name(r.score));
  add("model.moe.router.pre_softmax", text(r.pre_softmax));
  add("model.moe.router.topk_scaling_factor", text(r.topk_scaling_factor));
  add("model.moe.router.load_balancing", load_balancing_name(r.load_balancing));
  add("model.moe.router.aux_loss_coeff", text(r.aux_loss_coeff));
  std::vector<std::string> extra;
  for (const LoadBalancingTerm& t : r.extra_load_balancing) {
    extra.push_back(fmt::format("{}:{}", load_balancing_name(t.type), t.coeff));
  }
  add("model.moe.router.extra_load_balancing", text(extra));
  add("model.moe.router.z_loss_coeff", text(r.z_loss_coeff));
  add("model.moe.router.dtype", r.dtype == RouterDType::F64 ? "fp64" : "fp32");
  add("model.moe.router.input_jitter_eps", text(r.input_jitter_eps));
  add("model.moe.router.num_groups", text(r.num_groups));
  add("model.moe.router.group_topk", text(r.group_topk));
  add("model.moe.router.enable_expert_bias", text(r.enable_expert_bias));
  add("model.moe.router.bias_update_rate", text(r.bias_update_rate));
  add("model.moe.router.quantile_ema", text(r.quantile_ema));
  add("model.moe.router.capacity_factor", text(r.capacity_factor));
  add("model.moe.router.drop_policy",
      r.drop_policy == TokenDropPolicy::Position ? "position" : "probs");
  add("model.moe.router.pad_to_capacity", text(r.pad_to_capacity));
  add("model.moe.router.megatron_aux_map", text(r.megatron_aux_map));
  add("model.moe.router.seed", text(r.seed));
  const RecomputeConfig& rc = m.recompute;
  const char* kGranularity[] = {"none", "selective", "full"};
  const char* kMethod[] = {"none", "uniform", "block"};
  add("model.recompute.granularity", kGranularity[static_cast<int>(rc.granularity)]);
  add("model.recompute.method", kMethod[static_cast<int>(rc.method)]);
  add("model.recompute.num_layers", text(rc.num_layers));
  add("model.recompute.module_names", text(rc.module_names));

  const train::TrainConfig& t = f.train;
  add("train.micro_batch", text(t.micro_batch));
  add("train.global_batch", text(t.global_batch));
  add("train.train_iters", text(t.train_iters));
  add("train.log_interval", text(t.log_interval));
  add("train.eval_interval", text(t.eval_interval));
  add("train.eval_iters", text(t.eval_iters));
  add("train.seed", text(t.seed));
  const data::DataConfig& d = t.data;
  add("train.data.data_path", text(d.data_path));
  add("train.data.split", d.split);
  add("train.data.data_cache_path", d.data_cache_path);
  add("train.data.mock_data", text(d.mock_data));
  add("train.data.eod_mask_loss", text(d.eod_mask_loss));
  add("train.data.tokenizer.type", d.tokenizer.type);
  add("train.data.tokenizer.vocab_size", text(d.tokenizer.vocab_size));
  add("train.data.tokenizer.vocab_file", d.tokenizer.vocab_file);
  add("train.data.tokenizer.merge_file", d.tokenizer.merge_file);
  add("train.data.tokenizer.tokenizer_model", d.tokenizer.tokenizer_model);
  add("train.data.synthetic_vocab", text(d.synthetic_vocab));
  add("train.data.synthetic_branching", text(d.synthetic_branching));
  const optim::LrSchedule& lr = t.lr;
  const char* kStyle[] = {"constant", "linear", "cosine", "WSD"};
  const char* kWsdStyle[] = {"linear", "cosine", "exponential", "minus_sqrt"};
  add("train.lr.max_lr", text(lr.max_lr));
  add("train.lr.min_lr", text(lr.min_lr));
  add("train.lr.warmup_init", text(lr.warmup_init));
  add("train.lr.warmup_steps", text(lr.warmup_steps));
  add("train.lr.decay_steps", text(lr.decay_steps));
  add("train.lr.style", kStyle[static_cast<int>(lr.style)]);
  add("train.lr.wsd_decay_steps", text(lr.wsd_decay_steps));
  add("train.lr.wsd_style", kWsdStyle[static_cast<int>(lr.wsd_style)]);
  const optim::AdamWConfig& adam = t.adam;
  add("train.adam.beta1", text(adam.beta1));
  add("train.adam.beta2", text(adam.beta2));
  add("train.adam.eps", text(adam.eps));
  add("train.adam.weight_decay", text(adam.weight_decay));
  add("train.adam.clip_grad", text(adam.clip_grad));
  add("train.metrics_file", t.metrics_file);
  add("train.device", t.device);
  add("train.fp32_matmul_precision", t.fp32_matmul_precision);
  add("train.sync_audit", text(t.sync_audit));
  add("train.cuda_graph_impl", t.cuda_graph_impl);
  add("train.cuda_graph_warmup_steps", text(t.cuda_graph_warmup_steps));
  add("train.peak_gflops", text(t.peak_gflops));
  add("train.ddp.overlap", text(t.ddp.overlap));
  add("train.ddp.distributed_optimizer", text(t.ddp.distributed_optimizer));
  add("train.ddp.overlap_param_gather", text(t.ddp.overlap_param_gather));
  add("train.ddp.bucket_size", text(t.ddp.bucket_size));
  add("train.guard.check_nan", text(t.guard.check_nan));
  add("train.guard.check_spiky_loss", text(t.guard.check_spiky_loss));
  add("train.guard.check_large_grads", text(t.guard.check_large_grads));
  add("train.guard.skip_spiky_steps", text(t.guard.skip_spiky_steps));
  add("train.guard.samples", text(t.guard.samples));
  add("train.iterations_to_skip", text(t.iterations_to_skip));
  const train::CheckpointConfig& c = t.ckpt;
  add("train.ckpt.save", c.save);
  add("train.ckpt.load", c.load);
  add("train.ckpt.save_interval", text(c.save_interval));
  add("train.ckpt.finetune", text(c.finetune));
  add("train.ckpt.upcycling", text(c.upcycling));
  add("train.ckpt.save_optim", text(c.save_optim));
  add("train.ckpt.load_optim", text(c.load_optim));
  add("train.ckpt.save_rng", text(c.save_rng));
  add("train.ckpt.load_rng", text(c.load_rng));
  add("train.ckpt.async_save", text(c.async_save));
  add("train.ckpt.ckpt_step", text(c.ckpt_step));
  add("train.ckpt.exit_on_missing_checkpoint", text(c.exit_on_missing_checkpoint));
  add("train.ckpt.exit_interval", text(c.exit_interval));
  add("train.ckpt.exit_duration_mins", text(c.exit_duration_mins));
  add("train.ckpt.exit_signal_handler", text(c.exit_signal_handler));
  add("train.ckpt.use_checkpoint_args", text(c.use_checkpoint_args));

  const parallel::ParallelConfig& p = f.parallel;
  add("parallel.tp", text(p.tp));
  add("parallel.pp", text(p.pp));
  add("parallel.cp", text(p.cp));
  add("parallel.cp_comm_type", text(p.cp_comm_type));
  add("parallel.ep", text(p.ep));
  add("parallel.etp", text(p.etp));
  add("parallel.sequence_parallel", text(p.sequence_parallel));
  add("parallel.use_tp_pp_dp_mapping", text(p.use_tp_pp_dp_mapping));
  add("parallel.first_stage_layers", text(p.first_stage_layers));
  add("parallel.last_stage_layers", text(p.last_stage_layers));
  add("parallel.vp_stages", text(p.vp_stages));
  add("parallel.layers_per_vp_stage", text(p.layers_per_vp_stage));
  add("parallel.microbatch_group_size", text(p.microbatch_group_size));
  add("parallel.account_for_embedding", text(p.account_for_embedding));
  add("parallel.account_for_loss", text(p.account_for_loss));
  add("parallel.layout", text(p.layout));
  add("parallel.timeout_minutes", text(p.timeout_minutes));
  return out;
}

// The fields whose values differ between two parses, "name: a -> b" each.
inline std::vector<std::string> changed_fields(const RunConfigFields& a, const RunConfigFields& b) {
  std::vector<std::string> out;
  for (const auto& [name, value] : a) {
    const auto it = b.find(name);
    const std::string other = it == b.end() ? "(missing)" : it->second;
    if (other != value) out.push_back(fmt::format("{}: {} -> {}", name, value, other));
  }
  return out;
}

}  // namespace moecore::testing
