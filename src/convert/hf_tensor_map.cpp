#include "convert/hf_tensor_map.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "ckpt/safetensors.h"
#include "core/check.h"
#include "core/shape.h"

namespace moecore::convert {
namespace {

// Each HF tensor's rows are used exactly once, and the blocks are the moecore tensor's rows: what makes export the inverse of import. Checked for every entry as the table
// is built, so a wrong row in the table cannot silently drop or duplicate weights.
void check_mapping(const TensorMapping& t) {
  const int64_t w = row_width(t.shape);
  std::vector<int64_t> used(t.hf.size(), 0);
  int64_t rows = 0;
  for (const RowBlock& b : t.blocks) {
    MOE_CHECK(b.hf >= 0 && b.hf < static_cast<int>(t.hf.size()) && b.rows >= 0 && b.hf_row >= 0,
              "[convert] table entry '{}': a bad row block", t.moecore);
    used[b.hf] += b.rows;
    rows += b.rows;
  }
  for (size_t i = 0; i < t.hf.size(); ++i) {
    MOE_CHECK(row_width(row_shape(t.hf[i])) == w && used[i] * w == numel(t.hf[i].shape),
              "[convert] table entry '{}': HF tensor '{}' {} is not covered exactly once by "
              "rows of {} elements",
              t.moecore, t.hf[i].name, ckpt::format_shape(t.hf[i].shape), w);
  }
  MOE_CHECK(rows * w == numel(t.shape),
            "[convert] table entry '{}': {} rows mapped != the tensor's {} rows", t.moecore, rows,
            numel(t.shape) / std::max<int64_t>(w, 1));
}

// The [cols, rows] transpose of a row-major [rows, cols] matrix.
std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> out(a.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = a[r * cols + c];
  }
  return out;
}

class TableBuilder {
 public:
  explicit TableBuilder(HfTensorMap& map) : map_(map) {}

