// RoPE frequencies and YaRN scaling as Megatron-Core computes them (yarn_rotary_pos_embedding.py,
// multi_latent_attention.py): host math done once before step 0, whose results fill the rotary
// tables of ops/rope_mla.h and the attention's softmax scale. In f64 throughout (Megatron builds
// the frequencies in f32).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace moecore::ops {

// --rope-type: plain rotary, or YaRN (Megatron's rope_type "rope" / "yarn").
enum class RopeType : uint8_t { Rope, Yarn };

// YaRN's parameters under Megatron's names (TransformerConfig / MLATransformerConfig) with
// YarnRotaryEmbedding's defaults.
struct YarnParams {
  double scaling_factor = 1.0;                      // rotary_scaling_factor
  int64_t original_max_position_embeddings = 4096;  // the context the model was trained on
  double beta_fast = 32.0, beta_slow = 1.0;         // rotations bounding the ramp
  double mscale = 1.0, mscale_all_dim = 0.0;
};

struct RopeScaling {
  RopeType type = RopeType::Rope;
  YarnParams yarn;  // read only for RopeType::Yarn
};

// The dimension index whose wavelength fits num_rotations times into max_pos
// (Megatron's _yarn_find_correction_dim): D ln(max_pos / (2 pi num_rotations)) / (2 ln base).
double yarn_correction_dim(double num_rotations, int64_t D, double base, int64_t max_pos);
// [low, high]: floor of beta_fast's dimension, ceil of beta_slow's, clamped to [0, D - 1]
// (Megatron's _yarn_find_correction_range with round_to_int).
std::pair<int64_t, int64_t> yarn_correction_range(const YarnParams& p, int64_t D, double base);
// clamp((i - low) / (high - low), 0, 1) for i < n, high nudged by 0.001 when equal to low
// (Megatron's _yarn_linear_ramp_mask).
std::vector<double> yarn_linear_ramp(double low, double high, int64_t n);
// 0.1 mscale ln(scale) + 1, or 1 when scale <= 1 (Megatron's _yarn_get_mscale).
double yarn_get_mscale(double scale, double mscale);
// The factor on cos and sin: yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
// mscale_all_dim) (Megatron's _yarn_get_concentration_factor); 1 for plain RoPE.
double rope_attention_factor(const RopeScaling& s);
// Pair i's angular frequency, D/2 values. Plain: base^(-2i/D). YaRN: with r = the ramp over
// yarn_correction_range and mask = 1 - r, inter (1 - mask) + extra mask where extra =
// base^(-2i/D) and inter = extra / factor: pairs below `low` (many turns in the original
// context) keep their frequency, pairs above `high` are interpolated by the factor.
std::vector<double> rope_inv_freq(int64_t D, double base, const RopeScaling& s);
// MLA's softmax scale: m^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), m =
// yarn_get_mscale(rotary_scaling_factor, mscale_all_dim) (MultiLatentAttention.__init__; m = 1
// whenever the factor is <= 1, so plain RoPE gets 1 / sqrt(d)).
double mla_softmax_scale(int64_t qk_head_dim, int64_t qk_pos_emb_head_dim,
                         double rotary_scaling_factor, double mscale_all_dim);

}  // namespace moecore::ops
