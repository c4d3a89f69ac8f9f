// DeepSeek-V3 (DeepseekV3ForCausalLM) through `moecore convert` (docs/hf_interop.md, section
// 11): the fixtures' config.json read into the spec and into flags that give moecore's model
// transformers' math (YaRN's factors, the router), refusals by key; the tensor table against
// the name contract; import (MLA, the expert bias, FP8 dequantized exactly, the MTP layer
// absent or not buildable yet), rope_interleave false, the round trip back to HF byte for byte;
// and the numbers: the imported model in float64 and the trainer in float32 against
// reference.json (transformers' float64 logits), and a float64 transcription of transformers'
// forward, pinned to reference.json, which the imported model computes to float64 rounding
// (docs/numerics.md).
//
// The fixtures route with num_experts_per_tok = 2 x topk_group (deepseek_v3 and its FP8 copy:
// top-2 of 8 experts in 2 groups of 4 keeping 1; deepseek_v3_no_q_lora: top-4 in 4 groups of 2
// keeping 2), where Megatron's group score (moecore's: a group's top num_experts_per_tok /
// topk_group biased scores) is transformers' (its top 2), so the fixtures import as they are.
// Other group-limited configs are refused by key (RefusesWhatMoecoreWouldComputeDifferentlyByKey).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <numbers>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors_file.h"
#include "ckpt/safetensors_writer.h"
#include "cli/config_file.h"
#include "common/command.h"
#include "common/paths.h"
#include "common/testing.h"
#include "common/tolerances.h"
#include "convert/hf_config.h"
#include "convert/hf_config_reader.h"
#include "convert/hf_deepseek_v3.h"
#include "convert/hf_export.h"
#include "convert/hf_import.h"
#include "convert/hf_tensor_map.h"
#include "convert/hf_weights.h"
#include "convert/model_flags.h"
#include "model/gpt_model.h"
#include "ops/rope_yarn.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"

namespace moecore::convert {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::error_of;

fs::path fixture(const std::string& name) {
  return fs::path(testing::source_dir()) / "tests/fixtures/hf" / name;
}

// <tmp>/moecore_dsv3.<pid>.<name>, removed first: this process's own.
fs::path fresh_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("moecore_dsv3." + std::to_string(::getpid()) + "." + name);
  fs::remove_all(d);
  return d;
}

// The scratch directories of this process, removed when its tests end.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    const std::string mine = "moecore_dsv3." + std::to_string(::getpid()) + ".";
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::temp_directory_path(), ec)) {
      if (e.path().filename().string().starts_with(mine)) fs::remove_all(e.path(), ec);
    }
  }
};
[[maybe_unused]] ::testing::Environment* const kScratchCleanup =
    ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(std::string{std::istreambuf_iterator<char>(in), {}});
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The fixture's config.json, with `patch`'s keys set.
json config_of(const std::string& name, const json& patch = json::object()) {
  json c = read_json(fixture(name) / "config.json");
  for (const auto& [k, v] : patch.items()) c[k] = v;
  return c;
}

// The fixture's config.json without the MTP layer.
json main_model_config(const std::string& name) {
  json c = config_of(name);
  c["num_nextn_predict_layers"] = 0;
  return c;
}

DeepseekV3Spec spec_of(const std::string& name) {
  return parse_deepseek_v3_config(config_of(name), name + "/config.json");
}

// Every tensor of a directory's model.safetensors: name -> (dtype, shape, bytes).
struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};
std::map<std::string, Tensor> tensors_of(const fs::path& file) {
  std::map<std::string, Tensor> out;
  const ckpt::SafetensorsFile f(file);
  for (const std::string& n : f.names()) {
    const auto b = f.bytes(n);
    out[n] = {f.info(n).dtype, f.info(n).shape, {b.begin(), b.end()}};
  }
  return out;
}

// `tensors` as a model.safetensors in `dir` (moecore's writer, HF's metadata, in name order: the
// fixtures' order, all of one dtype) and `config` as its config.json.
void write_hf_dir(const fs::path& dir, const std::map<std::string, Tensor>& tensors,
                  const json& config) {
  fs::create_directories(dir);
  ckpt::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (const auto& [n, t] : tensors) w.add(n, t.dtype, t.shape, t.bytes);
  w.write(dir / "model.safetensors");
  std::ofstream(dir / "config.json") << config.dump(2) << "\n";
}

// Fixture `name` without its MTP layer (model.layers.{L}.*, with the FP8 scales), as `as`,
// num_nextn_predict_layers set to `nextn` (0: a checkpoint of the main model; 1, the fixture's:
// what transformers' save_pretrained leaves, the layer dropped, the key kept).
fs::path without_mtp(const std::string& name, const std::string& as, int nextn = 0) {
  const fs::path d = fresh_dir(as);
  json config = config_of(name);
  const std::string mtp =
      "model.layers." + std::to_string(config["num_hidden_layers"].get<int>()) + ".";
  std::map<std::string, Tensor> t = tensors_of(fixture(name) / "model.safetensors");
  std::erase_if(t, [&](const auto& kv) { return kv.first.starts_with(mtp); });
  config["num_nextn_predict_layers"] = nextn;
  write_hf_dir(d, t, config);
  return d;
}

// The whole fixture (its MTP layer too) rewritten by moecore's writer, as `as`.
fs::path fixture_copy(const std::string& name, const std::string& as) {
  const fs::path d = fresh_dir(as);
  write_hf_dir(d, tensors_of(fixture(name) / "model.safetensors"), config_of(name));
  return d;
}

std::vector<float> as_f32(const Tensor& t) {
  EXPECT_EQ(t.dtype, "F32");
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

// The f32 values of a moecore checkpoint's tensor (iteration 0 of `save`).
std::vector<float> moecore_tensor(const fs::path& save, const std::string& name) {
  ckpt::CheckpointReader r(ckpt::iteration_dir(save, 0));
  std::vector<float> v(static_cast<size_t>(r.tensor(name).numel()));
  r.read(name, "F32", -1, 0, 0, {reinterpret_cast<std::byte*>(v.data()), v.size() * 4});
  return v;
}

// The model of an imported checkpoint's flags file, as `moecore train --config` builds it.
cli::TrainFlags flags_of(const fs::path& ck, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = cli::config_file_args((ck / kFlagsFile).string());
  args.insert(args.end(), extra.begin(), extra.end());
  return parse_model_flags(args);
}

// transformers' get_mscale (modeling_rope_utils.py), for the expected values below.
double hf_get_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// ---- config.json and the flags ----

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
  EXPECT_EQ(s.num_groups, 2);
  EXPECT_EQ(s.group_topk, 1);
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
  // parse_hf_config takes the DeepSeek path, and its config.json reads back to the same spec.
  for (const char* name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_fp8"}) {
    const HfModelSpec h = parse_hf_config(config_of(name), name);
    ASSERT_EQ(h.arch, HfArch::DeepseekV3) << name;
    EXPECT_EQ(*h.deepseek, spec_of(name)) << name;
    EXPECT_EQ(parse_hf_config(hf_config_json(h, "float32"), "written back"), h) << name;
  }
}

