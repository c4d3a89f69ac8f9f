// DeepSeek-V3 on the HuggingFace side (docs/hf_interop.md, "DeepSeek-V3"): the fixtures'
// config.json read into the spec and the Megatron flags, refusals by key, every tensor of the
// fixtures (the MTP layer and the FP8 scales included) covered by the tensor map with no two
// HF tensors on one target, and `moecore convert hf-to-moecore` stopping with a message that
// names what is not implemented yet, writing nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/safetensors_file.h"
#include "common/command.h"
#include "common/paths.h"
#include "common/testing.h"
#include "convert/hf_config_reader.h"
#include "convert/hf_deepseek_v3.h"
#include "convert/hf_import.h"
#include "cli/train_flags.h"

namespace moecore::convert {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

fs::path fixture(const std::string& name) {
  return fs::path(testing::source_dir()) / "tests/fixtures/hf" / name;
}

DeepseekV3Spec spec_of(const std::string& name) {
  const fs::path p = fixture(name) / "config.json";
  return parse_deepseek_v3_config(read_hf_config_file(p), p.string());
}

TEST(HfDeepseekV3, ReadsTheFixturesConfig) {
  const DeepseekV3Spec s = spec_of("deepseek_v3");
  EXPECT_EQ(s.vocab_size, 64);
  EXPECT_EQ(s.hidden, 32);
  EXPECT_EQ(s.num_layers, 3);
  EXPECT_EQ(s.num_heads, 4);
  EXPECT_EQ(s.ffn_hidden, 32);
  EXPECT_EQ(s.moe_ffn_hidden, 8);
  EXPECT_EQ(s.num_experts, 8);
  EXPECT_EQ(s.topk, 2);
  EXPECT_EQ(s.num_shared_experts, 1);
  EXPECT_EQ(s.num_groups, 4);
  EXPECT_EQ(s.group_topk, 2);
  EXPECT_EQ(s.first_k_dense, 1);
  EXPECT_TRUE(s.norm_topk_prob);
  EXPECT_EQ(s.routed_scaling_factor, 2.5);
  EXPECT_EQ(s.q_lora_rank, 16);
  EXPECT_EQ(s.kv_lora_rank, 16);
  EXPECT_EQ(s.qk_nope_head_dim, 8);
  EXPECT_EQ(s.qk_rope_head_dim, 4);
  EXPECT_EQ(s.v_head_dim, 8);
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_EQ(s.rope_factor, 4.0);
  EXPECT_EQ(s.mscale, 1.0);
  EXPECT_EQ(s.mscale_all_dim, 1.0);
  EXPECT_EQ(s.beta_fast, 32.0);
  EXPECT_EQ(s.beta_slow, 1.0);
  EXPECT_EQ(s.original_max_position_embeddings, 16);
  EXPECT_TRUE(s.rope_interleave);
  EXPECT_EQ(s.max_position_embeddings, 64);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_EQ(s.mtp_layers, 1);
  EXPECT_FALSE(s.fp8_block);

  EXPECT_FALSE(spec_of("deepseek_v3_no_q_lora").q_lora_rank);
  const DeepseekV3Spec f = spec_of("deepseek_v3_fp8");
  ASSERT_TRUE(f.fp8_block);
  EXPECT_EQ(f.fp8_block->rows, 16);
  EXPECT_EQ(f.fp8_block->cols, 16);
}

TEST(HfDeepseekV3, FlagsOfTheFixture) {
  const std::vector<std::string> f = deepseek_v3_flags(spec_of("deepseek_v3"));
  std::string line;
  for (const std::string& x : f) line += x + " ";
  for (const char* want : {"--num-layers 3 ",
                           "--hidden-size 32 ",
                           "--ffn-hidden-size 32 ",
                           "--num-attention-heads 4 ",
                           "--multi-latent-attention ",
                           "--q-lora-rank 16 ",
                           "--kv-lora-rank 16 ",
                           "--qk-head-dim 8 ",
                           "--qk-pos-emb-head-dim 4 ",
                           "--v-head-dim 8 ",
                           "--rope-type yarn ",
                           "--rotary-scaling-factor 4 ",
                           "--mscale 1 ",
                           "--mscale-all-dim 1 ",
                           "--yarn-original-max-position-embeddings 16 ",
                           "--qk-layernorm ",
                           "--rotary-base 10000 ",
                           "--num-experts 8 ",
                           "--moe-ffn-hidden-size 8 ",
                           "--moe-router-topk 2 ",
                           "--moe-router-score-function sigmoid ",
                           "--moe-router-enable-expert-bias ",
                           "--moe-router-num-groups 4 ",
                           "--moe-router-group-topk 2 ",
                           "--moe-router-topk-scaling-factor 2.5 ",
                           "--moe-shared-expert-intermediate-size 8 ",
                           "--moe-layer-freq [0,1,1] ",
                           "--mtp-num-layers 1 ",
                           "--untie-embeddings-and-output-weights "}) {
    EXPECT_NE(line.find(want), std::string::npos) << want << " not in: " << line;
  }
  std::string no_q;
  for (const std::string& x : deepseek_v3_flags(spec_of("deepseek_v3_no_q_lora"))) no_q += x + " ";
  EXPECT_EQ(no_q.find("--q-lora-rank"), std::string::npos) << no_q;
  // Every flag is one `moecore train` knows: parsed as the trainer parses them, the only refusal
  // is multi-token prediction, which the trainer does not build yet (multi-latent attention it
  // does).
  for (const char* fixture_name : {"deepseek_v3", "deepseek_v3_no_q_lora"}) {
    std::vector<std::string> args;
    for (const std::string& x : deepseek_v3_flags(spec_of(fixture_name))) {
      std::istringstream words(x);
      for (std::string w; words >> w;) args.push_back(w);
    }
    try {
      cli::parse_train_args(args);
      ADD_FAILURE() << fixture_name << ": --mtp-num-layers accepted before MTP is trained";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--mtp-num-layers"), std::string::npos)
          << fixture_name << ": " << e.what();
      EXPECT_EQ(std::string(e.what()).find("--multi-latent-attention"), std::string::npos)
          << fixture_name << ": " << e.what();
    }
    // Without the MTP layer the flags parse (given the run's required flags).
    std::vector<std::string> no_mtp = {"--seq-length", "16", "--micro-batch-size", "1",
                                       "--train-iters", "1", "--lr", "1e-3"};
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--mtp-num-layers") {
        ++i;
        continue;
      }
      no_mtp.push_back(args[i]);
    }
    EXPECT_NO_THROW(cli::parse_train_args(no_mtp)) << fixture_name;
  }
}