  // moecore tensor = the HF tensor, as it is.
  void copy(const std::string& m, const std::string& hf, std::vector<int64_t> shape) {
    add({m, shape, {{hf, shape}}, {{0, 0, shape[0]}}});
  }
  // [gate; up] (an MLP's fc1, [2F, H]).
  void gate_up(const std::string& m, const std::string& gate, const std::string& up, int64_t F,
               int64_t H) {
    add({m, {2 * F, H}, {{gate, {F, H}}, {up, {F, H}}}, {{0, 0, F}, {1, 0, F}}});
  }
  // Fused QKV: for each query group g, its qpg query heads, its key head, its value head, D rows
  // each (src/ops/qkv_layout.h). `cols` empty: the bias.
  void fuse_qkv(const std::string& m, const std::string& a, const std::string& kind, int64_t Hq,
                int64_t Hkv, int64_t D, std::vector<int64_t> cols) {
    const int64_t qpg = Hq / Hkv;
    auto shape = [&](int64_t rows) {
      std::vector<int64_t> s = {rows};
      s.insert(s.end(), cols.begin(), cols.end());
      return s;
    };
    TensorMapping t{m,
                    shape((Hq + 2 * Hkv) * D),
                    {{a + "q_proj." + kind, shape(Hq * D)},
                     {a + "k_proj." + kind, shape(Hkv * D)},
                     {a + "v_proj." + kind, shape(Hkv * D)}},
                    {}};
    for (int64_t g = 0; g < Hkv; ++g) {
      t.blocks.push_back({0, g * qpg * D, qpg * D});
      t.blocks.push_back({1, g * D, D});
      t.blocks.push_back({2, g * D, D});
    }
    add(std::move(t));
  }
  // Experts stacked: fc1 [E, 2F, H] with fc1[e] = [gate_e; up_e], fc2 [E, H, F] with fc2[e] =
  // down_e.
  void experts(const std::string& q, const std::string& r, const char* gate, const char* up,
               const char* down, int64_t E, int64_t F, int64_t H) {
    TensorMapping fc1{q + "experts.linear_fc1.weight", {E, 2 * F, H}, {}, {}};
    TensorMapping fc2{q + "experts.linear_fc2.weight", {E, H, F}, {}, {}};
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}experts.{}.", r, e);
      fc1.hf.push_back({x + gate + ".weight", {F, H}});
      fc1.hf.push_back({x + up + ".weight", {F, H}});
      fc1.blocks.push_back({static_cast<int>(2 * e), 0, F});
      fc1.blocks.push_back({static_cast<int>(2 * e + 1), 0, F});
      fc2.hf.push_back({x + down + ".weight", {H, F}});
      fc2.blocks.push_back({static_cast<int>(e), 0, H});
    }
    add(std::move(fc1));
    add(std::move(fc2));
  }
  // moecore tensor [rows, cols] = GPT-2's Conv1D weight, stored [cols, rows].
  void copy_transposed(const std::string& m, const std::string& hf, int64_t rows, int64_t cols) {
    add({m, {rows, cols}, {{hf, {cols, rows}, true}}, {{0, 0, rows}}});
  }
  // GPT-2's c_attn: one tensor whose rows (after the Conv1D transpose, for the weight) are
  // [q | k | v], H each, fused per head (query groups of one head: qpg = 1) as moecore's QKV.
  // `cols` empty: the bias.
  void fuse_c_attn(const std::string& m, const std::string& hf, int64_t heads, int64_t D,
                   std::vector<int64_t> cols) {
    const int64_t H = heads * D;
    TensorMapping t{m, {3 * H}, {{hf, {3 * H}}}, {}};
    if (!cols.empty()) {
      t.shape = {3 * H, cols[0]};
      t.hf[0] = {hf, {cols[0], 3 * H}, true};
    }
    for (int64_t g = 0; g < heads; ++g) {
      for (int64_t part = 0; part < 3; ++part) t.blocks.push_back({0, part * H + g * D, D});
    }
    add(std::move(t));
  }
  // Multi-latent attention's projections with a rotary part: `heads` blocks of rows, each
  // [`keep` rows as they are | `pe` rotary rows]. moecore's rotary pairs are interleaved, (2i,
  // 2i + 1) (ops/rope_mla.h); an HF tensor that pairs them half-split, (i, i + pe/2)
  // (rope_interleave false), gives moecore row keep + 2i its row keep + i and row keep + 2i + 1
  // its row keep + pe/2 + i: the interleaved rotation then turns the pairs transformers turns, by
  // the same angles, and q.k is unchanged (q's and k's rotary rows are permuted alike).
  void rotary_rows(const std::string& m, const std::string& hf, std::vector<int64_t> shape,
                   int64_t heads, int64_t keep, int64_t pe, bool interleaved) {
    TensorMapping t{m, shape, {{hf, shape}}, {}};
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = h * (keep + pe);
      t.blocks.push_back({0, base, keep});
      if (interleaved) {
        t.blocks.push_back({0, base + keep, pe});
        continue;
      }
      for (int64_t i = 0; i < pe / 2; ++i) {
        t.blocks.push_back({0, base + keep + i, 1});
        t.blocks.push_back({0, base + keep + pe / 2 + i, 1});
      }
    }
    add(std::move(t));
  }
  // The vocabulary rows: the HF tensor's V rows, which are the model's (a checkpoint holds no
  // vocabulary padding: train::checkpoint_shape).
  void vocab(const std::string& m, const std::string& hf, int64_t V, int64_t H) {
    add({m, {V, H}, {{hf, {V, H}}}, {{0, 0, V}}});
  }

 private:
  void add(TensorMapping t) {
    check_mapping(t);
    map_.tensors.push_back(std::move(t));
  }
  HfTensorMap& map_;
};

}  // namespace

std::vector<int64_t> row_shape(const HfTensor& h) {
  if (!h.transposed) return h.shape;
  MOE_CHECK(h.shape.size() == 2, "[convert] '{}': only a matrix is stored transposed", h.name);
  return {h.shape[1], h.shape[0]};
}

int64_t row_width(const std::vector<int64_t>& shape) {
  return shape.size() >= 2 ? shape.back() : 1;
}

int64_t numel(const std::vector<int64_t>& shape) { return shape_numel(shape); }

