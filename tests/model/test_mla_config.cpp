// Multi-latent attention's configuration: Megatron's defaults, the checks with their messages,
// the softmax scale and the rotary spec it hands to the layer.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/testing.h"
#include "model/config.h"

namespace moecore {
namespace {

ModelConfig mla_config() {
  ModelConfig cfg;
  cfg.multi_latent_attention = true;
  return cfg;
}

TEST(MlaConfig, MegatronDefaults) {
  const MlaConfig m;
  EXPECT_EQ(m.q_lora_rank, 0);  // None: a direct q projection
  EXPECT_EQ(m.kv_lora_rank, 32);
  EXPECT_EQ(m.qk_head_dim, 128);
  EXPECT_EQ(m.qk_pos_emb_head_dim, 64);
  EXPECT_EQ(m.v_head_dim, 128);
  EXPECT_EQ(m.rope_type, ops::RopeType::Yarn);
  EXPECT_EQ(m.yarn.scaling_factor, 1.0);
  EXPECT_EQ(m.yarn.original_max_position_embeddings, 4096);
  EXPECT_EQ(m.yarn.beta_fast, 32.0);
  EXPECT_EQ(m.yarn.beta_slow, 1.0);
  EXPECT_EQ(m.yarn.mscale, 1.0);
  EXPECT_EQ(m.yarn.mscale_all_dim, 0.0);
  EXPECT_NO_THROW(mla_config().validate());
}

// Each check names its flag.
TEST(MlaConfig, ChecksNameTheFlag) {
  struct Bad {
    void (*set)(MlaConfig&);
    const char* flag;
  };
  const Bad bad[] = {
      {[](MlaConfig& m) { m.q_lora_rank = -1; }, "--q-lora-rank"},
      {[](MlaConfig& m) { m.kv_lora_rank = 0; }, "--kv-lora-rank"},
      {[](MlaConfig& m) { m.qk_head_dim = 0; }, "--qk-head-dim"},
      {[](MlaConfig& m) { m.v_head_dim = 0; }, "--v-head-dim"},
      {[](MlaConfig& m) { m.qk_pos_emb_head_dim = 7; }, "--qk-pos-emb-head-dim"},
      {[](MlaConfig& m) { m.qk_pos_emb_head_dim = 0; }, "--qk-pos-emb-head-dim"},
      {[](MlaConfig& m) { m.yarn.scaling_factor = 0; }, "--rotary-scaling-factor"},
      {[](MlaConfig& m) { m.yarn.original_max_position_embeddings = 0; },
       "--yarn-original-max-position-embeddings"},
      {[](MlaConfig& m) { m.yarn.beta_slow = 0; }, "--yarn-beta-slow"},
  };
  for (const Bad& b : bad) {
    ModelConfig cfg = mla_config();
    b.set(cfg.mla);
    const std::string msg = testing::error_of([&] { cfg.validate(); });
    EXPECT_NE(msg.find(b.flag), std::string::npos) << b.flag << ": " << msg;
    cfg.multi_latent_attention = false;  // the MLA sizes are not read without MLA
    EXPECT_NO_THROW(cfg.validate()) << b.flag;
  }
}

// DeepSeek-V3: factor 40, mscale_all_dim 1: (1 + 0.1 ln 40)^2 / sqrt(192), and the rotary spec
// is interleaved YaRN over the 64 rotated dims.
TEST(MlaConfig, SoftmaxScaleAndRopeSpec) {
  MlaConfig m;
  m.yarn = ops::YarnParams{40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  EXPECT_DOUBLE_EQ(m.softmax_scale(), 0.1352337788608801);
  const ops::RopeMlaSpec spec = m.rope_spec(10000.0);
  EXPECT_EQ(spec.D, 64);
  EXPECT_EQ(spec.base, 10000.0);
  EXPECT_EQ(spec.pairing, ops::RopePairing::Interleaved);
  EXPECT_EQ(spec.scaling.type, ops::RopeType::Yarn);
  EXPECT_EQ(spec.scaling.yarn.scaling_factor, 40.0);
  m.yarn.scaling_factor = 1.0;
  EXPECT_DOUBLE_EQ(m.softmax_scale(), 1.0 / std::sqrt(192.0));
}

}  // namespace
}  // namespace moecore