// The flags file's model, as the trainer's parser builds it, computes what transformers'
// DeepseekV3ForCausalLM computes: MLA's sizes and norms, YaRN's frequencies, cos / sin factor
// and softmax scale (transformers' formulas, written out here), the sigmoid router with its
// expert bias, groups, renormalisation and scaling, the shared expert, the dense layers.
TEST(HfDeepseekV3, FlagsGiveTheModelTransformersComputes) {
  const HfModelSpec h = parse_hf_config(main_model_config("deepseek_v3"), "c");
  const std::string toml = flags_toml(train_flags_of(h), "test");
  const cli::TrainFlags f = parse_model_flags(cli::config_text_args(toml, "flags.toml"));
  const ModelConfig& m = f.model;
  EXPECT_TRUE(m.multi_latent_attention);
  EXPECT_TRUE(m.qk_layernorm);  // q_a_layernorm, kv_a_layernorm
  EXPECT_EQ(m.mla.q_lora_rank, 16);
  EXPECT_EQ(m.mla.kv_lora_rank, 16);
  EXPECT_EQ(m.mla.qk_head_dim, 8);
  EXPECT_EQ(m.mla.qk_pos_emb_head_dim, 4);
  EXPECT_EQ(m.mla.v_head_dim, 8);
  EXPECT_EQ(m.vocab_size, 64);
  EXPECT_EQ(m.padded_vocab_size, 64);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_EQ(m.attention_dropout, 0.0);
  EXPECT_EQ(m.hidden_dropout, 0.0);
  EXPECT_EQ(m.activation, ops::Activation::SwiGLU);
  EXPECT_FALSE(m.add_mlp_bias);
  EXPECT_EQ(m.rotary_base, 10000.0);
  EXPECT_EQ(m.max_positions(), 64);
  EXPECT_EQ(m.ffn_hidden, 32);
  EXPECT_EQ(m.moe_layer_pattern, (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(m.moe.ffn_hidden, 8);
  EXPECT_EQ(m.moe.shared_ffn_hidden, 8);
  EXPECT_FALSE(m.moe.shared_expert_gate);
  const RouterConfig& r = m.moe.router;
  EXPECT_EQ(r.score, ScoreFunction::Sigmoid);
  EXPECT_TRUE(r.enable_expert_bias);
  EXPECT_EQ(r.num_experts, 8);
  EXPECT_EQ(r.topk, 2);
  EXPECT_EQ(r.num_groups, 2);
  EXPECT_EQ(r.group_topk, 1);
  EXPECT_EQ(r.topk_scaling_factor, 2.5);
  EXPECT_TRUE(r.dropless());
  // YaRN as transformers computes it for factor 4, mscale 1, mscale_all_dim 1: cos and sin times
  // get_mscale(4, 1) / get_mscale(4, 1) = 1, the softmax scale get_mscale(4, 1)^2 / sqrt(12),
  // the ramp over original_max_position_embeddings 16.
  EXPECT_EQ(m.mla.rope_type, ops::RopeType::Yarn);
  EXPECT_EQ(m.mla.yarn.original_max_position_embeddings, 16);
  EXPECT_EQ(m.mla.yarn.beta_fast, 32.0);
  EXPECT_EQ(m.mla.yarn.beta_slow, 1.0);
  const ops::RopeMlaSpec rope = m.mla.rope_spec(m.rotary_base);
  EXPECT_DOUBLE_EQ(ops::rope_attention_factor(rope.scaling), 1.0);
  const double ms = hf_get_mscale(4.0, 1.0);
  EXPECT_DOUBLE_EQ(m.mla.softmax_scale(), ms * ms / std::sqrt(12.0));
  // transformers' inv_freq for dim 4, base 1e4, factor 4, beta 32 / 1 over 16 positions: the
  // correction dims floor(4 ln(16 / (2 pi 32)) / (2 ln 1e4)) -> 0 and ceil(...) -> 1; ramp
  // (i - 0) / (1 - 0) clamped; inv_freq = extra (1 - ramp) ... (1 - (1 - ramp)) = extra for
  // i = 0, extra / 4 for i = 1.
  const std::vector<double> inv = ops::rope_inv_freq(4, 1e4, rope.scaling);
  ASSERT_EQ(inv.size(), 2u);
  EXPECT_DOUBLE_EQ(inv[0], 1.0);
  EXPECT_DOUBLE_EQ(inv[1], std::pow(1e4, -0.5) / 4.0);

  // transformers ignores mscale unless mscale_all_dim is set too: cos and sin times
  // get_mscale(factor) (mscale 1), the softmax scale unscaled.
  json c = main_model_config("deepseek_v3");
  c["rope_parameters"]["mscale"] = 0.707;
  c["rope_parameters"]["mscale_all_dim"] = 0;
  const ModelConfig m2 =
      parse_model_flags(
          cli::config_text_args(flags_toml(train_flags_of(parse_hf_config(c, "c")), "t"), "f.toml"))
          .model;
  EXPECT_DOUBLE_EQ(ops::rope_attention_factor(m2.mla.rope_spec(1e4).scaling),
                   hf_get_mscale(4.0, 1.0));
  EXPECT_DOUBLE_EQ(m2.mla.softmax_scale(), 1.0 / std::sqrt(12.0));
  // Both set: their ratio on cos and sin, mscale_all_dim's square on the softmax.
  c["rope_parameters"]["mscale"] = 0.8;
  c["rope_parameters"]["mscale_all_dim"] = 0.5;
  const ModelConfig m3 =
      parse_model_flags(
          cli::config_text_args(flags_toml(train_flags_of(parse_hf_config(c, "c")), "t"), "f.toml"))
          .model;
  EXPECT_DOUBLE_EQ(ops::rope_attention_factor(m3.mla.rope_spec(1e4).scaling),
                   hf_get_mscale(4.0, 0.8) / hf_get_mscale(4.0, 0.5));
  EXPECT_DOUBLE_EQ(m3.mla.softmax_scale(),
                   hf_get_mscale(4.0, 0.5) * hf_get_mscale(4.0, 0.5) / std::sqrt(12.0));
  // Without original_max_position_embeddings transformers' YaRN takes max_position_embeddings
  // (and no version reads the factor from their ratio): so do the flags, and the config.json
  // written back leaves the key out again.
  c = main_model_config("deepseek_v3");
  c["rope_parameters"].erase("original_max_position_embeddings");
  c["max_position_embeddings"] = 32;
  const HfModelSpec h5 = parse_hf_config(c, "c");
  EXPECT_EQ(h5.deepseek->original_max_position_embeddings, 0);
  const json back = hf_config_json(h5, "float32");
  EXPECT_FALSE(back["rope_parameters"].contains("original_max_position_embeddings"));
  EXPECT_EQ(parse_hf_config(back, "back"), h5);
  const ModelConfig m5 =
      parse_model_flags(cli::config_text_args(flags_toml(train_flags_of(h5), "t"), "f.toml")).model;
  EXPECT_EQ(m5.mla.yarn.original_max_position_embeddings, 32);
  // The default RoPE: Megatron's --rope-type rope (its None would be yarn for MLA).
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  const ModelConfig m4 =
      parse_model_flags(
          cli::config_text_args(flags_toml(train_flags_of(parse_hf_config(c, "c")), "t"), "f.toml"))
          .model;
  EXPECT_EQ(m4.mla.rope_type, ops::RopeType::Rope);
  EXPECT_EQ(m4.rotary_base, 5e5);
  EXPECT_DOUBLE_EQ(m4.mla.softmax_scale(), 1.0 / std::sqrt(12.0));

  // Without q LoRA: no --q-lora-rank (a direct q projection).
  const cli::TrainFlags nq = parse_model_flags(cli::config_text_args(
      flags_toml(train_flags_of(parse_hf_config(main_model_config("deepseek_v3_no_q_lora"), "c")),
                 "t"),
      "f.toml"));
  EXPECT_EQ(nq.model.mla.q_lora_rank, 0);
}

TEST(HfDeepseekV3, RefusesWhatMoecoreWouldComputeDifferentlyByKey) {
  const json base = config_of("deepseek_v3");
  auto refusal = [&](const json& c) { return error_of([&] { parse_hf_config(c, "cfg.json"); }); };
  // Group limits with num_experts_per_tok != 2 x topk_group: a group score moecore does not
  // compute, refused naming the values and the way to take the weights under Megatron's routing.
  const std::string groups = refusal(config_of("deepseek_v3", {{"num_experts_per_tok", 4}}));
  EXPECT_NE(
      groups.find("[convert] 'cfg.json': \"topk_group\": 1 is not supported: with "
                  "num_experts_per_tok 4, moecore's group-limited routing (Megatron's) scores "
                  "a group by the sum of its top num_experts_per_tok / topk_group = 4 biased "
                  "scores, transformers' DeepseekV3MoE by its top 2: they keep other groups for "
                  "some tokens (the same only when num_experts_per_tok = 2 x topk_group, as "
                  "DeepSeek-V3's 8 and 4). To import the weights under Megatron's routing "
                  "instead, set \"topk_group\" to n_group (2) and train with "
                  "--moe-router-num-groups 2 --moe-router-group-topk 1"),
      std::string::npos)
      << groups;
  const std::string top1 =
      refusal(config_of("deepseek_v3", {{"num_experts_per_tok", 1}, {"norm_topk_prob", false}}));
  EXPECT_NE(top1.find("top num_experts_per_tok / topk_group = 1 biased scores"), std::string::npos)
      << top1;
  EXPECT_NO_THROW(parse_hf_config(
      config_of("deepseek_v3", {{"num_experts_per_tok", 4}, {"topk_group", 2}}), "all groups"));
  auto with = [&](const char* key, const json& v) {
    json c = base;
    c[key] = v;
    return refusal(c);
  };
  auto with_rope = [&](const char* key, const json& v) {
    json c = base;
    c["rope_parameters"][key] = v;
    return refusal(c);
  };
  EXPECT_NE(with_rope("rope_type", "longrope").find("\"rope_parameters\""), std::string::npos);
  EXPECT_NE(with("n_group", 3).find("\"n_group\": 3 is not supported"), std::string::npos)
      << with("n_group", 3);
  EXPECT_NE(with("num_key_value_heads", 2).find("\"num_key_value_heads\": 2"), std::string::npos);
  EXPECT_NE(with("quantization_config", {{"quant_method", "fp8"}, {"fmt", "e4m3"}})
                .find("\"quantization_config\""),
            std::string::npos);
  EXPECT_NE(with("num_nextn_predict_layers", -1).find("\"num_nextn_predict_layers\": -1"),
            std::string::npos);
  EXPECT_NE(with("kv_lora_rank", 0).find("\"kv_lora_rank\": 0 is not supported: a size"),
            std::string::npos);
  // The router: Megatron's sigmoid router renormalises exactly when K > 1.
  EXPECT_NE(with("norm_topk_prob", false).find("\"norm_topk_prob\": false is not supported"),
            std::string::npos)
      << with("norm_topk_prob", false);
  // Megatron's group-limited top-k needs topk_group to divide num_experts_per_tok.
  json thirds = base;
  thirds["n_group"] = 4;
  thirds["topk_group"] = 3;
  EXPECT_NE(refusal(thirds).find("\"topk_group\": 3 is not supported: Megatron's group-limited"),
            std::string::npos)
      << refusal(thirds);
  // YaRN that Megatron's flags cannot give.
  EXPECT_NE(with_rope("attention_factor", 1.2).find("an explicit attention_factor"),
            std::string::npos);
  EXPECT_NE(with_rope("truncate", false).find("truncate false"), std::string::npos);
  EXPECT_NE(with_rope("mscale", nullptr).find("mscale unset with mscale_all_dim set"),
            std::string::npos)
      << with_rope("mscale", nullptr);
  EXPECT_NE(with("max_position_embeddings", 128).find("factor 4 is not max_position_embeddings"),
            std::string::npos)
      << with("max_position_embeddings", 128);
  EXPECT_NE(with("qk_rope_head_dim", 5).find("\"qk_rope_head_dim\": 5"), std::string::npos);
  EXPECT_NE(with_rope("factor", -4.0).find("YaRN's factor must be positive"), std::string::npos);
  EXPECT_NE(with("n_shared_experts", -1).find("\"n_shared_experts\": -1"), std::string::npos);
  EXPECT_NE(with("hidden_size", int64_t{1} << 41).find("a size must be below 2^40"),
            std::string::npos);
  json other = base;
  other["model_type"] = "mixtral";
  other["architectures"] = {"MixtralForCausalLM"};
  EXPECT_NE(error_of([&] {
              parse_deepseek_v3_config(other, "cfg.json");
            }).find("[convert] 'cfg.json' is not a DeepSeek-V3 config.json"),
            std::string::npos);
  json mixed = base;
  mixed["architectures"] = {"MixtralForCausalLM"};
  EXPECT_NE(refusal(mixed).find("name different models"), std::string::npos) << refusal(mixed);
}

// ---- the tensor table ----

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

// The table both directions read (hf_tensor_map) places every HF tensor where the name contract
// (deepseek_v3_tensor_target) says, uses exactly the fixtures' tensors (each FP8 weight with its
// scale beside it), and with rope_interleave true copies rows as they are.
TEST(HfDeepseekV3, TableAgreesWithTheNameContract) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(name);
    const HfModelSpec h = parse_hf_config(config_of(name), name);
    const HfTensorMap map = hf_tensor_map(h);
    std::set<std::string> used;
    for (const TensorMapping& t : map.tensors) {
      for (const HfTensor& x : t.hf) {
        const auto target = deepseek_v3_tensor_target(x.name, *h.deepseek);
        ASSERT_TRUE(target) << x.name;
        EXPECT_EQ(target->moecore, t.moecore) << x.name;
        EXPECT_NE(target->part, "copy") << x.name;
        EXPECT_TRUE(used.insert(x.name).second) << x.name;
      }
      // Interleaved pairs: each HF tensor's rows in one piece per head part, in order.
      if (t.hf.size() == 1) {
        int64_t next = 0;
        for (const RowBlock& b : t.blocks) {
          EXPECT_EQ(b.hf_row, next) << t.moecore;
          next += b.rows;
        }
      }
    }
    for (const HfTensorMap::Copy& c : map.copies) {
      const auto target = deepseek_v3_tensor_target(c.tensor.name, *h.deepseek);
      ASSERT_TRUE(target) << c.tensor.name;
      EXPECT_EQ(target->part, "copy");
      EXPECT_TRUE(used.insert(c.tensor.name).second);
      EXPECT_TRUE(used.count(c.of)) << c.of;
    }
    std::set<std::string> in_file;
    const ckpt::SafetensorsFile file(fixture(name) / "model.safetensors");
    for (const std::string& n : file.names()) {
      if (n.ends_with("_scale_inv")) {
        EXPECT_TRUE(used.count(n.substr(0, n.size() - 10))) << n;
        continue;
      }
      in_file.insert(n);
    }
    EXPECT_EQ(used, in_file);
  }
}