namespace {

// GPT2LMHeadModel as save_pretrained writes it: transformer.{wte, wpe, h.i.*, ln_f}, Conv1D
// weights [in, out], LayerNorm weight and bias, every linear layer biased.
HfTensorMap gpt2_tensor_map(const HfModelSpec& s) {
  const int64_t V = s.vocab_size, H = s.hidden, D = s.head_dim, F = s.ffn_hidden;
  HfTensorMap map;
  TableBuilder t(map);
  map.embedding = "transformer.wte.weight";
  t.vocab("embedding.word_embeddings.weight", map.embedding, V, H);
  t.copy("embedding.position_embeddings.weight", "transformer.wpe.weight",
         {s.max_position_embeddings, H});
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = fmt::format("transformer.h.{}.", i);
    const std::string q = fmt::format("decoder.layers.{}.", i);
    for (const char* x : {"weight", "bias"})
      t.copy(q + "input_layernorm." + x, p + "ln_1." + x, {H});
    t.fuse_c_attn(q + "self_attention.linear_qkv.weight", p + "attn.c_attn.weight", s.num_heads, D,
                  {H});
    t.fuse_c_attn(q + "self_attention.linear_qkv.bias", p + "attn.c_attn.bias", s.num_heads, D, {});
    t.copy_transposed(q + "self_attention.linear_proj.weight", p + "attn.c_proj.weight", H, H);
    t.copy(q + "self_attention.linear_proj.bias", p + "attn.c_proj.bias", {H});
    for (const char* x : {"weight", "bias"})
      t.copy(q + "pre_mlp_layernorm." + x, p + "ln_2." + x, {H});
    t.copy_transposed(q + "mlp.linear_fc1.weight", p + "mlp.c_fc.weight", F, H);
    t.copy(q + "mlp.linear_fc1.bias", p + "mlp.c_fc.bias", {F});
    t.copy_transposed(q + "mlp.linear_fc2.weight", p + "mlp.c_proj.weight", H, F);
    t.copy(q + "mlp.linear_fc2.bias", p + "mlp.c_proj.bias", {H});
  }
  for (const char* x : {"weight", "bias"})
    t.copy(std::string("decoder.final_layernorm.") + x, std::string("transformer.ln_f.") + x, {H});
  if (s.tie_word_embeddings) {
    map.tied_head = HfTensor{"lm_head.weight", {V, H}};
  } else {
    t.vocab("output_layer.weight", "lm_head.weight", V, H);
  }
  return map;
}

// DeepseekV3ForCausalLM (docs/hf_interop.md, section 11; the names are
// deepseek_v3_tensor_target's): multi-latent attention, dense layers before
// first_k_dense_replace, routers with their expert bias (e_score_correction_bias), routed experts
// stacked, an ungated shared expert, and the MTP layers stored as model.layers.{L + j} with their
// own norms, eh_proj and a whole decoder layer, and copies of the embedding and the head.
HfTensorMap deepseek_v3_tensor_map(const DeepseekV3Spec& d) {
  const int64_t V = d.vocab_size, H = d.hidden, Hq = d.num_heads, kl = d.kv_lora_rank;
  const int64_t qk = d.qk_nope_head_dim, pe = d.qk_rope_head_dim, dv = d.v_head_dim;
  const int64_t E = d.num_experts, F = d.moe_ffn_hidden, S = d.num_shared_experts * F;
  const bool il = d.rope_interleave;
  HfTensorMap map;
  TableBuilder t(map);
  map.embedding = "model.embed_tokens.weight";
  const std::string head = d.tie_word_embeddings ? map.embedding : "lm_head.weight";
  t.vocab("embedding.word_embeddings.weight", map.embedding, V, H);
  // A decoder layer's tensors under HF prefix p and moecore prefix q.
  auto layer = [&](const std::string& p, const std::string& q, bool moe) {
    const std::string a = p + "self_attn.", b = q + "self_attention.";
    t.copy(q + "input_layernorm.weight", p + "input_layernorm.weight", {H});
    if (d.q_lora_rank) {
      const int64_t ql = *d.q_lora_rank;
      t.copy(b + "linear_q_down_proj.weight", a + "q_a_proj.weight", {ql, H});
      t.copy(b + "q_layernorm.weight", a + "q_a_layernorm.weight", {ql});
      t.rotary_rows(b + "linear_q_up_proj.weight", a + "q_b_proj.weight", {Hq * (qk + pe), ql}, Hq,
                    qk, pe, il);
    } else {
      t.rotary_rows(b + "linear_q_proj.weight", a + "q_proj.weight", {Hq * (qk + pe), H}, Hq, qk,
                    pe, il);
    }
    // [latent (kl) | the rotary key every head shares (pe)]: MlaAttention's row blocks too.
    t.rotary_rows(b + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight", {kl + pe, H},
                  1, kl, pe, il);
    t.copy(b + "kv_layernorm.weight", a + "kv_a_layernorm.weight", {kl});
    // Per head [k_nope (qk) | v (dv)], as linear_kv_up_proj's output is split.
    t.copy(b + "linear_kv_up_proj.weight", a + "kv_b_proj.weight", {Hq * (qk + dv), kl});
    t.copy(b + "linear_proj.weight", a + "o_proj.weight", {H, Hq * dv});
    t.copy(q + "pre_mlp_layernorm.weight", p + "post_attention_layernorm.weight", {H});
    const std::string r = p + "mlp.", x = q + "mlp.";
    if (!moe) {
      t.gate_up(x + "linear_fc1.weight", r + "gate_proj.weight", r + "up_proj.weight", d.ffn_hidden,
                H);
      t.copy(x + "linear_fc2.weight", r + "down_proj.weight", {H, d.ffn_hidden});
      return;
    }
    t.copy(x + "router.weight", r + "gate.weight", {E, H});
    // The router's expert bias: a checkpoint holds it beside the router's weight (the trainer's
    // "<router>.expert_bias", F32 [E]).
    t.copy(x + "router.expert_bias", r + "gate.e_score_correction_bias", {E});
    t.experts(x, r, "gate_proj", "up_proj", "down_proj", E, F, H);
    if (S > 0) {
      t.gate_up(x + "shared_experts.linear_fc1.weight", r + "shared_experts.gate_proj.weight",
                r + "shared_experts.up_proj.weight", S, H);
      t.copy(x + "shared_experts.linear_fc2.weight", r + "shared_experts.down_proj.weight", {H, S});
    }
  };
  for (int64_t i = 0; i < d.num_layers; ++i) {
    layer(fmt::format("model.layers.{}.", i), fmt::format("decoder.layers.{}.", i),
          i >= d.first_k_dense);
  }
  t.copy("decoder.final_layernorm.weight", "model.norm.weight", {H});
  if (d.tie_word_embeddings) {
    map.tied_head = HfTensor{"lm_head.weight", {V, H}};
  } else {
    t.vocab("output_layer.weight", "lm_head.weight", V, H);
  }
  // Megatron-Core's MultiTokenPredictionLayer j: enorm (of the next token's embedding), hnorm (of
  // the previous depth's hidden state), eh_proj over [embedding | hidden], a decoder layer and the
  // final norm of its shared head; the embedding and head are the main model's.
  for (int64_t j = 0; j < d.mtp_layers; ++j) {
    const int64_t i = d.num_layers + j;
    const std::string p = fmt::format("model.layers.{}.", i), m = fmt::format("mtp.layers.{}.", j);
    t.copy(m + "enorm.weight", p + "enorm.weight", {H});
    t.copy(m + "hnorm.weight", p + "hnorm.weight", {H});
    t.copy(m + "eh_proj.weight", p + "eh_proj.weight", {H, 2 * H});
    layer(p, m + "transformer_layer.", i >= d.first_k_dense);
    t.copy(m + "final_layernorm.weight", p + "shared_head.norm.weight", {H});
    map.copies.push_back({HfTensor{p + "embed_tokens.weight", {V, H}}, map.embedding});
    map.copies.push_back({HfTensor{p + "shared_head.head.weight", {V, H}}, head});
  }
  return map;
}

}  // namespace

