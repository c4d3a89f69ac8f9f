#include "plan/model_spec.h"

#include "parallel/pipeline_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/check.h"
#include "cli/megatron_arguments.h"
#include "cli/data_flags.h"
#include "cli/train_flags.h"

namespace moecore::plan {
namespace {

// The value of a Megatron flag as text: its last occurrence, else Megatron's default ("" = None).
std::string text(const cli::ParsedArgs& a, const std::string& flag) {
  const cli::MegatronFlag* f = cli::megatron_arguments().find(flag);
  MOE_CHECK(f != nullptr, "[plan] {} is not a Megatron flag", flag);
  if (const cli::GivenFlag* g = a.find_dest(f->dest)) return g->value_text();
  return cli::default_text(*f);
}

int64_t int_or(const cli::ParsedArgs& a, const std::string& flag, int64_t none) {
  const std::string t = text(a, flag);
  return t.empty() || t == "None" ? none : std::stoll(t);
}

int64_t required_int(const cli::ParsedArgs& a, const std::string& flag) {
  const std::string t = text(a, flag);
  MOE_CHECK(!t.empty() && t != "None",
            "[plan] {} is required (or give --config FILE / --hf-config FILE)", flag);
  return std::stoll(t);
}

bool on(const cli::ParsedArgs& a, const std::string& flag) { return text(a, flag) == "true"; }

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// A size: at least `min`, named by the flag (or the config.json key) it came from.
void check_size(int64_t v, int64_t min, const std::string& name) {
  MOE_CHECK(v >= min, "[plan] {}={} must be >= {}", name, v, min);
}

}  // namespace

void check_num_layers(int64_t n, const std::string& name) {
  MOE_CHECK(n >= 1 && n <= kMaxPlanLayers,
            "[plan] {}={} must be in [1, {}]: the planner builds each layer of a stage (the "
            "largest published models have under 200)",
            name, n, kMaxPlanLayers);
}

void check_model_spec(const ModelSpec& m, const RunSpec& run, bool from_hf) {
  // The flag, or the config.json key, each size came from.
  auto name = [&](const char* flag, const char* hf_key) {
    return std::string(from_hf ? hf_key : flag);
  };
  check_num_layers(m.num_layers, name("--num-layers", "num_hidden_layers"));
  check_size(m.hidden, 1, name("--hidden-size", "hidden_size"));
  check_size(m.num_heads, 1, name("--num-attention-heads", "num_attention_heads"));
  check_size(m.num_query_groups, 1, name("--num-query-groups", "num_key_value_heads"));
  check_size(m.kv_channels, 1, name("--kv-channels", "head_dim"));
  check_size(m.ffn_hidden, 1, name("--ffn-hidden-size", "intermediate_size"));
  check_size(m.vocab_size, 1, name("--vocab-size", "vocab_size"));
  check_size(m.seq_length, 1, "--seq-length");
  check_size(m.num_experts, 0, name("--num-experts", "num_experts"));
  check_size(m.mtp_num_layers, 0, name("--mtp-num-layers", "num_nextn_predict_layers"));
  check_size(run.micro_batch, 1, "--micro-batch-size");
  check_size(run.global_batch, 0, "--global-batch-size");
  if (m.num_experts > 0) {
    check_size(m.moe_ffn_hidden, 1, name("--moe-ffn-hidden-size", "moe_intermediate_size"));
    check_size(m.shared_ffn_hidden, 0,
               name("--moe-shared-expert-intermediate-size", "shared_expert_intermediate_size"));
    MOE_CHECK(m.topk >= 1 && m.topk <= m.num_experts, "[plan] {}={} must be in [1, {}={}]",
              name("--moe-router-topk", "num_experts_per_tok"), m.topk,
              name("--num-experts", "num_experts"), m.num_experts);
  }
  if (m.mla) {
    check_size(m.mla->q_lora_rank, 0, name("--q-lora-rank", "q_lora_rank"));
    check_size(m.mla->kv_lora_rank, 1, name("--kv-lora-rank", "kv_lora_rank"));
    check_size(m.mla->qk_head_dim, 1, name("--qk-head-dim", "qk_nope_head_dim"));
    check_size(m.mla->qk_pos_emb_head_dim, 0, name("--qk-pos-emb-head-dim", "qk_rope_head_dim"));
    check_size(m.mla->v_head_dim, 1, name("--v-head-dim", "v_head_dim"));
  }
  // The sizes in bytes, in floating point before any int64 count: parameters with gradients and
  // AdamW state (16 B each in fp32), and one micro-batch's widest activations per layer. Past
  // kMaxPlanBytes no machine holds them, and the planner's byte counts would overflow.
  const double L = static_cast<double>(m.num_layers), H = static_cast<double>(m.hidden);
  const double V = static_cast<double>(m.vocab_size);
  const double attn = static_cast<double>(m.num_heads + 2 * m.num_query_groups) *
                      static_cast<double>(m.kv_channels);
  const double ffn = 3.0 * static_cast<double>(m.ffn_hidden);
  const double experts = 3.0 * static_cast<double>(m.num_experts) *
                         static_cast<double>(m.moe_ffn_hidden) +
                         3.0 * static_cast<double>(m.shared_ffn_hidden);
  const double params = 2 * V * H + L * H * (2 * attn + ffn + experts + 4);
  const double T = static_cast<double>(m.seq_length) * static_cast<double>(run.micro_batch);
  const double widest = std::max({V, attn, ffn, 3.0 * static_cast<double>(m.moe_ffn_hidden) *
                                                    static_cast<double>(std::max<int64_t>(m.topk, 1))});
  const double activations = T * 4 * (V + L * (8 * H + widest));
  MOE_CHECK(params * 16 <= kMaxPlanBytes && activations <= kMaxPlanBytes,
            "[plan] the model needs about {:.3g} bytes of parameters, gradients and AdamW state "
            "({:.3g} parameters) and {:.3g} bytes of activations per micro-batch (--seq-length {} "
            "x --micro-batch-size {} tokens): beyond {:.3g} bytes ({} EiB), more than any machine; "
            "check the sizes (hidden {}, layers {}, vocab {}, ffn {}, experts {} x {})",
            params * 16, params, activations, m.seq_length, run.micro_batch,
            static_cast<double>(kMaxPlanBytes), kMaxPlanBytes >> 60, m.hidden, m.num_layers,
            m.vocab_size, m.ffn_hidden, m.num_experts, m.moe_ffn_hidden);
}

int64_t ModelSpec::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l);
  return n;
}