// ---- import ----

// With its MTP layer (model.layers.{L}.*): the layer's tensors become mtp.layers.0.* (enorm,
// hnorm, eh_proj, a transformer layer of the decoder's names, shared_head.norm as its final
// norm), its copies of the embedding and head are read once (checked equal), and the flags file
// has --mtp-num-layers; by the library and by `moecore convert`.
TEST(HfDeepseekV3, ImportsTheMtpLayer) {
  const fs::path src = fixture_copy("deepseek_v3", "mtp_src"), ck = fresh_dir("mtp_ck");
  const ImportResult res = import_hf(src, ck);
  EXPECT_TRUE(res.warnings.empty());
  EXPECT_EQ(res.spec.deepseek->mtp_layers, 1);
  const auto hf = tensors_of(src / "model.safetensors");
  EXPECT_EQ(res.hf_tensors, static_cast<int64_t>(hf.size()));
  auto same = [&](const std::string& moecore, const std::string& hf_name) {
    EXPECT_EQ(moecore_tensor(ck, moecore), as_f32(hf.at(hf_name))) << moecore << " " << hf_name;
  };
  same("mtp.layers.0.enorm.weight", "model.layers.3.enorm.weight");
  same("mtp.layers.0.hnorm.weight", "model.layers.3.hnorm.weight");
  same("mtp.layers.0.eh_proj.weight", "model.layers.3.eh_proj.weight");
  same("mtp.layers.0.final_layernorm.weight", "model.layers.3.shared_head.norm.weight");
  same("mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight",
       "model.layers.3.self_attn.kv_a_proj_with_mqa.weight");
  same("mtp.layers.0.transformer_layer.mlp.router.expert_bias",
       "model.layers.3.mlp.gate.e_score_correction_bias");
  same("embedding.word_embeddings.weight", "model.layers.3.embed_tokens.weight");
  same("output_layer.weight", "model.layers.3.shared_head.head.weight");
  EXPECT_NE(read_text(ck / kFlagsFile).find("mtp-num-layers = 1"), std::string::npos)
      << read_text(ck / kFlagsFile);
  // The MTP layer's copy of the head differing from the main model's is refused, naming both.
  auto t = hf;
  t.at("model.layers.3.shared_head.head.weight").bytes[0] ^= std::byte{1};
  const fs::path bad = fresh_dir("mtp_bad");
  write_hf_dir(bad, t, read_json(src / "config.json"));
  const std::string e = error_of([&] { import_hf(bad, fresh_dir("mtp_bad_ck")); });
  EXPECT_NE(e.find("model.layers.3.shared_head.head.weight"), std::string::npos) << e;
  const fs::path out = fresh_dir("mtp_cli");
  fs::remove_all(out);
  const testing::CommandResult r = testing::run_moecore(
      "convert hf-to-moecore --input " + fixture_copy("deepseek_v3_fp8", "mtp_src_fp8").string() +
      " --output " + out.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(read_text(out / kFlagsFile).find("mtp-num-layers = 1"), std::string::npos);
}

// Imported without the MTP layer: each moecore tensor holds its HF tensors' rows (MLA's
// projections as they are, the rotary pairs already interleaved; the experts stacked, fc1 =
// [gate; up]; the shared expert; the dense layer), the routers' expert bias is
// e_score_correction_bias, and the flags file builds the model those tensors fill.
TEST(HfDeepseekV3, ImportsMlaRoutersExpertsAndDenseLayers) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora"}) {
    SCOPED_TRACE(name);
    const fs::path src = without_mtp(name, "imp_src_" + name), ck = fresh_dir("imp_ck_" + name);
    const ImportResult res = import_hf(src, ck);
    EXPECT_TRUE(res.warnings.empty());
    const auto hf = tensors_of(src / "model.safetensors");
    EXPECT_EQ(res.hf_tensors, static_cast<int64_t>(hf.size()));
    auto same = [&](const std::string& moecore, const std::string& hf_name) {
      EXPECT_EQ(moecore_tensor(ck, moecore), as_f32(hf.at(hf_name))) << moecore << " " << hf_name;
    };
    const std::string a = "model.layers.1.self_attn.", b = "decoder.layers.1.self_attention.";
    if (name == "deepseek_v3") {
      same(b + "linear_q_down_proj.weight", a + "q_a_proj.weight");
      same(b + "q_layernorm.weight", a + "q_a_layernorm.weight");
      same(b + "linear_q_up_proj.weight", a + "q_b_proj.weight");
    } else {
      same(b + "linear_q_proj.weight", a + "q_proj.weight");
    }
    same(b + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight");
    same(b + "kv_layernorm.weight", a + "kv_a_layernorm.weight");
    same(b + "linear_kv_up_proj.weight", a + "kv_b_proj.weight");
    same(b + "linear_proj.weight", a + "o_proj.weight");
    same("decoder.layers.2.mlp.router.weight", "model.layers.2.mlp.gate.weight");
    same("decoder.layers.2.mlp.router.expert_bias",
         "model.layers.2.mlp.gate.e_score_correction_bias");
    same("decoder.layers.1.mlp.shared_experts.linear_fc2.weight",
         "model.layers.1.mlp.shared_experts.down_proj.weight");
    same("decoder.layers.0.mlp.linear_fc2.weight", "model.layers.0.mlp.down_proj.weight");
    // Expert 5 of layer 2: fc1[5] = [gate_5; up_5], fc2[5] = down_5.
    const std::vector<float> fc1 =
        moecore_tensor(ck, "decoder.layers.2.mlp.experts.linear_fc1.weight");
    const std::vector<float> gate = as_f32(hf.at("model.layers.2.mlp.experts.5.gate_proj.weight"));
    const std::vector<float> up = as_f32(hf.at("model.layers.2.mlp.experts.5.up_proj.weight"));
    const size_t F8H = gate.size();  // F x H
    EXPECT_TRUE(std::equal(gate.begin(), gate.end(), fc1.begin() + 5 * 2 * F8H));
    EXPECT_TRUE(std::equal(up.begin(), up.end(), fc1.begin() + 5 * 2 * F8H + F8H));
    const std::vector<float> fc2 =
        moecore_tensor(ck, "decoder.layers.2.mlp.experts.linear_fc2.weight");
    const std::vector<float> down = as_f32(hf.at("model.layers.2.mlp.experts.5.down_proj.weight"));
    EXPECT_TRUE(std::equal(down.begin(), down.end(), fc2.begin() + 5 * down.size()));
    // The flags file: the model of those tensors, without MTP layers.
    const std::string toml = read_text(ck / kFlagsFile);
    EXPECT_NE(toml.find("multi-latent-attention = true"), std::string::npos) << toml;
    EXPECT_NE(toml.find("moe-router-enable-expert-bias = true"), std::string::npos) << toml;
    EXPECT_EQ(toml.find("mtp-num-layers"), std::string::npos) << toml;
    const ckpt::Manifest man = ckpt::CheckpointReader(ckpt::iteration_dir(ck, 0)).manifest();
    EXPECT_EQ(man.state["hf"]["architecture"], "DeepseekV3ForCausalLM");
    EXPECT_EQ(man.state["model"], train::model_signature(flags_of(ck).model));
  }
}