HfTensorMap hf_tensor_map(const HfModelSpec& s) {
  const int64_t V = s.vocab_size, H = s.hidden, D = s.head_dim;
  const int64_t Hq = s.num_heads, Hkv = s.num_kv_heads;
  if (s.arch == HfArch::Gpt2) return gpt2_tensor_map(s);
  if (s.arch == HfArch::DeepseekV3) {
    MOE_CHECK(s.deepseek.has_value(), "[convert] a DeepSeek-V3 spec without its DeepSeek part");
    return deepseek_v3_tensor_map(*s.deepseek);
  }
  const bool mixtral = s.arch == HfArch::Mixtral;
  HfTensorMap map;
  TableBuilder t(map);
  map.embedding = "model.embed_tokens.weight";
  t.vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", V, H);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const std::string q = fmt::format("decoder.layers.{}.", i);
    const std::string a = p + "self_attn.", b = q + "self_attention.";
    t.copy(q + "input_layernorm.weight", p + "input_layernorm.weight", {H});
    t.fuse_qkv(b + "linear_qkv.weight", a, "weight", Hq, Hkv, D, {H});
    if (s.qkv_bias) t.fuse_qkv(b + "linear_qkv.bias", a, "bias", Hq, Hkv, D, {});
    if (s.qk_norm) {
      t.copy(b + "q_layernorm.weight", a + "q_norm.weight", {D});
      t.copy(b + "k_layernorm.weight", a + "k_norm.weight", {D});
    }
    t.copy(b + "linear_proj.weight", a + "o_proj.weight", {H, Hq * D});
    if (s.attention_output_bias) t.copy(b + "linear_proj.bias", a + "o_proj.bias", {H});
    t.copy(q + "pre_mlp_layernorm.weight", p + "post_attention_layernorm.weight", {H});
    if (s.moe_layers[i]) {
      // Transformers 5.x names the module `mlp` in memory but Mixtral's files keep
      // block_sparse_moe and w1 (gate) / w3 (up) / w2 (down).
      const std::string r = p + (mixtral ? "block_sparse_moe." : "mlp.");
      t.copy(q + "mlp.router.weight", r + "gate.weight", {s.num_experts, H});
      if (mixtral) {
        t.experts(q + "mlp.", r, "w1", "w3", "w2", s.num_experts, s.moe_ffn_hidden, H);
      } else {
        t.experts(q + "mlp.", r, "gate_proj", "up_proj", "down_proj", s.num_experts,
                  s.moe_ffn_hidden, H);
      }
      const int64_t S = s.shared_ffn_hidden;
      if (S > 0) {
        const std::string x = q + "mlp.shared_experts.";
        t.gate_up(x + "linear_fc1.weight", r + "shared_expert.gate_proj.weight",
                  r + "shared_expert.up_proj.weight", S, H);
        t.copy(x + "linear_fc2.weight", r + "shared_expert.down_proj.weight", {H, S});
        t.copy(x + "gate_weight", r + "shared_expert_gate.weight", {1, H});
      } else if (s.arch == HfArch::Qwen2Moe) {
        map.empty_shared_expert.push_back({r + "shared_expert.gate_proj.weight", {0, H}});
        map.empty_shared_expert.push_back({r + "shared_expert.up_proj.weight", {0, H}});
        map.empty_shared_expert.push_back({r + "shared_expert.down_proj.weight", {H, 0}});
        map.empty_shared_expert.push_back({r + "shared_expert_gate.weight", {1, H}});
      }
    } else {
      t.gate_up(q + "mlp.linear_fc1.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                s.ffn_hidden, H);
      t.copy(q + "mlp.linear_fc2.weight", p + "mlp.down_proj.weight", {H, s.ffn_hidden});
    }
  }
  t.copy("decoder.final_layernorm.weight", "model.norm.weight", {H});
  if (s.tie_word_embeddings) {
    map.tied_head = HfTensor{"lm_head.weight", {V, H}};
  } else {
    t.vocab("output_layer.weight", "lm_head.weight", V, H);
  }
  return map;
}