ModelSpec model_from_args(const cli::ParsedArgs& a) {
  ModelSpec m;
  m.num_layers = required_int(a, "--num-layers");
  // Before anything is sized by it (the MoE layer pattern).
  check_num_layers(m.num_layers, "--num-layers");
  m.hidden = required_int(a, "--hidden-size");
  m.num_heads = required_int(a, "--num-attention-heads");
  m.seq_length = required_int(a, "--seq-length");
  m.max_position_embeddings = int_or(a, "--max-position-embeddings", m.seq_length);
  m.num_query_groups =
      on(a, "--group-query-attention") ? int_or(a, "--num-query-groups", 1) : m.num_heads;
  m.kv_channels = int_or(a, "--kv-channels", m.hidden / std::max<int64_t>(1, m.num_heads));
  // Megatron: --ffn-hidden-size defaults to 4h, with SwiGLU 2/3 of that rounded to 64.
  // Given (any value, checked by check_model_spec) or derived when None.
  const std::string ffn_text = text(a, "--ffn-hidden-size");
  const int64_t ffn = ffn_text.empty() || ffn_text == "None"
                          ? (on(a, "--swiglu") ? (8 * m.hidden / 3 + 63) / 64 * 64 : 4 * m.hidden)
                          : std::stoll(ffn_text);
  m.ffn_hidden = ffn;
  m.tie_embeddings = !on(a, "--untie-embeddings-and-output-weights");
  // Megatron's MLP activation: --swiglu, else --squared-relu, else F.gelu; --openai-gelu (the
  // tanh form) is read by Megatron's legacy models only, taken here as moecore's ModelConfig
  // takes it.
  m.activation = on(a, "--swiglu")         ? ops::Activation::SwiGLU
                 : on(a, "--squared-relu") ? ops::Activation::SquaredReLU
                 : on(a, "--openai-gelu")  ? ops::Activation::GeLUTanh
                                           : ops::Activation::GeLU;
  // --disable-bias-linear stores false into add_bias_linear (default true).
  m.add_mlp_bias = text(a, "--disable-bias-linear") == "true";
  // Megatron's --add-bias-linear also gives QKV and the output projection their biases.
  m.add_qkv_bias = on(a, "--add-qkv-bias") || m.add_mlp_bias;
  m.add_attention_output_bias = m.add_mlp_bias;
  m.layernorm = text(a, "--normalization") == "LayerNorm";
  m.learned_positions = text(a, "--position-embedding-type") == "learned_absolute";
  m.qk_layernorm = on(a, "--qk-layernorm");
  m.num_experts = int_or(a, "--num-experts", 0);
  m.moe_ffn_hidden = int_or(a, "--moe-ffn-hidden-size", m.ffn_hidden);
  m.shared_ffn_hidden = int_or(a, "--moe-shared-expert-intermediate-size", 0);
  m.topk = int_or(a, "--moe-router-topk", 2);
  if (m.num_experts > 0) {
    m.moe_layer_pattern = parse_moe_layer_freq(text(a, "--moe-layer-freq"), m.num_layers);
  }
  if (on(a, "--multi-latent-attention")) {
    MlaSpec s;
    s.q_lora_rank = int_or(a, "--q-lora-rank", 0);
    s.kv_lora_rank = int_or(a, "--kv-lora-rank", 32);
    s.qk_head_dim = int_or(a, "--qk-head-dim", 128);
    s.qk_pos_emb_head_dim = int_or(a, "--qk-pos-emb-head-dim", 64);
    s.v_head_dim = int_or(a, "--v-head-dim", 128);
    m.mla = s;
  }
  m.mtp_num_layers = int_or(a, "--mtp-num-layers", 0);
  // As the trainer: the synthetic language (no data flags) defaults to bytes.
  const bool synthetic = text(a, "--data-path").empty() && !on(a, "--mock-data");
  m.vocab_unpadded = m.vocab_size = synthetic
                                         ? int_or(a, "--vocab-size", cli::kSyntheticDefaultVocab)
                                         : required_int(a, "--vocab-size");
  return m;
}