// transformers' save_pretrained drops the MTP layer but keeps num_nextn_predict_layers: the main
// model is imported, without MTP layers, and a warning says so.
TEST(HfDeepseekV3, ACheckpointWithoutItsMtpLayerImportsTheMainModel) {
  const fs::path src = without_mtp("deepseek_v3", "nomtp_src", /*nextn=*/1);
  const fs::path ck = fresh_dir("nomtp_ck"), ref = fresh_dir("nomtp_ref");
  const ImportResult res = import_hf(src, ck);
  ASSERT_EQ(res.warnings.size(), 1u);
  EXPECT_NE(res.warnings[0].find("num_nextn_predict_layers 1 but the weights hold no "
                                 "'model.layers.3.*' tensor"),
            std::string::npos)
      << res.warnings[0];
  EXPECT_EQ(res.spec.deepseek->mtp_layers, 0);
  EXPECT_EQ(read_text(ck / kFlagsFile).find("mtp-num-layers"), std::string::npos);
  // The same checkpoint as that of the config without MTP layers.
  import_hf(without_mtp("deepseek_v3", "nomtp_src0"), ref);
  for (const char* n : {"decoder.layers.2.mlp.experts.linear_fc1.weight", "output_layer.weight"})
    EXPECT_EQ(moecore_tensor(ck, n), moecore_tensor(ref, n)) << n;
  // Some of an MTP layer is not none of it: its missing tensors are named.
  json config = read_json(src / "config.json");
  auto t = tensors_of(fixture("deepseek_v3") / "model.safetensors");
  t.erase("model.layers.3.hnorm.weight");
  const fs::path part = fresh_dir("nomtp_part");
  write_hf_dir(part, t, config);
  const std::string e = error_of([&] { import_hf(part, fresh_dir("nomtp_part_ck")); });
  EXPECT_NE(e.find("are missing: 'model.layers.3.hnorm.weight'"), std::string::npos) << e;
}

// The FP8 checkpoint's weights are imported as transformers dequantizes them (the fixture's
// dequantized.safetensors, bit for bit), every scale consumed; the other tensors as they are.
TEST(HfDeepseekV3, Fp8WeightsImportDequantizedExactly) {
  const fs::path src = without_mtp("deepseek_v3_fp8", "fp8_src"), ck = fresh_dir("fp8_ck");
  const ImportResult res = import_hf(src, ck);
  EXPECT_EQ(res.hf_tensors, static_cast<int64_t>(tensors_of(src / "model.safetensors").size()));
  const auto deq = tensors_of(fixture("deepseek_v3_fp8") / "dequantized.safetensors");
  const HfTensorMap map = hf_tensor_map(res.spec);
  int checked = 0;
  for (const TensorMapping& t : map.tensors) {
    if (t.hf.size() != 1 || !deq.count(t.hf[0].name)) continue;  // single-tensor ones suffice
    EXPECT_EQ(moecore_tensor(ck, t.moecore), as_f32(deq.at(t.hf[0].name))) << t.moecore;
    ++checked;
  }
  EXPECT_EQ(checked, 18);  // per layer q_a, q_b, kv_a, kv_b, o; the dense and shared down_proj
  const std::vector<float> fc1 =
      moecore_tensor(ck, "decoder.layers.1.mlp.experts.linear_fc1.weight");
  const std::vector<float> up = as_f32(deq.at("model.layers.1.mlp.experts.3.up_proj.weight"));
  EXPECT_TRUE(std::equal(up.begin(), up.end(), fc1.begin() + (2 * 3 + 1) * up.size()));
}