std::string name_list(const std::vector<std::string>& names, size_t max) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i)
    out += fmt::format("{}'{}'", i ? ", " : "", names[i]);
  if (names.size() > max) out += fmt::format(" and {} more", names.size() - max);
  return out;
}

std::vector<float> to_moecore(const TensorMapping& t, const std::vector<std::vector<float>>& hf) {
  MOE_CHECK(hf.size() == t.hf.size(), "[convert] '{}' is made of {} HF tensors, {} given",
            t.moecore, t.hf.size(), hf.size());
  for (size_t i = 0; i < hf.size(); ++i) {
    MOE_CHECK(static_cast<int64_t>(hf[i].size()) == numel(t.hf[i].shape),
              "[convert] '{}': {} values given for '{}', its shape needs {}", t.moecore,
              hf[i].size(), t.hf[i].name, numel(t.hf[i].shape));
  }
  const int64_t w = row_width(t.shape);
  // A Conv1D weight's rows are its stored columns: transposed first.
  std::vector<std::vector<float>> rows(hf.size());
  for (size_t i = 0; i < hf.size(); ++i) {
    if (t.hf[i].transposed) rows[i] = transpose(hf[i], t.hf[i].shape[0], t.hf[i].shape[1]);
  }
  auto src = [&](int i) { return t.hf[i].transposed ? rows[i].data() : hf[i].data(); };
  std::vector<float> out(static_cast<size_t>(numel(t.shape)), 0.0f);
  int64_t row = 0;
  for (const RowBlock& b : t.blocks) {
    std::copy_n(src(b.hf) + b.hf_row * w, b.rows * w, out.data() + row * w);
    row += b.rows;
  }
  return out;
}

std::vector<std::vector<float>> to_hf(const TensorMapping& t, std::span<const float> m) {
  MOE_CHECK(static_cast<int64_t>(m.size()) == numel(t.shape),
            "[convert] '{}': {} values given, its shape needs {}", t.moecore, m.size(),
            numel(t.shape));
  const int64_t w = row_width(t.shape);
  std::vector<std::vector<float>> out;
  for (const HfTensor& h : t.hf) out.emplace_back(static_cast<size_t>(numel(h.shape)));
  int64_t row = 0;
  for (const RowBlock& b : t.blocks) {
    std::copy_n(m.data() + row * w, b.rows * w, out[b.hf].data() + b.hf_row * w);
    row += b.rows;
  }
  // Back to a Conv1D weight's stored [in, out].
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.hf[i].transposed) {
      const std::vector<int64_t> r = row_shape(t.hf[i]);
      out[i] = transpose(out[i], r[0], r[1]);
    }
  }
  return out;
}

}  // namespace moecore::convert
