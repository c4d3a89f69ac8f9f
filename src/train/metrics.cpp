#include "train/metrics.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <sys/resource.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moecore::train {

FlopsModel flops_model(const ModelConfig& cfg) {
  const double H = cfg.hidden, D = cfg.head_dim(), Hq = cfg.num_heads, Hkv = cfg.num_query_groups;
  FlopsModel f;
  // Multi-latent attention: its projections, and Q K^T over qk + pe, P V over v per head.
  const MlaConfig& mla = cfg.mla;
  double attn_params = H * (Hq + 2 * Hkv) * D + Hq * D * H;  // linear_qkv + linear_proj
  double attn_dims = 2.0 * D;
  if (cfg.multi_latent_attention) {
    const double ql = mla.q_lora_rank, kl = mla.kv_lora_rank, dq = mla.q_head_dim(),
                 dv = mla.v_head_dim;
    attn_params = (ql > 0 ? H * ql + ql * Hq * dq : H * Hq * dq) +
                  H * (kl + mla.qk_pos_emb_head_dim) + kl * Hq * (mla.qk_head_dim + dv) +
                  Hq * dv * H;
    attn_dims = dq + dv;
  }
  // The decoder's layers, then each MTP depth's (the last layer's kind) with its eh_proj and its
  // pass through the output head.
  for (int64_t l = 0; l < cfg.num_layers + cfg.mtp_num_layers; ++l) {
    const bool mtp = l >= cfg.num_layers;
    double p = attn_params;
    if (mtp) p += 2.0 * H * H + H * cfg.padded_vocab();  // eh_proj, the head again
    if (mtp ? cfg.mtp_is_moe() : cfg.is_moe_layer(l)) {
      const double E = cfg.num_experts, K = cfg.moe.router.topk;
      p += H * E;                                          // router
      p += K * 3.0 * H * cfg.moe.ffn_hidden;               // routed experts (fc1 is 2F x H)
      p += 3.0 * H * cfg.moe.shared_ffn_hidden;            // shared expert
      if (cfg.moe.shared_expert_gate) p += H;              // its gate
    } else {
      p += 3.0 * H * cfg.ffn_hidden;
    }
    f.active_matmul_params += p;
    f.attention_flops_per_token += Hq * attn_dims * (cfg.seq_length + 1);
  }
  // The output head of the padded vocabulary, as Megatron and the planner count it (the padding
  // rows are not computed here: the head's GEMMs run over the model's rows).
  f.active_matmul_params += H * cfg.padded_vocab();
  return f;
}

std::vector<ops::GemmShape> peak_probe_shapes(const ModelConfig& cfg, int64_t tokens,
                                              int64_t head_chunk) {
  std::vector<ops::GemmShape> shapes;
  // y[m, n] = x[m, k] W[n, k]^T, and its two backward GEMMs.
  auto linear = [&](int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0 || k <= 0) return;
    shapes.push_back({false, true, m, n, k});   // forward
    shapes.push_back({false, false, m, k, n});  // dx = dy W
    shapes.push_back({true, false, n, k, m});   // dW += dy^T x
  };
  const int64_t H = cfg.hidden, D = cfg.head_dim();
  if (cfg.multi_latent_attention) {  // the up projections and linear_proj
    const MlaConfig& m = cfg.mla;
    linear(tokens, cfg.num_heads * m.q_head_dim(), m.q_lora_rank > 0 ? m.q_lora_rank : H);
    linear(tokens, cfg.num_heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank);
    linear(tokens, H, cfg.num_heads * m.v_head_dim);
  } else {
    const int64_t qkv = (cfg.num_heads + 2 * cfg.num_query_groups) * D;
    linear(tokens, std::max(qkv, H), H);
  }
  int64_t dense_f = cfg.has_dense_layer() ? cfg.ffn_hidden : 0;
  if (cfg.num_experts > 0) dense_f = std::max(dense_f, cfg.moe.shared_ffn_hidden);
  linear(tokens, 2 * dense_f, H);
  linear(std::min(head_chunk, tokens), cfg.vocab_size, H);  // the model's rows (no padding)
  if (cfg.num_experts > 0) {
    const int64_t rows = std::max<int64_t>(1, tokens * cfg.moe.router.topk / cfg.num_experts);
    linear(rows, 2 * cfg.moe.ffn_hidden, H);
  }
  return shapes;
}

MfuReport mfu_report(double flops, double seconds, double peak_gflops) {
  MfuReport r;
  r.achieved_gflops = seconds > 0 ? flops / seconds * 1e-9 : 0.0;
  r.peak_raised = r.achieved_gflops > peak_gflops;
  r.peak_gflops = std::max(peak_gflops, r.achieved_gflops);
  r.mfu = r.peak_gflops > 0 ? r.achieved_gflops / r.peak_gflops : 0.0;
  return r;
}