void pad_vocab(ModelSpec& m, const cli::ParsedArgs& a, int tp) {
  const int64_t div = int_or(a, "--make-vocab-size-divisible-by", 128) * tp;
  m.vocab_size = text(a, "--no-pad-vocab-size") == "false"
                     ? m.vocab_unpadded
                     : cli::padded_vocab_size(m.vocab_unpadded, div);
}

int virtual_stages(const ModelSpec& m, const RunSpec& run) {
  if (run.parallel.pp <= 1) return 1;
  return parallel::pipeline_layout(run.parallel, m.num_layers, m.mtp_num_layers).vp;
}

RunSpec run_from_args(const cli::ParsedArgs& a) {
  RunSpec r;
  r.parallel.tp = static_cast<int>(int_or(a, "--tensor-model-parallel-size", 1));
  r.parallel.pp = static_cast<int>(int_or(a, "--pipeline-model-parallel-size", 1));
  r.parallel.cp = static_cast<int>(int_or(a, "--context-parallel-size", 1));
  if (const std::vector<std::string> t = words(text(a, "--cp-comm-type")); !t.empty())
    r.parallel.cp_comm_type = t;
  r.parallel.ep = static_cast<int>(int_or(a, "--expert-model-parallel-size", 1));
  r.parallel.etp = static_cast<int>(int_or(a, "--expert-tensor-parallel-size", 0));
  r.parallel.sequence_parallel = on(a, "--sequence-parallel");
  r.parallel.first_stage_layers =
      static_cast<int>(int_or(a, "--decoder-first-pipeline-num-layers", 0));
  r.parallel.last_stage_layers =
      static_cast<int>(int_or(a, "--decoder-last-pipeline-num-layers", 0));
  r.parallel.vp_stages = static_cast<int>(int_or(a, "--num-virtual-stages-per-pipeline-rank", 0));
  r.parallel.layers_per_vp_stage =
      static_cast<int>(int_or(a, "--num-layers-per-virtual-pipeline-stage", 0));
  r.parallel.microbatch_group_size =
      static_cast<int>(int_or(a, "--microbatch-group-size-per-virtual-pipeline-stage", 0));
  r.parallel.account_for_embedding = on(a, "--account-for-embedding-in-pipeline-split");
  r.parallel.account_for_loss = on(a, "--account-for-loss-in-pipeline-split");
  const std::string layout = text(a, "--pipeline-model-parallel-layout");
  r.parallel.layout = layout == "None" ? "" : layout;
  r.micro_batch = int_or(a, "--micro-batch-size", 1);
  r.global_batch = int_or(a, "--global-batch-size", 0);
  r.bf16 = on(a, "--bf16");
  r.fp32_residual_connection = on(a, "--fp32-residual-connection");
  r.distributed_optimizer = on(a, "--use-distributed-optimizer");
  r.ddp_bucket_size = int_or(a, "--ddp-bucket-size", 0);
  auto dtype_bytes = [](const std::string& t) {
    return t == "fp8" ? 1.0 : (t == "fp16" || t == "bf16") ? 2.0 : 4.0;
  };
  r.main_param_bytes = dtype_bytes(text(a, "--main-params-dtype"));
  r.main_grad_bytes = dtype_bytes(text(a, "--main-grads-dtype"));
  r.exp_avg_bytes = dtype_bytes(text(a, "--exp-avg-dtype"));
  r.exp_avg_sq_bytes = dtype_bytes(text(a, "--exp-avg-sq-dtype"));
  r.fp8 = !text(a, "--fp8-format").empty();
  const std::string gran = text(a, "--recompute-granularity");
  const std::string method = text(a, "--recompute-method");
  if (gran == "full") r.recompute.granularity = RecomputeGranularity::Full;
  if (gran == "selective") r.recompute.granularity = RecomputeGranularity::Selective;
  if (method == "uniform") r.recompute.method = RecomputeMethod::Uniform;
  if (method == "block") r.recompute.method = RecomputeMethod::Block;
  r.recompute.num_layers = int_or(a, "--recompute-num-layers", 0);
  if (on(a, "--recompute-activations")) r.recompute.granularity = RecomputeGranularity::Selective;
  const std::string mods = text(a, "--recompute-modules");
  r.recompute_modules = mods.empty() ? std::vector<std::string>{"core_attn"} : words(mods);
  r.recompute.module_names.clear();
  for (const std::string& s : r.recompute_modules) {
    if (s != "mla_up_proj") r.recompute.module_names.push_back(s);
  }
  if (r.recompute.module_names.empty()) r.recompute.module_names = {"core_attn"};
  r.dispatcher = text(a, "--moe-token-dispatcher-type");
  const std::string cf = text(a, "--moe-expert-capacity-factor");
  const double factor = cf.empty() || cf == "None" ? 0.0 : std::stod(cf);
  MOE_CHECK(std::isfinite(factor), "[plan] --moe-expert-capacity-factor {} is not a finite number",
            cf);
  r.capacity_factor = std::max(0.0, factor);
  r.pad_to_capacity = on(a, "--moe-pad-expert-input-to-capacity");
  return r;
}