// ---- export ----

// Import then export gives every tensor back byte for byte (the whole model.safetensors, header
// and order included) and a config.json of the same model. The FP8 checkpoint exports in the
// model's dtype (F32 here): its FP8 weights as their dequantized values, no quantization_config.
TEST(HfDeepseekV3, RoundTripIsBytewise) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3 with MTP",
                                 "deepseek_v3_no_q_lora with MTP"}) {
    SCOPED_TRACE(name);
    const std::string fix = name.substr(0, name.find(' '));
    const bool mtp = name.ends_with("with MTP");
    const fs::path src =
        mtp ? fixture_copy(fix, "rt_src_mtp_" + fix) : without_mtp(fix, "rt_src_" + fix);
    const fs::path ck = fresh_dir("rt_ck_" + fix + (mtp ? "_mtp" : ""));
    const fs::path hf = fresh_dir("rt_hf_" + std::string(mtp ? "mtp_" : "") + fix);
    import_hf(src, ck);
    ExportOptions o;
    o.input = ck;
    o.output = hf;
    const ExportResult r = export_hf(o);
    EXPECT_EQ(r.arch_from, "the import");
    EXPECT_EQ(r.spec.arch, HfArch::DeepseekV3);
    const auto a = tensors_of(src / "model.safetensors"), b = tensors_of(hf / "model.safetensors");
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [n, t] : a) {
      ASSERT_TRUE(b.count(n)) << n;
      EXPECT_EQ(b.at(n).dtype, t.dtype) << n;
      EXPECT_EQ(b.at(n).shape, t.shape) << n;
      EXPECT_TRUE(b.at(n).bytes == t.bytes) << n;
    }
    EXPECT_EQ(read_text(hf / "model.safetensors"), read_text(src / "model.safetensors"));
    const json cfg = read_json(hf / "config.json");
    EXPECT_EQ(parse_hf_config(cfg, "exported"),
              parse_hf_config(read_json(src / "config.json"), "s"));
    EXPECT_EQ(cfg["initializer_range"], 0.02);  // carried over
    EXPECT_EQ(cfg["pretraining_tp"], 1);
  }
  const fs::path src = without_mtp("deepseek_v3_fp8", "rt_src_fp8"), ck = fresh_dir("rt_ck_fp8");
  const fs::path hf = fresh_dir("rt_hf_fp8");
  import_hf(src, ck);
  ExportOptions o;
  o.input = ck;
  o.output = hf;
  export_hf(o);
  const auto in = tensors_of(src / "model.safetensors"), out = tensors_of(hf / "model.safetensors");
  const auto deq = tensors_of(fixture("deepseek_v3_fp8") / "dequantized.safetensors");
  for (const auto& [n, t] : out) {
    EXPECT_EQ(t.dtype, "F32") << n;
    const Tensor& want = deq.count(n) ? deq.at(n) : in.at(n);
    EXPECT_TRUE(t.bytes == want.bytes) << n;
  }
  for (const auto& [n, t] : in) EXPECT_TRUE(out.count(n) || n.ends_with("_scale_inv")) << n;
  const json cfg = read_json(hf / "config.json");
  EXPECT_FALSE(cfg.contains("quantization_config"));
  DeepseekV3Spec want = spec_of("deepseek_v3_fp8");
  want.fp8_block.reset();
  want.mtp_layers = 0;
  EXPECT_EQ(*parse_hf_config(cfg, "exported").deepseek, want);
}

// What DeepseekV3ForCausalLM cannot express is refused naming the flag, nothing written: the
// model of the fixture's flags with one flag changed, exported through hf_spec_of_model (which
// export_hf calls) and through `moecore convert moecore-to-hf`.
TEST(HfDeepseekV3, ExportRefusesWhatDeepseekV3CannotExpress) {
  const std::string toml =
      flags_toml(train_flags_of(parse_hf_config(main_model_config("deepseek_v3"), "c")), "t");
  auto model = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = cli::config_text_args(toml, "f.toml");
    args.insert(args.end(), extra.begin(), extra.end());
    return parse_model_flags(args).model;
  };
  const ModelConfig base = model({});
  EXPECT_EQ(default_hf_arch(base), HfArch::DeepseekV3);
  EXPECT_EQ(hf_spec_of_model(base, HfArch::DeepseekV3).deepseek,
            parse_hf_config(main_model_config("deepseek_v3"), "c").deepseek);
  const std::string as =
      "[convert] this moecore model cannot be written as DeepseekV3ForCausalLM: ";
  struct Case {
    std::vector<std::string> flags;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {{"--moe-router-score-function", "sqrtsoftplus"},
            "--moe-router-score-function sqrtsoftplus: DeepSeek-V3's router is sigmoid"},
           // Top-4 with the fixtures' group limits (2 groups keeping 1): a group's top 4.
           {{"--moe-router-topk", "4"},
            "--moe-router-group-topk 1 with --moe-router-topk 4: moecore scores a group by the "
            "sum of its top 4 biased scores, transformers' DeepseekV3MoE by its top 2, so they "
            "keep other groups for some tokens; a model routed with --moe-router-topk = 2 x "
            "--moe-router-group-topk (or without group limits) exports as the same model"},
           {{"--mscale", "0.5", "--mscale-all-dim", "0"}, "--mscale 0.5 --mscale-all-dim 0"},
           {{"--max-position-embeddings", "128"},
            "--rotary-scaling-factor 4 is not --max-position-embeddings / "
            "--yarn-original-max-position-embeddings = 128 / 16"},
           {{"--moe-layer-freq", "[1,0,1]"}, "dense layer 1 after MoE layers"},
           {{"--moe-shared-expert-gate"}, "--moe-shared-expert-gate: its shared expert is ungated"},
       }) {
    SCOPED_TRACE(c.flags[0]);
    const std::string e = error_of([&] { hf_spec_of_model(model(c.flags), HfArch::DeepseekV3); });
    EXPECT_NE(e.find(as + c.expect), std::string::npos) << e;
  }
  // Without --qk-layernorm MLA has no q / kv norms; without MLA it is no DeepSeek-V3; and an MLA
  // model is no other class.
  std::vector<std::string> no_norm = cli::config_text_args(toml, "f.toml");
  std::erase(no_norm, std::string("--qk-layernorm"));
  EXPECT_NE(error_of([&] {
              hf_spec_of_model(parse_model_flags(no_norm).model, HfArch::DeepseekV3);
            }).find(as + "no --qk-layernorm"),
            std::string::npos);
  EXPECT_NE(error_of([&] { hf_spec_of_model(base, HfArch::Qwen2Moe); })
                .find("multi-latent attention (--multi-latent-attention): export with --arch "
                      "deepseek_v3"),
            std::string::npos);
  // Through the command: a flags file with a changed YaRN (not part of the checkpoint's
  // signature), nothing written.
  const fs::path ck = fresh_dir("export_refused_ck"), out = fresh_dir("export_refused_hf");
  import_hf(without_mtp("deepseek_v3", "export_refused_src"), ck);
  const fs::path flags = fresh_dir("export_refused.toml");
  std::string text = read_text(ck / kFlagsFile);
  for (const auto& [from, to] : {std::pair{"\nmscale = 1.0\n", "\nmscale = 0.5\n"},
                                 {"\nmscale-all-dim = 1.0\n", "\nmscale-all-dim = 0.0\n"}}) {
    ASSERT_NE(text.find(from), std::string::npos) << text;
    text.replace(text.find(from), std::string(from).size(), to);
  }
  std::ofstream(flags) << text;
  const testing::CommandResult r =
      testing::run_moecore("convert moecore-to-hf --input " + ck.string() + " --flags " +
                           flags.string() + " --output " + out.string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--mscale 0.5 --mscale-all-dim 0"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
  // And the command exports the import as it is (--arch deepseek_v3 spelled out).
  const testing::CommandResult ok =
      testing::run_moecore("convert moecore-to-hf --input " + ck.string() +
                           " --arch deepseek_v3 --output " + out.string());
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

// ---- rope_interleave false ----

// transformers pairs q's and k's rotary elements as (i, i + pe/2) when rope_interleave is false,
// and with it true first permutes them as view(pe/2, 2).transpose (apply_rotary_pos_emb_interleave)
// and then pairs them so. The fixture's weights with their rotary rows permuted that way (in
// q_b_proj / q_proj per head, in kv_a_proj_with_mqa's last pe rows) and rope_interleave false are
// therefore the same model, computing reference.json's logits with the same operations. Its
// import permutes the rows back: the same moecore checkpoint, tensor for tensor, bit for bit;
// its export permutes them again, giving the half-split checkpoint back byte for byte.
TEST(HfDeepseekV3, RopeInterleaveFalseImportsToTheSameModelAndExportsBack) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora"}) {
    SCOPED_TRACE(name);
    const DeepseekV3Spec s = spec_of(name);
    const int64_t pe = s.qk_rope_head_dim, qk = s.qk_nope_head_dim, kl = s.kv_lora_rank;
    json config = main_model_config(name);
    config["rope_interleave"] = false;
    auto t = tensors_of(without_mtp(name, "ri_plain_" + name) / "model.safetensors");
    // The rows [base, base + pe) in de-interleaved order: row base + i <- base + 2i, row
    // base + pe/2 + i <- base + 2i + 1.
    auto deinterleave = [&](Tensor& x, int64_t base) {
      const size_t w = x.bytes.size() / static_cast<size_t>(x.shape[0]);
      const std::vector<std::byte> old = x.bytes;
      for (int64_t i = 0; i < pe / 2; ++i) {
        std::memcpy(&x.bytes[(base + i) * w], &old[(base + 2 * i) * w], w);
        std::memcpy(&x.bytes[(base + pe / 2 + i) * w], &old[(base + 2 * i + 1) * w], w);
      }
    };
    int permuted = 0;
    for (auto& [n, x] : t) {
      if (n.ends_with("q_b_proj.weight") || n.ends_with("self_attn.q_proj.weight")) {
        for (int64_t h = 0; h < s.num_heads; ++h) deinterleave(x, h * (qk + pe) + qk);
        ++permuted;
      } else if (n.ends_with("kv_a_proj_with_mqa.weight")) {
        deinterleave(x, kl);
        ++permuted;
      }
    }
    EXPECT_EQ(permuted, 2 * s.num_layers);
    const fs::path half = fresh_dir("ri_half_" + name);
    write_hf_dir(half, t, config);
    const fs::path ck_half = fresh_dir("ri_ck_half_" + name), ck = fresh_dir("ri_ck_" + name);
    import_hf(half, ck_half);
    import_hf(without_mtp(name, "ri_plain_" + name), ck);
    const ckpt::Manifest man = ckpt::CheckpointReader(ckpt::iteration_dir(ck, 0)).manifest();
    for (const ckpt::GlobalTensor& g : man.tensors)
      EXPECT_EQ(moecore_tensor(ck_half, g.name), moecore_tensor(ck, g.name)) << g.name;
    const fs::path hf = fresh_dir("ri_hf_" + name);
    ExportOptions o;
    o.input = ck_half;
    o.output = hf;
    export_hf(o);
    EXPECT_EQ(read_text(hf / "model.safetensors"), read_text(half / "model.safetensors"));
    EXPECT_EQ(read_json(hf / "config.json")["rope_interleave"], false);
  }
}