double state_bytes_formula(const int64_t numel[2], const int degree[2], const double replicated[2],
                           double grad_bytes, double sharded_bytes) {
  const double n = static_cast<double>(numel[0] + numel[1]);
  if (n == 0) return 0;
  double b = 0;
  for (int k = 0; k < 2; ++k) {
    b += static_cast<double>(numel[k]) * (replicated[k] + grad_bytes + sharded_bytes / degree[k]);
  }
  return b / n;
}

std::string state_bytes_formula_text(const int degree[2], const std::string& replicated,
                                     double grad_bytes, double sharded_bytes) {
  const std::string d = degree[0] == degree[1]
                            ? fmt::format("d = {}", degree[0])
                            : fmt::format("d = {} dense, {} expert", degree[0], degree[1]);
  return fmt::format("{} + {:g} + {:g}/d ({})", replicated, grad_bytes, sharded_bytes, d);
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

MetricsFile::MetricsFile(const std::string& path, int mtp_depths) : mtp_depths_(mtp_depths) {
  if (path.empty()) return;
  std::error_code ec;
  MOE_CHECK(!std::filesystem::is_directory(path, ec),
            "[metrics] --metrics-file '{}' is a directory: give a file name (JSON lines)", path);
  out_.open(path, std::ios::trunc);
  MOE_CHECK(out_.good(), "[metrics] cannot write --metrics-file '{}': {}", path,
            std::strerror(errno));
}

static nlohmann::json form_bytes(const StepMetrics::FormBytes& b) {
  return {{"all_gather", b.all_gather},
          {"reduce_scatter", b.reduce_scatter},
          {"all_reduce", b.all_reduce}};
}

void MetricsFile::write(const StepMetrics& m) {
  if (!out_.is_open()) return;
  nlohmann::json j = {{"iteration", m.iteration},
                      {"lm_loss", m.lm_loss},
                      {"aux_loss", m.aux_loss},
                      {"z_loss", m.z_loss},
                      {"lr", m.lr},
                      {"grad_norm", m.grad_norm},
                      {"iteration_time_s", m.seconds},
                      {"tokens_per_s", m.tokens_per_s},
                      {"tflops", m.tflops},
                      {"mfu", m.mfu},
                      {"max_over_mean_load", m.max_over_mean_load},
                      {"dropped_tokens", m.dropped_tokens},
                      {"peak_mem_bytes", m.peak_mem_bytes},
                      {"alltoall_bytes", m.alltoall_bytes},
                      {"tp_bytes", form_bytes(m.tp_bytes)},
                      {"expt_tp_bytes", form_bytes(m.expt_tp_bytes)},
                      {"tp_calls", m.tp_calls},
                      {"expt_tp_calls", m.expt_tp_calls},
                      {"pp_bytes", m.pp_bytes},
                      {"mem_planned_bytes", m.mem_planned_bytes},
                      {"mem_shared_saved_bytes", m.mem_shared_saved_bytes},
                      {"mem_recompute_saved_bytes", m.mem_recompute_saved_bytes},
                      {"optim_shard_degree_dense", m.optim_shard_degree[0]},
                      {"optim_shard_degree_expert", m.optim_shard_degree[1]},
                      {"state_bytes_per_param", m.state_bytes_per_param},
                      {"state_bytes_per_param_formula", m.state_bytes_per_param_formula}};
  for (int k = 0; k < static_cast<int>(MemKind::Count); ++k) {
    j[fmt::format("mem_{}_bytes", mem_kind_name(static_cast<MemKind>(k)))] = m.mem_bytes[k];
  }
  for (int k = 0; k < mtp_depths_; ++k) j[fmt::format("mtp_{}_loss", k + 1)] = m.mtp_loss[k];
  for (int p = 0; p < kNumPhases; ++p) {
    j[fmt::format("time_{}_s", phase_name(static_cast<Phase>(p)))] = m.phase_seconds[p];
  }
  out_ << j.dump() << "\n";  // doubles are written with round-trip precision
  out_.flush();
}

void MetricsFile::write(const EvalMetrics& m) {
  if (!out_.is_open()) return;
  nlohmann::json j = {{"iteration", m.iteration},
                      {m.split + "_lm_loss", m.lm_loss},
                      {m.split + "_lm_loss_ppl", m.ppl},
                      {m.split + "_samples", m.samples}};
  out_ << j.dump() << "\n";
  out_.flush();
}

}  // namespace moecore::train
