// YaRN frequencies and scales (ops/rope_yarn.h): Megatron's formulas in f64, checked arguments.
#include "ops/rope_yarn.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/check.h"

namespace moecore::ops {

namespace {
void check_rotary(int64_t D, double base) {
  MOE_CHECK(D > 0 && D % 2 == 0,
            "[rope_yarn] rotary dim D={} must be even and > 0: RoPE rotates pairs", D);
  MOE_CHECK(base > 0 && base != 1.0,
            "[rope_yarn] base={} must be > 0 and != 1 (usually 10000): check --rotary-base", base);
}
void check_yarn(const YarnParams& p) {
  MOE_CHECK(p.scaling_factor > 0,
            "[rope_yarn] rotary_scaling_factor={} must be > 0: check --rotary-scaling-factor",
            p.scaling_factor);
  MOE_CHECK(p.original_max_position_embeddings > 0,
            "[rope_yarn] original_max_position_embeddings={} must be > 0",
            p.original_max_position_embeddings);
  MOE_CHECK(p.beta_fast > 0 && p.beta_slow > 0,
            "[rope_yarn] beta_fast={} and beta_slow={} must be > 0 (Megatron: 32 and 1)",
            p.beta_fast, p.beta_slow);
}
}  // namespace

double yarn_correction_dim(double num_rotations, int64_t D, double base, int64_t max_pos) {
  check_rotary(D, base);
  return static_cast<double>(D) *
         std::log(static_cast<double>(max_pos) / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

std::pair<int64_t, int64_t> yarn_correction_range(const YarnParams& p, int64_t D, double base) {
  check_yarn(p);
  const double low =
      std::floor(yarn_correction_dim(p.beta_fast, D, base, p.original_max_position_embeddings));
  const double high =
      std::ceil(yarn_correction_dim(p.beta_slow, D, base, p.original_max_position_embeddings));
  return {std::max<int64_t>(static_cast<int64_t>(low), 0),
          std::min<int64_t>(static_cast<int64_t>(high), D - 1)};
}

std::vector<double> yarn_linear_ramp(double low, double high, int64_t n) {
  if (low == high) high += 0.001;  // Megatron's guard against a zero-width ramp
  std::vector<double> r(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i)
    r[size_t(i)] = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
  return r;
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double rope_attention_factor(const RopeScaling& s) {
  if (s.type == RopeType::Rope) return 1.0;
  check_yarn(s.yarn);
  return yarn_get_mscale(s.yarn.scaling_factor, s.yarn.mscale) /
         yarn_get_mscale(s.yarn.scaling_factor, s.yarn.mscale_all_dim);
}

std::vector<double> rope_inv_freq(int64_t D, double base, const RopeScaling& s) {
  check_rotary(D, base);
  const int64_t half = D / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    f[size_t(i)] = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  if (s.type == RopeType::Rope) return f;
  const auto [low, high] = yarn_correction_range(s.yarn, D, base);
  const std::vector<double> ramp =
      yarn_linear_ramp(static_cast<double>(low), static_cast<double>(high), half);
  for (int64_t i = 0; i < half; ++i) {
    const double extra = f[size_t(i)], inter = extra / s.yarn.scaling_factor;
    const double mask = 1.0 - ramp[size_t(i)];
    f[size_t(i)] = inter * (1.0 - mask) + extra * mask;
  }
  return f;
}

double mla_softmax_scale(int64_t qk_head_dim, int64_t qk_pos_emb_head_dim,
                         double rotary_scaling_factor, double mscale_all_dim) {
  MOE_CHECK(qk_head_dim >= 0 && qk_pos_emb_head_dim >= 0 && qk_head_dim + qk_pos_emb_head_dim > 0,
            "[mla] qk_head_dim={} + qk_pos_emb_head_dim={} must be > 0", qk_head_dim,
            qk_pos_emb_head_dim);
  const double m = yarn_get_mscale(rotary_scaling_factor, mscale_all_dim);
  // Squared: the factor stands for m on q and m on k (Megatron, and HF's DeepseekV3 scaling).
  return m * m / std::sqrt(static_cast<double>(qk_head_dim + qk_pos_emb_head_dim));
}

}  // namespace moecore::ops