RecomputeConfig trainer_recompute(const RunSpec& run, bool multi_latent_attention) {
  RecomputeConfig r = run.recompute;
  if (multi_latent_attention && r.selective() && !run.recompute_modules.empty())
    r.module_names = run.recompute_modules;
  return r;
}

ModelConfig trainer_model_config(const ModelSpec& m, const RunSpec& run, int64_t first_layer,
                                 int64_t num_layers) {
  if (num_layers < 0) num_layers = m.num_layers - first_layer;
  ModelConfig c;
  c.vocab_size = m.vocab_unpadded > 0 ? m.vocab_unpadded : m.vocab_size;
  c.padded_vocab_size = m.vocab_size;
  c.hidden = m.hidden;
  c.num_layers = num_layers;
  c.num_heads = m.num_heads;
  c.num_query_groups = m.num_query_groups;
  c.kv_channels = m.kv_channels;
  c.ffn_hidden = m.ffn_hidden;
  c.activation = m.activation;
  c.add_mlp_bias = m.add_mlp_bias;
  c.seq_length = m.seq_length;
  c.max_position_embeddings = m.max_position_embeddings;
  c.add_qkv_bias = m.add_qkv_bias;
  c.add_attention_output_bias = m.add_attention_output_bias;
  c.qk_layernorm = m.qk_layernorm;
  c.normalization = m.layernorm ? Normalization::LayerNorm : Normalization::RMSNorm;
  c.position_embedding =
      m.learned_positions ? PositionEmbedding::LearnedAbsolute : PositionEmbedding::Rope;
  c.tie_embeddings = m.tie_embeddings;
  c.mtp_num_layers = m.mtp_num_layers;
  c.bf16 = run.bf16;
  c.fp32_residual_connection = run.fp32_residual_connection;
  c.num_experts = m.num_experts;
  if (m.num_experts > 0) {
    if (m.moe_layer_pattern.empty()) {  // every layer an MoE layer (ModelSpec::is_moe_layer)
      c.moe_layer_pattern.assign(num_layers, 1);
    } else {
      c.moe_layer_pattern.assign(m.moe_layer_pattern.begin() + first_layer,
                                 m.moe_layer_pattern.begin() + first_layer + num_layers);
    }
    c.moe.router.num_experts = m.num_experts;
    c.moe.router.topk = m.topk;
    c.moe.ffn_hidden = m.moe_ffn_hidden;
    c.moe.shared_ffn_hidden = m.shared_ffn_hidden;
    // Softmax top-1 without pre-softmax gives no router gradient: the trainer refuses it.
    c.moe.router.pre_softmax = m.topk == 1;
  }
  if (m.mla) {
    c.multi_latent_attention = true;
    c.mla.q_lora_rank = m.mla->q_lora_rank;
    c.mla.kv_lora_rank = m.mla->kv_lora_rank;
    c.mla.qk_head_dim = m.mla->qk_head_dim;
    c.mla.qk_pos_emb_head_dim = m.mla->qk_pos_emb_head_dim;
    c.mla.v_head_dim = m.mla->v_head_dim;
  }
  c.recompute = trainer_recompute(run, m.mla.has_value());
  if (c.recompute.full() && c.recompute.num_layers > num_layers) c.recompute.num_layers = num_layers;
  return c;
}

}  // namespace moecore::plan