// ---- the numbers ----

std::vector<double> matvec(const std::vector<double>& W, const std::vector<double>& x) {
  const size_t cols = x.size(), rows = W.size() / cols;
  std::vector<double> y(rows, 0.0);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) y[r] += W[r * cols + c] * x[c];
  }
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<double>& w,
                            double eps) {
  double ms = 0;
  for (double v : x) ms += v * v;
  const double r = 1.0 / std::sqrt(ms / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
  return y;
}

// transformers' DeepseekV3ForCausalLM (modeling_deepseek_v3.py, modeling_rope_utils.py:
// _compute_yarn_parameters; 5.24) transcribed in float64 plain loops from an HF directory's
// tensors (HfWeights: FP8 dequantized) and its config.json's keys, with nothing of moecore's
// model or converter: DeepseekV3Attention (q_a_proj -> q_a_layernorm -> q_b_proj or q_proj;
// kv_a_proj_with_mqa's [latent | rotary key], kv_a_layernorm, kv_b_proj's per-head [k_nope | v];
// the rotary elements de-interleaved when rope_interleave, then pairs (i, i + pe/2); scaling
// (qk + pe)^-1/2 times get_mscale(factor, mscale_all_dim)^2), DeepseekV3MoE (sigmoid scores,
// e_score_correction_bias for the choice, a group scored by the sum of its two best biased scores
// whatever num_experts_per_tok and topk_group, the left-out groups' experts masked with -inf,
// norm_topk_prob with 1e-20, routed_scaling_factor, the shared experts), the dense MLPs of the
// first first_k_dense_replace layers.
class Transcription {
 public:
  Transcription(const fs::path& dir, const json& c) : c_(c) {
    HfWeights w(dir);
    if (c.contains("quantization_config")) {
      const json& b = c["quantization_config"]["weight_block_size"];
      w.set_fp8_block_size({b[0].get<int64_t>(), b[1].get<int64_t>()});
    }
    for (const std::string& n : w.names()) {
      if (n.ends_with("_scale_inv")) continue;
      const std::vector<float> v = w.read_f32(n);
      t_[n].assign(v.begin(), v.end());
    }
  }

  // [S, V] logits of `ids`, each position p at position p.
  std::vector<double> logits(const std::vector<int32_t>& ids) const {
    const int64_t H = c_["hidden_size"], Hq = c_["num_attention_heads"];
    const int64_t qk = c_["qk_nope_head_dim"], pe = c_["qk_rope_head_dim"], dv = c_["v_head_dim"];
    const int64_t kl = c_["kv_lora_rank"], L = c_["num_hidden_layers"], E = c_["n_routed_experts"];
    const int64_t K = c_["num_experts_per_tok"], G = c_["n_group"], g = c_["topk_group"];
    const double eps = c_["rms_norm_eps"], rsf = c_["routed_scaling_factor"];
    const json& rp = c_["rope_parameters"];
    const double f = rp["factor"], base = rp["rope_theta"];
    const double ms = rp["mscale"], msa = rp["mscale_all_dim"];
    const double orig = rp["original_max_position_embeddings"];
    auto get_mscale = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    const double attn_factor =
        ms != 0 && msa != 0 ? get_mscale(f, ms) / get_mscale(f, msa) : get_mscale(f, 1.0);
    auto cdim = [&](double rot) {
      return static_cast<double>(pe) * std::log(orig / (rot * 2 * std::numbers::pi)) /
             (2 * std::log(base));
    };
    const double low = std::max(std::floor(cdim(rp["beta_fast"])), 0.0);
    double high = std::min(std::ceil(cdim(rp["beta_slow"])), static_cast<double>(pe - 1));
    if (low == high) high += 0.001;
    std::vector<double> inv(pe / 2);
    for (int64_t i = 0; i < pe / 2; ++i) {
      const double pos_freq = std::pow(base, static_cast<double>(2 * i) / static_cast<double>(pe));
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1 - ramp;
      inv[i] = 1 / (f * pos_freq) * (1 - extrapolation) + 1 / pos_freq * extrapolation;
    }
    double scaling = 1 / std::sqrt(static_cast<double>(qk + pe));
    if (msa != 0) scaling *= get_mscale(f, msa) * get_mscale(f, msa);
    const bool interleave = c_.value("rope_interleave", true);
    auto rope = [&](std::vector<double> v, int64_t p) {
      if (interleave) {  // apply_rotary_pos_emb_interleave: view(pe/2, 2).transpose
        std::vector<double> d(pe);
        for (int64_t i = 0; i < pe / 2; ++i) {
          d[i] = v[2 * i];
          d[pe / 2 + i] = v[2 * i + 1];
        }
        v = d;
      }
      std::vector<double> y(pe);
      for (int64_t i = 0; i < pe / 2; ++i) {
        const double co = std::cos(static_cast<double>(p) * inv[i]) * attn_factor;
        const double si = std::sin(static_cast<double>(p) * inv[i]) * attn_factor;
        y[i] = v[i] * co - v[i + pe / 2] * si;
        y[i + pe / 2] = v[i + pe / 2] * co + v[i] * si;
      }
      return y;
    };
    auto mlp = [&](const std::string& p, const std::vector<double>& x) {
      const std::vector<double> gt = matvec(at(p + "gate_proj.weight"), x);
      const std::vector<double> up = matvec(at(p + "up_proj.weight"), x);
      std::vector<double> a(gt.size());
      for (size_t i = 0; i < a.size(); ++i) a[i] = gt[i] / (1 + std::exp(-gt[i])) * up[i];
      return matvec(at(p + "down_proj.weight"), a);
    };
    const int64_t S = static_cast<int64_t>(ids.size());
    const std::vector<double>& emb = at("model.embed_tokens.weight");
    std::vector<std::vector<double>> x(S);
    for (int64_t t = 0; t < S; ++t)
      x[t].assign(emb.begin() + ids[t] * H, emb.begin() + (ids[t] + 1) * H);
    for (int64_t l = 0; l < L; ++l) {
      const std::string P = "model.layers." + std::to_string(l) + ".", A = P + "self_attn.";
      std::vector<std::vector<double>> q(S), k(S), v(S);  // [t][h * D + d]
      for (int64_t t = 0; t < S; ++t) {
        const std::vector<double> h = rmsnorm(x[t], at(P + "input_layernorm.weight"), eps);
        const std::vector<double> qa =
            has(A + "q_a_proj.weight")
                ? matvec(at(A + "q_b_proj.weight"), rmsnorm(matvec(at(A + "q_a_proj.weight"), h),
                                                            at(A + "q_a_layernorm.weight"), eps))
                : matvec(at(A + "q_proj.weight"), h);
        const std::vector<double> ckv = matvec(at(A + "kv_a_proj_with_mqa.weight"), h);
        const std::vector<double> k_rot = rope({ckv.begin() + kl, ckv.end()}, t);
        const std::vector<double> kv =
            matvec(at(A + "kv_b_proj.weight"),
                   rmsnorm({ckv.begin(), ckv.begin() + kl}, at(A + "kv_a_layernorm.weight"), eps));
        for (int64_t hh = 0; hh < Hq; ++hh) {
          const auto qh = qa.begin() + hh * (qk + pe);
          q[t].insert(q[t].end(), qh, qh + qk);
          const std::vector<double> q_rot = rope({qh + qk, qh + qk + pe}, t);
          q[t].insert(q[t].end(), q_rot.begin(), q_rot.end());
          const auto kh = kv.begin() + hh * (qk + dv);
          k[t].insert(k[t].end(), kh, kh + qk);
          k[t].insert(k[t].end(), k_rot.begin(), k_rot.end());
          v[t].insert(v[t].end(), kh + qk, kh + qk + dv);
        }
      }
      for (int64_t t = 0; t < S; ++t) {  // causal attention, o_proj, residual
        std::vector<double> o(Hq * dv, 0.0);
        for (int64_t hh = 0; hh < Hq; ++hh) {
          std::vector<double> sc(t + 1);
          for (int64_t u = 0; u <= t; ++u) {
            double d = 0;
            for (int64_t j = 0; j < qk + pe; ++j)
              d += q[t][hh * (qk + pe) + j] * k[u][hh * (qk + pe) + j];
            sc[u] = d * scaling;
          }
          const double mx = *std::max_element(sc.begin(), sc.end());
          double z = 0;
          for (double& e : sc) z += (e = std::exp(e - mx));
          for (int64_t u = 0; u <= t; ++u) {
            for (int64_t j = 0; j < dv; ++j) o[hh * dv + j] += sc[u] / z * v[u][hh * dv + j];
          }
        }
        const std::vector<double> y = matvec(at(A + "o_proj.weight"), o);
        for (int64_t i = 0; i < H; ++i) x[t][i] += y[i];
      }
      const std::string M = P + "mlp.";
      for (int64_t t = 0; t < S; ++t) {
        const std::vector<double> h = rmsnorm(x[t], at(P + "post_attention_layernorm.weight"), eps);
        std::vector<double> y;
        if (!has(M + "gate.weight")) {
          y = mlp(M, h);
        } else {
          const std::vector<double> lg = matvec(at(M + "gate.weight"), h);
          const std::vector<double>& bias = at(M + "gate.e_score_correction_bias");
          std::vector<double> sc(E), key(E);
          for (int64_t e = 0; e < E; ++e) {
            sc[e] = 1 / (1 + std::exp(-lg[e]));
            key[e] = sc[e] + bias[e];
          }
          const int64_t per = E / G, top = 2;
          std::vector<double> gs(G);
          for (int64_t j = 0; j < G; ++j) {
            std::vector<double> grp(key.begin() + j * per, key.begin() + (j + 1) * per);
            std::sort(grp.rbegin(), grp.rend());
            gs[j] = std::accumulate(grp.begin(), grp.begin() + top, 0.0);
          }
          std::vector<int64_t> order(G);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
          std::vector<double> masked(E);
          for (int64_t e = 0; e < E; ++e) {
            const bool kept =
                std::find(order.begin(), order.begin() + g, e / per) != order.begin() + g;
            masked[e] = kept ? key[e] : -INFINITY;
          }
          std::vector<int64_t> idx(E);
          std::iota(idx.begin(), idx.end(), 0);
          std::stable_sort(idx.begin(), idx.end(),
                           [&](int64_t a, int64_t b) { return masked[a] > masked[b]; });
          double den = 1e-20;
          for (int64_t j = 0; j < K; ++j) den += sc[idx[j]];
          y = mlp(M + "shared_experts.", h);
          for (int64_t j = 0; j < K; ++j) {
            const double wk = sc[idx[j]] / den * rsf;
            const std::vector<double> ye = mlp(M + "experts." + std::to_string(idx[j]) + ".", h);
            for (int64_t i = 0; i < H; ++i) y[i] += wk * ye[i];
          }
        }
        for (int64_t i = 0; i < H; ++i) x[t][i] += y[i];
      }
    }
    std::vector<double> out;
    for (int64_t t = 0; t < S; ++t) {
      const std::vector<double> y =
          matvec(at("lm_head.weight"), rmsnorm(x[t], at("model.norm.weight"), eps));
      out.insert(out.end(), y.begin(), y.end());
    }
    return out;
  }

 private:
  bool has(const std::string& n) const { return t_.count(n) > 0; }
  const std::vector<double>& at(const std::string& n) const { return t_.at(n); }

  json c_;
  std::map<std::string, std::vector<double>> t_;
};

// The mean next-token cross entropy of [S, V] logits (positions 0..S-2 predicting ids 1..S-1),
// as transformers' ForCausalLMLoss computes reference.json's loss.
double mean_next_token_ce(const std::vector<double>& logits, const std::vector<int32_t>& ids) {
  const size_t S = ids.size(), V = logits.size() / S;
  double sum = 0;
  for (size_t s = 0; s + 1 < S; ++s) {
    const double* row = logits.data() + s * V;
    const double mx = *std::max_element(row, row + V);
    double z = 0;
    for (size_t v = 0; v < V; ++v) z += std::exp(row[v] - mx);
    sum += mx + std::log(z) - row[ids[s + 1]];
  }
  return sum / static_cast<double>(S - 1);
}

// max |a - b| over [S, V] logits, divided by the largest |b|.
double rel_logits_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return worst / scale;
}