TEST(HfDeepseekV3, RefusesWhatTheFlagsCannotSayByKey) {
  const fs::path p = fixture("deepseek_v3") / "config.json";
  const nlohmann::json base = read_hf_config_file(p);
  auto refusal = [&](const char* key, const nlohmann::json& v) {
    nlohmann::json c = base;
    c[key] = v;
    return error_of([&] { parse_deepseek_v3_config(c, "cfg.json"); });
  };
  nlohmann::json rope = base["rope_parameters"];
  rope["rope_type"] = "longrope";
  EXPECT_NE(refusal("rope_parameters", rope).find("\"rope_parameters\""), std::string::npos);
  EXPECT_NE(refusal("n_group", 3).find("\"n_group\": 3 is not supported"), std::string::npos)
      << refusal("n_group", 3);
  EXPECT_NE(refusal("num_key_value_heads", 2).find("\"num_key_value_heads\": 2"),
            std::string::npos);
  EXPECT_NE(refusal("quantization_config", {{"quant_method", "fp8"}, {"fmt", "e4m3"}})
                .find("\"quantization_config\""),
            std::string::npos);
  EXPECT_NE(refusal("num_nextn_predict_layers", -1).find("\"num_nextn_predict_layers\": -1"),
            std::string::npos);
  EXPECT_NE(refusal("kv_lora_rank", 0).find("\"kv_lora_rank\": 0 is not supported: a size"),
            std::string::npos);
  nlohmann::json other = base;
  other["model_type"] = "mixtral";
  other["architectures"] = {"MixtralForCausalLM"};
  EXPECT_NE(error_of([&] {
              parse_deepseek_v3_config(other, "cfg.json");
            }).find("[convert] 'cfg.json' is not a DeepSeek-V3 config.json"),
            std::string::npos);
}