std::vector<double> flat_logits(const json& seq) {
  std::vector<double> out;
  for (const json& row : seq["logits"]) {
    for (const json& v : row) out.push_back(v.get<double>());
  }
  return out;
}

// The transcription computes reference.json's float64 logits and losses (transformers' own
// float64 forward, which rounds its RMSNorms, router logits and RoPE tables to float32): it is
// transformers' function, for every fixture.
TEST(HfDeepseekV3, TheTranscriptionComputesTransformersLogits) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_fp8"}) {
    const Transcription tr(fixture(name), config_of(name));
    const json ref = read_json(fixture(name) / "reference.json");
    double worst = 0, worst_loss = 0;
    for (const json& seq : ref["sequences"]) {
      const std::vector<int32_t> ids = seq["input_ids"].get<std::vector<int32_t>>();
      const std::vector<double> got = tr.logits(ids);
      const double d = rel_logits_diff(got, flat_logits(seq));
      EXPECT_LE(d, testing::kHfF64LogitsRtol) << name;
      const double want = seq["loss"].get<double>();
      const double dl = std::abs(mean_next_token_ce(got, ids) - want) / want;
      EXPECT_LE(dl, testing::kHfF64LogitsRtol) << name;
      worst = std::max(worst, d);
      worst_loss = std::max(worst_loss, dl);
    }
    std::cout << "[hf transcription] " << name << ": logits " << worst
              << " of the largest |logit| from transformers' float64, loss " << worst_loss
              << " relative\n";
  }
}

// The fixture imported as it is, without its MTP layer (which the float64 model below leaves
// out: reference.json is the main model's).
fs::path imported_main_model(const std::string& name) {
  const fs::path ck = fresh_dir("num_ck_" + name);
  import_hf(without_mtp(name, "num_src_" + name), ck);
  return ck;
}

// The imported checkpoint in a float64 moecore model of its flags file (the checkpoint's f32
// values widened, every tensor of it loaded: the weights and the routers' expert bias), each
// reference sequence alone in eval mode, computes reference.json's logits and loss
// (transformers' float64 forward) within kHfF64LogitsRtol, and the transcription's to float64
// rounding (kF64Rtol: a finer check than transformers' float32 roundings leave room for).
void f64_against_transformers(const std::string& name) {
  const fs::path ck = imported_main_model(name);
  const cli::TrainFlags f = flags_of(ck, {"--seq-length", "8", "--micro-batch-size", "1"});
  model::GPTModel<double> model(f.model, 1, 0);
  ckpt::CheckpointReader r(ckpt::iteration_dir(ck, 0));
  auto read = [&](const std::string& n) {
    std::vector<float> v(static_cast<size_t>(r.tensor(n).numel()));
    r.read(n, "F32", -1, 0, 0, {reinterpret_cast<std::byte*>(v.data()), v.size() * 4});
    return v;
  };
  size_t loaded = 0;
  for (Param& p : model.params().params()) {
    const std::vector<float> v = read(p.name());
    ASSERT_EQ(static_cast<int64_t>(v.size()), p.local_numel()) << p.name();
    std::copy(v.begin(), v.end(), testing::host(p.data_as<double>()));
    ++loaded;
  }
  for (moe::Router<double>* rt : model.routers()) {
    std::string n = rt->weight().name();
    n = n.substr(0, n.size() - 7) + ".expert_bias";  // "<router>.weight"
    const std::vector<float> v = read(n);
    std::copy(v.begin(), v.end(), testing::host(rt->expert_bias()));
    ++loaded;
  }
  EXPECT_EQ(loaded, r.manifest().tensors.size());  // every tensor of the checkpoint
  model.set_training(false);
  const Transcription tr(fixture(name), config_of(name));
  const json ref = read_json(fixture(name) / "reference.json");
  const int64_t V = f.model.vocab_size;
  double worst = 0, worst_loss = 0, worst_tr = 0, worst_tr_loss = 0;
  for (const json& seq : ref["sequences"]) {
    const std::vector<int32_t> ids = seq["input_ids"].get<std::vector<int32_t>>();
    std::vector<double> got(ids.size() * V);
    model.forward_logits(ids.data(), got.data());
    std::vector<int32_t> targets(ids.begin() + 1, ids.end());
    targets.push_back(-1);
    const double loss = model.forward(ids.data(), targets.data());
    // transformers' float64 forward.
    const double d = rel_logits_diff(got, flat_logits(seq));
    EXPECT_LE(d, testing::kHfF64LogitsRtol) << name;
    const double want_loss = seq["loss"].get<double>();
    const double dl = std::abs(loss - want_loss) / want_loss;
    EXPECT_LE(dl, testing::kHfF64LogitsRtol) << name;
    // The transcription, in float64 throughout.
    const std::vector<double> want = tr.logits(ids);
    const double dt = rel_logits_diff(got, want);
    EXPECT_LE(dt, testing::kF64Rtol) << name;
    const double tr_loss = mean_next_token_ce(want, ids);
    const double dtl = std::abs(loss - tr_loss) / tr_loss;
    EXPECT_LE(dtl, testing::kF64Rtol) << name;
    worst = std::max(worst, d);
    worst_loss = std::max(worst_loss, dl);
    worst_tr = std::max(worst_tr, dt);
    worst_tr_loss = std::max(worst_tr_loss, dtl);
  }
  std::cout << "[hf parity f64] " << name << ": logits " << worst
            << " of the largest |logit| from transformers' float64, loss " << worst_loss
            << " relative; from the transcription: logits " << worst_tr << ", loss "
            << worst_tr_loss << "\n";
}

TEST(HfDeepseekV3, ImportedModelComputesTransformersLogitsInFloat64) {
  f64_against_transformers("deepseek_v3");
}
TEST(HfDeepseekV3, ImportedModelWithoutQLoraComputesTransformersLogitsInFloat64) {
  f64_against_transformers("deepseek_v3_no_q_lora");
}
TEST(HfDeepseekV3, ImportedFp8ModelComputesTransformersLogitsInFloat64) {
  f64_against_transformers("deepseek_v3_fp8");
}

// The trainer loads the imported checkpoint through its flags file alone (--finetune: the
// weights and the routers' expert bias by the names the import wrote; the checkpoint's routing
// signature is the flags file's), and its f32 forward computes reference.json's logits and
// losses (transformers' float64 forward) within the f32 row of docs/numerics.md.
TEST(HfDeepseekV3, TheTrainerLoadsTheImportAndComputesTransformersLogits) {
  for (const std::string name : {"deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(name);
    const fs::path ck = fresh_dir("trainer_ck_" + name);
    import_hf(without_mtp(name, "trainer_src_" + name), ck);
    const cli::TrainFlags f =
        flags_of(ck, {"--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr",
                      "1e-4", "--peak-tflops", "1", "--eval-iters", "0"});
    train::Trainer trainer(f.model, f.train);
    train::Trainer::LoadOptions lo;
    lo.finetune = true;
    ASSERT_EQ(trainer.load_checkpoint(ck, lo), 0);
    model::GPTModel<float>& model = trainer.model();
    model.set_training(false);
    const std::vector<float> bias = moecore_tensor(ck, "decoder.layers.1.mlp.router.expert_bias");
    const float* loaded = testing::host(model.routers()[0]->expert_bias());
    EXPECT_TRUE(std::equal(bias.begin(), bias.end(), loaded));
    const json ref = read_json(fixture(name) / "reference.json");
    double worst = 0, worst_loss = 0;
    for (const json& seq : ref["sequences"]) {
      const std::vector<int32_t> ids = seq["input_ids"].get<std::vector<int32_t>>();
      std::vector<float> got(ids.size() * f.model.vocab_size);
      model.forward_logits(ids.data(), got.data());
      const double d = rel_logits_diff({got.begin(), got.end()}, flat_logits(seq));
      EXPECT_LE(d, testing::kHfLogitsRtol);
      std::vector<int32_t> targets(ids.begin() + 1, ids.end());
      targets.push_back(-1);
      const double loss = model.forward(ids.data(), targets.data());
      const double want_loss = seq["loss"].get<double>();
      const double dl = std::abs(loss - want_loss) / want_loss;
      EXPECT_LE(dl, testing::kHfLogitsRtol);
      worst = std::max(worst, d);
      worst_loss = std::max(worst_loss, dl);
    }
    std::cout << "[hf parity f32] " << name << ": logits " << worst
              << " of the largest |logit| from transformers' float64, loss " << worst_loss
              << " relative\n";
  }
}

}  // namespace
}  // namespace moecore::convert