// Every tensor of every fixture has a target; no two have the same one (the same moecore
// tensor, part, expert and half); and every non-MTP, non-scale moecore tensor a layer needs is
// hit (counted per layer).
TEST(HfDeepseekV3, TensorMapCoversEveryTensorOfTheFixtures) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(name);
    const DeepseekV3Spec s = spec_of(name);
    const ckpt::SafetensorsFile f(fixture(name) / "model.safetensors");
    std::set<std::string> targets;
    int scales = 0, copies = 0;
    for (const std::string& n : f.names()) {
      const auto t = deepseek_v3_tensor_target(n, s);
      ASSERT_TRUE(t) << n << " has no moecore target";
      if (t->part == "scale") {
        ++scales;
        EXPECT_EQ(f.info(n).dtype, "F32") << n;
        EXPECT_EQ(f.info(n.substr(0, n.size() - 10)).dtype, "F8_E4M3") << n;
      }
      if (t->part == "copy") ++copies;
      const std::string key =
          t->moecore + "|" + t->part + "|" + std::to_string(t->expert) + "|" + t->part2;
      EXPECT_TRUE(targets.insert(key).second) << n << " -> " << key << " twice";
    }
    EXPECT_EQ(copies, 2);  // the MTP layer's embed_tokens and shared_head.head
    EXPECT_EQ(scales > 0, name == "deepseek_v3_fp8");
    EXPECT_TRUE(targets.count("mtp.layers.0.eh_proj.weight||-1|"));
    EXPECT_TRUE(
        targets.count("mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight|expert|7|up"));
    EXPECT_TRUE(targets.count("decoder.layers.2.mlp.router.expert_bias||-1|"));
    EXPECT_TRUE(targets.count("decoder.layers.0.mlp.linear_fc1.weight|gate|-1|"));
  }
  // Names of no such checkpoint: none.
  const DeepseekV3Spec s = spec_of("deepseek_v3");
  for (const char* n :
       {"model.layers.4.enorm.weight", "model.layers.1.mlp.experts.8.up_proj.weight",
        "model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.input_layernorm.weight_scale_inv", "lm_head.bias",
        "model.layers.x.input_layernorm.weight"}) {
    EXPECT_FALSE(deepseek_v3_tensor_target(n, s)) << n;
  }
}

TEST(HfDeepseekV3, ImportStopsNamingWhatIsNotImplemented) {
  const fs::path out = fs::temp_directory_path() / "moecore_dsv3_import_out";
  fs::remove_all(out);
  const std::string e = error_of([&] { import_hf(fixture("deepseek_v3"), out); });
  EXPECT_NE(e.find("DeepseekV3ForCausalLM is read but cannot be imported yet: moecore does not "
                   "implement multi-latent attention (--multi-latent-attention), YaRN RoPE"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("multi-token prediction (--mtp-num-layers)"), std::string::npos) << e;
  EXPECT_NE(e.find("--kv-lora-rank 16"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
  const testing::CommandResult r =
      testing::run_moecore("convert hf-to-moecore --input " + fixture("deepseek_v3_fp8").string() +
                           " --output " + out.string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("DeepseekV3ForCausalLM is read but cannot be imported yet"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace moecore::convert
