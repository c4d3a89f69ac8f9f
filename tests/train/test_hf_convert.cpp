// `moecore convert` on the HuggingFace fixtures (tests/fixtures/hf/, docs/hf_interop.md): the
// imported checkpoint's tensors and flags file; import then export gives the source tensors back
// byte for byte; a tensor left over, a missing tensor, unsupported config keys, F16 / F8 weights
// and an untied head in a tied checkpoint are refused by name, and so is every export of a model
// HF's classes cannot express, writing nothing; and the imported model, trained-from by the
// trainer through its flags file, computes transformers' logits, losses and expert choices
// (tolerance: docs/numerics.md).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint_command.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors_file.h"
#include "ckpt/safetensors_writer.h"
#include "common/command.h"
#include "common/paths.h"
#include "common/testing.h"
#include "convert/hf_config.h"
#include "convert/hf_export.h"
#include "convert/hf_import.h"
#include "convert/hf_tensor_map.h"
#include "convert/hf_weights.h"
#include "convert/model_flags.h"
#include "convert/output_dir.h"
#include "core/fault_injection.h"
#include "train/checkpoint_state.h"
#include "cli/config_file.h"
#include "train/trainer.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::error_of;

fs::path fixture(const std::string& name) {
  return fs::path(::moecore::testing::source_dir()) / "tests" / "fixtures" / "hf" / name;
}

// <tmp>/moecore_hf_convert.<pid>.<name>: this process's own (no other run of the suite shares it).
fs::path scratch_path(const std::string& name) {
  return fs::temp_directory_path() /
         ("moecore_hf_convert." + std::to_string(::getpid()) + "." + name);
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = scratch_path(name);
  fs::remove_all(d);
  return d;
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(std::string{std::istreambuf_iterator<char>(in), {}});
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream(p) << j.dump(2) << "\n";
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A copy of fixture `name` to edit.
fs::path copy_fixture(const std::string& name, const std::string& as) {
  const fs::path d = fresh_dir(as);
  fs::copy(fixture(name), d, fs::copy_options::recursive);
  return d;
}

// Every HF tensor of a directory: name -> (dtype, shape, bytes).
struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};
std::map<std::string, Tensor> hf_tensors(const fs::path& dir) {
  std::map<std::string, Tensor> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    ckpt::SafetensorsFile f(e.path());
    for (const std::string& n : f.names()) {
      const auto b = f.bytes(n);
      out[n] = {f.info(n).dtype, f.info(n).shape, {b.begin(), b.end()}};
    }
  }
  return out;
}

// The f32 values of a moecore checkpoint's tensor.
std::vector<float> moecore_tensor(const fs::path& save, const std::string& name) {
  ckpt::CheckpointReader r(ckpt::iteration_dir(save, 0));
  const ckpt::GlobalTensor& g = r.tensor(name);
  int64_t n = 1;
  for (int64_t d : g.shape) n *= d;
  std::vector<float> v(n);
  r.read(name, "F32", -1, 0, 0, {reinterpret_cast<std::byte*>(v.data()), v.size() * 4});
  return v;
}

std::vector<float> hf_f32(const fs::path& dir, const std::string& name) {
  convert::HfWeights w(dir);
  return w.read_f32(name);
}

bool has_arg(const std::vector<std::string>& args, const std::string& flag,
             const std::string& value = "") {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] != flag) continue;
    if (value.empty()) return true;
    if (i + 1 < args.size() && args[i + 1] == value) return true;
  }
  return false;
}

// ---- (1) the imported checkpoint and its flags file ----

TEST(HfConvert, ImportsMixtralAsTheTrainerWritesIteration0) {
  const fs::path out = fresh_dir("import_mixtral");
  const convert::ImportResult r = convert::import_hf(fixture("mixtral"), out);
  EXPECT_EQ(r.spec.arch, convert::HfArch::Mixtral);
  EXPECT_EQ(r.hf_tensors, 41);  // 2 layers x (4 experts x 3 + router + 2 norms + 4 attention) + 3
  EXPECT_EQ(ckpt::read_tracker(out), 0);
  ckpt::CheckpointReader reader(ckpt::iteration_dir(out, 0));
  const ckpt::Manifest& m = reader.manifest();
  EXPECT_EQ(m.iteration, 0);
  EXPECT_EQ(m.world_size, 1);
  EXPECT_EQ(m.state["iteration"], 0);
  EXPECT_EQ(m.state["optimizer_steps"], 0);
  EXPECT_EQ(m.state["has_optimizer"], false);
  EXPECT_EQ(m.state["consumed_train_samples"], 0);
  EXPECT_EQ(m.state["consumed_valid_samples"], 0);
  EXPECT_EQ(m.state["hf"]["architecture"], "MixtralForCausalLM");
  ASSERT_EQ(m.files.size(), 1u);
  EXPECT_EQ(m.files[0].file, "model_rank_00000.safetensors");
  // H 32, 4 heads of D 8 over 2 KV groups, 4 experts of F 24, vocab 96 untied.
  const std::map<std::string, std::vector<int64_t>> shapes = {
      {"embedding.word_embeddings.weight", {96, 32}},
      {"decoder.layers.0.input_layernorm.weight", {32}},
      {"decoder.layers.0.self_attention.linear_qkv.weight", {(4 + 2 * 2) * 8, 32}},
      {"decoder.layers.0.self_attention.linear_proj.weight", {32, 32}},
      {"decoder.layers.0.pre_mlp_layernorm.weight", {32}},
      {"decoder.layers.0.mlp.router.weight", {4, 32}},
      {"decoder.layers.1.mlp.experts.linear_fc1.weight", {4, 48, 32}},
      {"decoder.layers.1.mlp.experts.linear_fc2.weight", {4, 32, 24}},
      {"decoder.final_layernorm.weight", {32}},
      {"output_layer.weight", {96, 32}}};
  EXPECT_EQ(m.tensors.size(), 2u * 7u + 3u);
  for (const auto& [name, shape] : shapes) {
    const ckpt::GlobalTensor* t = m.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype, "F32") << name;
  }

  // The flags file parses as `moecore train --config` does and gives the recorded model.
  const std::vector<std::string> args = cli::config_file_args(r.flags_file.string());
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--make-vocab-size-divisible-by", "1"},
           {"--vocab-size", "96"},
           {"--moe-layer-freq", "[1,1]"},
           {"--num-experts", "4"},
           {"--moe-router-topk", "2"},
           {"--moe-ffn-hidden-size", "24"},
           {"--num-query-groups", "2"},
           {"--kv-channels", "8"},
           {"--rotary-base", "1000000"},
           {"--norm-epsilon", "1e-05"},
           {"--untie-embeddings-and-output-weights", ""},
           {"--swiglu", ""},
           {"--disable-bias-linear", ""}}) {
    EXPECT_TRUE(has_arg(args, flag, value)) << flag << " " << value;
  }
  EXPECT_FALSE(has_arg(args, "--moe-router-pre-softmax"));  // Mixtral renormalises
  EXPECT_FALSE(has_arg(args, "--add-qkv-bias"));
  EXPECT_FALSE(has_arg(args, "--qk-layernorm"));
  const cli::TrainFlags f = convert::parse_model_flags(args);
  EXPECT_EQ(m.state["model"], train::model_signature(f.model));

  // The fused QKV by the doc's formula: row (g * (qpg + 2) + j) * D + d is query head g qpg + j
  // (j < qpg), the key head (j = qpg) or the value head (j = qpg + 1) of group g, row d.
  const std::vector<float> qkv =
      moecore_tensor(out, "decoder.layers.1.self_attention.linear_qkv.weight");
  const std::vector<float> q = hf_f32(fixture("mixtral"), "model.layers.1.self_attn.q_proj.weight");
  const std::vector<float> k = hf_f32(fixture("mixtral"), "model.layers.1.self_attn.k_proj.weight");
  const std::vector<float> v = hf_f32(fixture("mixtral"), "model.layers.1.self_attn.v_proj.weight");
  const int64_t H = 32, D = 8, qpg = 2;
  for (int64_t g = 0; g < 2; ++g) {
    for (int64_t j = 0; j < qpg + 2; ++j) {
      for (int64_t d = 0; d < D; ++d) {
        const float* row = qkv.data() + ((g * (qpg + 2) + j) * D + d) * H;
        const float* src = j < qpg    ? q.data() + ((g * qpg + j) * D + d) * H
                           : j == qpg ? k.data() + (g * D + d) * H
                                      : v.data() + (g * D + d) * H;
        EXPECT_EQ(std::memcmp(row, src, H * 4), 0)
            << "group " << g << " slot " << j << " row " << d;
      }
    }
  }
  // fc1[e] = [w1 (gate); w3 (up)], fc2[e] = w2.
  const std::vector<float> fc1 =
      moecore_tensor(out, "decoder.layers.0.mlp.experts.linear_fc1.weight");
  const std::vector<float> fc2 =
      moecore_tensor(out, "decoder.layers.0.mlp.experts.linear_fc2.weight");
  const std::string e2 = "model.layers.0.block_sparse_moe.experts.2.";
  const std::vector<float> w1 = hf_f32(fixture("mixtral"), e2 + "w1.weight");
  const std::vector<float> w3 = hf_f32(fixture("mixtral"), e2 + "w3.weight");
  const std::vector<float> w2 = hf_f32(fixture("mixtral"), e2 + "w2.weight");
  EXPECT_EQ(std::memcmp(fc1.data() + 2 * 48 * 32, w1.data(), 24 * 32 * 4), 0);
  EXPECT_EQ(std::memcmp(fc1.data() + 2 * 48 * 32 + 24 * 32, w3.data(), 24 * 32 * 4), 0);
  EXPECT_EQ(std::memcmp(fc2.data() + 2 * 32 * 24, w2.data(), 32 * 24 * 4), 0);
}

TEST(HfConvert, ImportsShardedBf16Qwen3MoeWidenedExactly) {
  const fs::path out = fresh_dir("import_qwen3");
  const convert::ImportResult r = convert::import_hf(fixture("qwen3_moe"), out);
  EXPECT_EQ(r.spec.arch, convert::HfArch::Qwen3Moe);
  EXPECT_EQ(r.spec.moe_layers, (std::vector<int>{1, 0, 1}));  // mlp_only_layers [1]
  ckpt::CheckpointReader reader(ckpt::iteration_dir(out, 0));
  const ckpt::Manifest& m = reader.manifest();
  // head_dim 16 (not 32 / 4): QKV rows (4 + 2 * 2) * 16.
  EXPECT_EQ(m.find("decoder.layers.0.self_attention.linear_qkv.weight")->shape,
            (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(m.find("decoder.layers.0.self_attention.q_layernorm.weight")->shape,
            (std::vector<int64_t>{16}));
  EXPECT_EQ(m.find("decoder.layers.0.self_attention.linear_proj.weight")->shape,
            (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(m.find("decoder.layers.1.mlp.linear_fc1.weight")->shape,
            (std::vector<int64_t>{96, 32}));  // dense [gate; up], F 48
  EXPECT_EQ(m.find("decoder.layers.2.mlp.experts.linear_fc1.weight")->shape,
            (std::vector<int64_t>{8, 32, 32}));
  EXPECT_EQ(m.find("decoder.layers.1.mlp.router.weight"), nullptr);
  EXPECT_EQ(m.find("decoder.layers.0.self_attention.linear_qkv.bias"), nullptr);
  const std::vector<std::string> args = cli::config_file_args(r.flags_file.string());
  EXPECT_TRUE(has_arg(args, "--moe-layer-freq", "[1,0,1]"));
  EXPECT_TRUE(has_arg(args, "--qk-layernorm"));
  EXPECT_TRUE(has_arg(args, "--kv-channels", "16"));
  EXPECT_TRUE(has_arg(args, "--ffn-hidden-size", "48"));
  EXPECT_TRUE(has_arg(args, "--moe-ffn-hidden-size", "16"));
  EXPECT_TRUE(has_arg(args, "--vocab-size", "112"));
  EXPECT_FALSE(has_arg(args, "--moe-router-pre-softmax"));  // norm_topk_prob: true
  // BF16 widened exactly: every value is a bf16 value, the same as the file's.
  const std::vector<float> emb = moecore_tensor(out, "embedding.word_embeddings.weight");
  const std::vector<float> src = hf_f32(fixture("qwen3_moe"), "model.embed_tokens.weight");
  EXPECT_EQ(emb, src);
  for (float x : emb) EXPECT_EQ(bf16_to_float(float_to_bf16(x)), x);
}

// The Qwen2-MoE fixture: a gated shared expert (S 24), tied embeddings, q/k/v biases,
// pre-softmax routing, MoE layers 1 and 3. The same model without its shared expert
// (shared_expert_intermediate_size 0, the zero-row tensors Qwen2MoeSparseMoeBlock still saves)
// imports too, and exports the empty shared expert and a zero gate again.
TEST(HfConvert, ImportsQwen2MoeWithItsGatedSharedExpert) {
  const fs::path q2 = fresh_dir("q2");
  const convert::ImportResult g = convert::import_hf(fixture("qwen2_moe"), q2);
  EXPECT_EQ(g.spec.shared_ffn_hidden, 24);
  const std::vector<std::string> gargs = cli::config_file_args(g.flags_file.string());
  EXPECT_TRUE(has_arg(gargs, "--moe-shared-expert-intermediate-size", "24"));
  EXPECT_TRUE(has_arg(gargs, "--moe-shared-expert-gate"));
  ckpt::CheckpointReader gr(ckpt::iteration_dir(q2, 0));
  EXPECT_EQ(gr.manifest().find("decoder.layers.1.mlp.shared_experts.gate_weight")->shape,
            (std::vector<int64_t>{1, 24}));
  EXPECT_EQ(gr.manifest().find("decoder.layers.3.mlp.shared_experts.linear_fc1.weight")->shape,
            (std::vector<int64_t>{48, 24}));
  EXPECT_EQ(gr.manifest().find("decoder.layers.2.mlp.shared_experts.gate_weight"), nullptr);

  const fs::path in = copy_fixture("qwen2_moe", "q2_noshared_in");
  json cfg = read_json(in / "config.json");
  cfg["shared_expert_intermediate_size"] = 0;
  write_json(in / "config.json", cfg);
  {  // the shared expert's tensors as transformers saves them for S = 0
    ckpt::SafetensorsFile f(in / "model.safetensors");
    ckpt::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const std::string& n : f.names()) {
      std::vector<int64_t> shape = f.info(n).shape;
      if (n.find(".shared_expert.") != std::string::npos) {
        shape[n.find("down_proj") != std::string::npos ? 1 : 0] = 0;
        w.add(n, "F32", shape, {});
      } else {
        w.add(n, f.info(n).dtype, shape, f.bytes(n));
      }
    }
    w.write(in / "model.safetensors");
  }
  const fs::path out = fresh_dir("q2_noshared");
  const convert::ImportResult r = convert::import_hf(in, out);
  EXPECT_TRUE(r.spec.tie_word_embeddings);
  EXPECT_TRUE(r.spec.qkv_bias);
  EXPECT_EQ(r.spec.moe_layers, (std::vector<int>{0, 1, 0, 1}));  // decoder_sparse_step 2
  const std::vector<std::string> args = cli::config_file_args(r.flags_file.string());
  EXPECT_TRUE(has_arg(args, "--moe-layer-freq", "[0,1,0,1]"));
  EXPECT_TRUE(has_arg(args, "--moe-router-pre-softmax"));  // norm_topk_prob: false
  EXPECT_TRUE(has_arg(args, "--add-qkv-bias"));
  EXPECT_FALSE(has_arg(args, "--untie-embeddings-and-output-weights"));
  EXPECT_FALSE(has_arg(args, "--moe-shared-expert-intermediate-size"));
  ckpt::CheckpointReader reader(ckpt::iteration_dir(out, 0));
  EXPECT_EQ(reader.manifest().find("output_layer.weight"), nullptr);
  EXPECT_EQ(reader.manifest().find("decoder.layers.1.self_attention.linear_qkv.bias")->shape,
            (std::vector<int64_t>{(4 + 2 * 2) * 6}));

  // And back: the same tensors, the empty shared expert and a zero gate written again.
  const fs::path back = fresh_dir("q2_noshared_back");
  convert::ExportOptions o;
  o.input = out;
  o.output = back;
  const convert::ExportResult x = convert::export_hf(o);
  EXPECT_EQ(x.spec.arch, convert::HfArch::Qwen2Moe);
  const auto a = hf_tensors(in), b = hf_tensors(back);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_EQ(b.at(name).shape, t.shape) << name;
    if (name.find("shared_expert_gate") == std::string::npos) {
      EXPECT_EQ(b.at(name).bytes, t.bytes) << name;
    }
  }
}

// ---- (2) import then export: the source tensors back, byte for byte ----

TEST(HfConvert, RoundTripIsBytewise) {
  struct Case {
    std::string name, dtype;
    uint64_t shard;
  };
  for (const Case& c : {Case{"mixtral", "F32", 0}, Case{"qwen2_moe", "F32", 0},
                        Case{"qwen3_moe", "BF16", 0}, Case{"qwen3_moe", "BF16", 40000}}) {
    SCOPED_TRACE(c.name + " " + c.dtype + " shard " + std::to_string(c.shard));
    const fs::path ck = fresh_dir("rt_" + c.name), hf = fresh_dir("rt_hf_" + c.name);
    convert::import_hf(fixture(c.name), ck);
    convert::ExportOptions o;
    o.input = ck;
    o.output = hf;
    o.dtype = c.dtype;
    o.max_shard_bytes = c.shard;
    const convert::ExportResult r = convert::export_hf(o);
    EXPECT_EQ(r.arch_from, "the import");
    const auto a = hf_tensors(fixture(c.name)), b = hf_tensors(hf);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, t] : a) {
      ASSERT_TRUE(b.count(name)) << name;
      EXPECT_EQ(b.at(name).dtype, t.dtype) << name;
      EXPECT_EQ(b.at(name).shape, t.shape) << name;
      EXPECT_TRUE(b.at(name).bytes == t.bytes) << name;
    }
    // The config describes the same model (and re-imports to the same flags).
    std::vector<std::string> warnings;
    EXPECT_EQ(convert::parse_hf_config(read_json(hf / "config.json"), "exported", &warnings),
              convert::parse_hf_config(read_json(fixture(c.name) / "config.json"), "source"));
    EXPECT_EQ(read_json(hf / "config.json")["initializer_range"], 0.02);  // carried over
    if (c.shard > 0) {
      EXPECT_TRUE(fs::exists(hf / "model.safetensors.index.json"));
      EXPECT_GT(r.files.size(), 3u);  // config, >= 2 shards, the index
      for (const auto& e : fs::directory_iterator(hf)) {
        if (e.path().extension() == ".safetensors") {
          EXPECT_LE(fs::file_size(e.path()), 40000u + 8000u) << e.path();  // + the header
        }
      }
    }
  }
  // The single F32 files: the whole file is the source's, header and order included.
  for (const std::string name : {"mixtral", "qwen2_moe"}) {
    const fs::path hf = scratch_path("rt_hf_" + name);
    EXPECT_EQ(read_text(hf / "model.safetensors"), read_text(fixture(name) / "model.safetensors"))
        << name;
  }
}

// Export reads each global tensor whole, whatever slices hold it: the imported Mixtral saved
// again as two ranks of expert parallelism (each expert tensor split along experts) exports to
// the same HF tensors.
TEST(HfConvert, ExportReadsAnyLayout) {
  const fs::path ck = fresh_dir("layout_ck"), ep2 = fresh_dir("layout_ep2");
  convert::import_hf(fixture("mixtral"), ck);
  ckpt::CheckpointReader r(ckpt::iteration_dir(ck, 0));
  const fs::path dir = ckpt::iteration_dir(ep2, 0);
  fs::create_directories(dir);
  ckpt::SafetensorsWriter shard[2];
  ckpt::Manifest m;
  m.world_size = 2;
  m.layout = {{"dp", 1}, {"ep", 2}, {"expt_dp", 1}};
  m.state = r.manifest().state;
  for (const ckpt::GlobalTensor& g : r.manifest().tensors) {
    std::vector<std::byte> b(static_cast<size_t>(convert::numel(g.shape)) * 4);
    r.read(g.name, "F32", -1, 0, 0, b);
    const bool expert = g.name.find(".experts.") != std::string::npos;
    ckpt::GlobalTensor t{g.name, "F32", g.shape, {}};
    if (!expert) {
      shard[0].add(g.name, "F32", g.shape, b);
      t.slices.push_back({ckpt::shard_name("model", 0)});
    } else {
      std::vector<int64_t> half = g.shape;
      half[0] /= 2;
      const size_t n = b.size() / 2;
      for (int k = 0; k < 2; ++k) {
        shard[k].add(g.name, "F32", half, {b.data() + k * n, n});
        t.slices.push_back({ckpt::shard_name("model", k), 0, k * half[0], half[0]});
      }
    }
    m.tensors.push_back(t);
  }
  for (int k = 0; k < 2; ++k)
    m.files.push_back(ckpt::write_shard(dir, ckpt::shard_name("model", k), k, shard[k]));
  ckpt::write_manifest(dir, m);
  ckpt::write_tracker(ep2, 0);
  convert::ExportOptions o;
  o.input = ep2;
  o.flags = ck / "moecore_flags.toml";
  o.output = fresh_dir("layout_hf");
  convert::export_hf(o);
  EXPECT_EQ(read_text(o.output / "model.safetensors"),
            read_text(fixture("mixtral") / "model.safetensors"));
}

// Through the command line, with the checkpoint trained on by `moecore train` in between
// (weights change; the exported tensors are then the trained ones).
TEST(HfConvert, CommandLineImportTrainExport) {
  const fs::path ck = fresh_dir("cli_ck"), hf = fresh_dir("cli_hf"), save = fresh_dir("cli_save");
  testing::CommandResult r = testing::run_moecore(
      "convert hf-to-moecore --input " + fixture("mixtral").string() + " --output " + ck.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("every tensor consumed"), std::string::npos) << r.output;
  // `moecore eval` scores the reference sequences with the flags file (each padded to 16
  // tokens): transformers' losses.
  const json ref = read_json(fixture("mixtral") / "reference.json");
  json tokens = json::array();
  for (const json& seq : ref["sequences"]) tokens.push_back(seq["input_ids"]);
  write_json(ck / "tokens.json", tokens);
  r = testing::run_moecore("eval --config " + (ck / "moecore_flags.toml").string() + " --load " +
                           ck.string() + " --seq-length 16 --micro-batch-size 1 --train-iters 1 " +
                           "--lr 0 --tokens-json " + (ck / "tokens.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (size_t i = 0; i < ref["sequences"].size(); ++i) {
    const std::string key = "sequence " + std::to_string(i) + ": 8 tokens | mean next-token loss ";
    const size_t at = r.output.find(key);
    ASSERT_NE(at, std::string::npos) << r.output;
    const double want = ref["sequences"][i]["loss"].get<double>();
    EXPECT_NEAR(std::stod(r.output.substr(at + key.size())), want, testing::kHfLogitsRtol * want);
  }
  r = testing::run_moecore("train --config " + (ck / "moecore_flags.toml").string() + " --load " +
                           ck.string() + " --finetune --save " + save.string() +
                           " --seq-length 8 --micro-batch-size 2 --train-iters 2 --lr 1e-3 "
                           "--log-interval 1 --eval-iters 0 --peak-tflops 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_moecore("convert moecore-to-hf --input " + save.string() + " --flags " +
                           (ck / "moecore_flags.toml").string() + " --output " + hf.string() +
                           " --arch mixtral");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto a = hf_tensors(fixture("mixtral")), b = hf_tensors(hf);
  ASSERT_EQ(a.size(), b.size());
  int changed = 0;
  for (const auto& [name, t] : a) changed += b.at(name).bytes != t.bytes;
  EXPECT_GT(changed, 30) << "training moved the weights";
  // Without --flags, a --save directory of `moecore train` has no moecore_flags.toml: the flags
  // the checkpoint records (--use-checkpoint-args) give the same files.
  const fs::path hf2 = fresh_dir("cli_hf2");
  r = testing::run_moecore("convert moecore-to-hf --input " + save.string() + " --output " +
                           hf2.string() + " --arch mixtral");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_text(hf2 / "model.safetensors"), read_text(hf / "model.safetensors"));
  EXPECT_EQ(read_json(hf2 / "config.json"), read_json(hf / "config.json"));
  // A checkpoint that records no flags needs --flags.
  const fs::path manifest = ckpt::resolve_checkpoint(save) / ckpt::kManifestFile;
  json m = read_json(manifest);
  m["state"].erase("args");
  std::ofstream(manifest) << m.dump();
  r = testing::run_moecore("convert moecore-to-hf --input " + save.string() + " --output " +
                           fresh_dir("cli_hf3").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("records no flags: give --flags FILE"), std::string::npos) << r.output;
}

// A model trained by `moecore train` from scratch (configs/tiny.toml: untied, softmax top-2,
// every layer MoE -> Mixtral by its features) with a padded vocabulary (256 padded to 300): the
// checkpoint holds the model's 256 rows, so export has no padding to drop, and the export
// imports back to the same weights.
TEST(HfConvert, ExportOfAPaddedTrainedModelHasNoPadding) {
  const fs::path save = fresh_dir("padded_save"), hf = fresh_dir("padded_hf");
  const fs::path flags = fresh_dir("padded_flags.toml");
  std::ofstream(flags) << read_text(fs::path(::moecore::testing::source_dir()) / "configs" /
                                    "tiny.toml")
                       << "\nmake-vocab-size-divisible-by = 100\n";
  testing::CommandResult r = testing::run_moecore(
      "train --config " + flags.string() + " --train-iters 2 --lr-warmup-iters 0 --save " +
      save.string() + " --peak-tflops 1 --eval-iters 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_moecore("convert moecore-to-hf --input " + save.string() + " --flags " +
                           flags.string() + " --output " + hf.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("MixtralForCausalLM, from the model's features"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("padding"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(hf / "config.json")["vocab_size"], 256);
  {
    ckpt::CheckpointReader trained(ckpt::resolve_checkpoint(save));
    for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"})
      EXPECT_EQ(trained.tensor(name).shape, (std::vector<int64_t>{256, 64})) << name;
  }
  // The padding is no part of the model: flags that pad otherwise (no padding at all) name the
  // same model, and export takes the tables' rows from the checkpoint: the same HF files.
  const fs::path unpadded = fresh_dir("unpadded_flags.toml"), hf1 = fresh_dir("padded_hf1");
  std::ofstream(unpadded) << read_text(fs::path(::moecore::testing::source_dir()) / "configs" /
                                       "tiny.toml")
                          << "\nmake-vocab-size-divisible-by = 1\n";
  r = testing::run_moecore("convert moecore-to-hf --input " + save.string() + " --flags " +
                           unpadded.string() + " --output " + hf1.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_text(hf1 / "model.safetensors"), read_text(hf / "model.safetensors"));
  EXPECT_EQ(read_json(hf1 / "config.json"), read_json(hf / "config.json"));
  const fs::path back = fresh_dir("padded_back");
  convert::import_hf(hf, back);
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight",
                           "decoder.layers.1.mlp.experts.linear_fc1.weight"}) {
    ckpt::CheckpointReader trained(ckpt::resolve_checkpoint(save));
    const ckpt::GlobalTensor& g = trained.tensor(name);
    std::vector<float> v(static_cast<size_t>(convert::numel(g.shape)));
    trained.read(name, "F32", -1, 0, 0, {reinterpret_cast<std::byte*>(v.data()), v.size() * 4});
    EXPECT_EQ(moecore_tensor(back, name), v) << name;
  }
}

// ---- (3) refusals, naming what is wrong ----

TEST(HfConvert, ATensorLeftOverIsRefusedByName) {
  const fs::path in = copy_fixture("mixtral", "left_in");
  {  // a fifth expert the config does not declare (num_local_experts: 4)
    ckpt::SafetensorsFile f(fixture("mixtral") / "model.safetensors");
    ckpt::SafetensorsWriter w;
    for (const std::string& n : f.names()) w.add(n, f.info(n).dtype, f.info(n).shape, f.bytes(n));
    const std::string e0 = "model.layers.1.block_sparse_moe.experts.0.w1.weight";
    w.add("model.layers.1.block_sparse_moe.experts.4.w1.weight", "F32", f.info(e0).shape,
          f.bytes(e0));
    w.write(in / "model.safetensors");
  }
  const fs::path out = fresh_dir("left_out");
  const std::string e = error_of([&] { convert::import_hf(in, out); });
  EXPECT_NE(e.find("1 tensor(s) of the checkpoint have no place"), std::string::npos) << e;
  EXPECT_NE(e.find("'model.layers.1.block_sparse_moe.experts.4.w1.weight'"), std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(out / "latest_checkpointed_iteration.txt"));
  EXPECT_FALSE(fs::exists(out / "moecore_flags.toml"));
}

TEST(HfConvert, AMissingTensorIsRefusedByName) {
  const fs::path in = copy_fixture("qwen3_moe", "missing_in");
  json index = read_json(in / "model.safetensors.index.json");
  const std::string gone = "model.layers.2.mlp.experts.5.up_proj.weight";
  const std::string file = index["weight_map"][gone];
  index["weight_map"].erase(gone);
  write_json(in / "model.safetensors.index.json", index);
  {
    ckpt::SafetensorsFile f(fixture("qwen3_moe") / file);
    ckpt::SafetensorsWriter w;
    for (const std::string& n : f.names()) {
      if (n != gone) w.add(n, f.info(n).dtype, f.info(n).shape, f.bytes(n));
    }
    w.write(in / file);
  }
  const std::string e = error_of([&] { convert::import_hf(in, fresh_dir("missing_out")); });
  EXPECT_NE(e.find("1 tensor(s) that config.json implies are missing"), std::string::npos) << e;
  EXPECT_NE(e.find("'" + gone + "'"), std::string::npos) << e;

  // An index that names a tensor its file does not hold.
  index["weight_map"][gone] = file;
  write_json(in / "model.safetensors.index.json", index);
  const std::string e2 = error_of([&] { convert::import_hf(in, fresh_dir("missing_out2")); });
  EXPECT_NE(e2.find("maps tensor '" + gone + "'"), std::string::npos) << e2;
}

TEST(HfConvert, AShapeThatDisagreesWithTheConfigIsRefused) {
  const fs::path in = copy_fixture("mixtral", "shape_in");
  json cfg = read_json(in / "config.json");
  cfg["intermediate_size"] = 20;
  write_json(in / "config.json", cfg);
  const std::string e = error_of([&] { convert::import_hf(in, fresh_dir("shape_out")); });
  EXPECT_NE(e.find("is [24, 32], config.json implies [20, 32]"), std::string::npos) << e;
}

TEST(HfConvert, UnsupportedConfigsAreRefusedNamingTheKeyAndValue) {
  struct Case {
    std::string fixture, key;
    json value;
    std::string expect;  // in the message, beside the key
  };
  const std::vector<Case> cases = {
      {"mixtral", "sliding_window", 4096, "4096"},
      {"mixtral", "hidden_act", "gelu", "\"gelu\""},
      {"mixtral", "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}, "rope_scaling"},
      {"mixtral", "rope_parameters", {{"rope_theta", 1e6}, {"rope_type", "yarn"}}, "\"yarn\""},
      {"mixtral", "num_experts_per_tok", 1, "top-1 with renormalised weights"},
      {"mixtral", "attention_dropout", 0.1, "0.1"},
      {"mixtral", "architectures", json::array({"LlamaForCausalLM"}), "LlamaForCausalLM"},
      {"mixtral", "model_type", "deepseek_v3", "deepseek_v3"},
      {"qwen3_moe", "use_sliding_window", true, "sliding-window"},
      {"qwen3_moe", "partial_rotary_factor", 0.5, "0.5"},
      {"qwen3_moe", "head_dim", 15, "15"},
      {"qwen3_moe", "num_key_value_heads", 3, "3"},
      {"qwen2_moe", "layer_types",
       json::array({"full_attention", "sliding_attention", "full_attention", "full_attention"}),
       "sliding_attention"},
      // Found by tests/fuzz/fuzz_hf_config: a float past int64 was cast (UB), 2^64 - 1 wrapped
      // to -1, and a billion layers sized per-layer tables.
      {"mixtral", "vocab_size", 1e300, "1e+300, not an integer"},
      {"qwen3_moe", "num_experts", json(uint64_t{18446744073709551615u}),
       "18446744073709551615, not an integer"},
      {"mixtral", "num_hidden_layers", 1000000000, "at most 65536 layers"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const fs::path in = copy_fixture(c.fixture, "cfg_in");
    json cfg = read_json(in / "config.json");
    cfg[c.key] = c.value;
    if (c.key == "architectures") cfg.erase("model_type");
    write_json(in / "config.json", cfg);
    const std::string e = error_of([&] { convert::import_hf(in, fresh_dir("cfg_out")); });
    EXPECT_NE(e.find("\"" + c.key), std::string::npos) << e;  // "key" or "key.subkey"
    EXPECT_NE(e.find(c.expect), std::string::npos) << e;
    EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  }
}

// The keys carried from the imported config.json when its model_type matches; one of another
// JSON kind (null, with "architectures" naming the class) is no match, not a json type_error.
TEST(HfConvert, ConfigCarriesKeysOnlyFromTheSameModelType) {
  const json cfg = read_json(fixture("mixtral") / "config.json");
  const convert::HfModelSpec s = convert::parse_hf_config(cfg, "config.json");
  json carry = cfg;
  carry["bos_token_id"] = 7;
  EXPECT_EQ(convert::hf_config_json(s, "float32", &carry)["bos_token_id"], 7);
  carry["model_type"] = nullptr;
  EXPECT_EQ(convert::parse_hf_config(carry, "config.json"), s);  // the class still says Mixtral
  EXPECT_FALSE(convert::hf_config_json(s, "float32", &carry).contains("bos_token_id"));
}

TEST(HfConvert, ExportRefusesWhatTheClassCannotExpress) {
  const fs::path ck = fresh_dir("export_refuse");
  convert::import_hf(fixture("qwen3_moe"), ck);
  convert::ExportOptions o;
  o.input = ck;
  o.output = fresh_dir("export_refuse_hf");
  o.arch = convert::HfArch::Mixtral;  // dense layer 1 and q/k norms
  std::string e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("cannot be written as MixtralForCausalLM: --moe-layer-freq has dense layers"),
            std::string::npos)
      << e;
  o.arch = convert::HfArch::Qwen2Moe;
  e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("--qk-layernorm"), std::string::npos) << e;
  // Another model's flags: the checkpoint's signature names the difference.
  o.arch.reset();
  o.flags = fresh_dir("other_flags.toml");
  std::string toml = read_text(ck / "moecore_flags.toml");
  toml.replace(toml.find("hidden-size = 32"), 16, "hidden-size = 64");
  std::ofstream(o.flags) << toml;
  e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("--hidden-size: 32 in the checkpoint, 64 in this run"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(o.output / "config.json"));
}

// An export that fails in the middle leaves --output as it was (absent, or the empty directory it
// was) and never a config.json without its weights: an error (a failed write) after config.json,
// after the first weights file, after the last, or before the rename removes the staging
// directory beside --output; a kill at the same points (a forked child) leaves only that staging
// directory, which the next export removes before it writes the whole checkpoint.
TEST(HfConvert, ExportFailingInTheMiddleLeavesNothingHalfWritten) {
  const fs::path ck = fresh_dir("export_fail");
  convert::import_hf(fixture("qwen3_moe"), ck);
  convert::ExportOptions o;
  o.input = ck;
  o.output = fresh_dir("export_fail_hf");
  o.max_shard_bytes = 40000;  // several weights files and their index
  const fs::path staging = convert::StagedOutput::staging_path(o.output);
  EXPECT_EQ(staging.parent_path(), fs::absolute(o.output).parent_path());
  for (const char* point : {"export.after_config", "export.after_shard", "export.after_weights",
                            "export.before_publish"}) {
    SCOPED_TRACE(point);
    fault::inject_for_test(std::string("convert_error:at=") + point);
    const std::string e = error_of([&] { convert::export_hf(o); });
    fault::inject_for_test("");
    EXPECT_NE(e.find(std::string("[convert] write failed at ") + point), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(o.output));
    EXPECT_FALSE(fs::exists(staging));

    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the exporting process that dies; _exit: no gtest teardown in the child
      fault::inject_for_test(std::string("kill:at=") + point);
      try {
        convert::export_hf(o);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    EXPECT_FALSE(fs::exists(o.output));
    EXPECT_TRUE(fs::exists(staging / "config.json"));
  }
  // The next export: the leftover removed, the whole checkpoint published into the empty
  // directory given as --output, the same files as an export that never failed.
  fs::create_directories(o.output);
  const convert::ExportResult r = convert::export_hf(o);
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_GT(r.files.size(), 3u);
  convert::ExportOptions clean = o;
  clean.output = fresh_dir("export_fail_clean_hf");
  EXPECT_EQ(convert::export_hf(clean).files, r.files);
  for (const std::string& f : r.files) {
    EXPECT_EQ(read_text(o.output / f), read_text(clean.output / f)) << f;
  }
  // A directory holding other files cannot be replaced whole: refused before any work.
  const fs::path busy = fresh_dir("export_fail_busy_hf");
  fs::create_directories(busy);
  std::ofstream(busy / "notes.txt") << "mine\n";
  o.output = busy;
  const std::string e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("is a directory that is not empty ('notes.txt')"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(convert::StagedOutput::staging_path(busy)));
  for (const fs::path& d : {ck, clean.output, busy, scratch_path("export_fail_hf")})
    fs::remove_all(d);
}

// The Mixtral fixture's model as moecore trains it (its imported moecore_flags.toml) with
// `edits` applied to that file (key -> TOML value, replacing the key's line or added), after
// `steps` steps of the trainer (synthetic data) from its initial weights, saved into
// fresh_dir(name) with the edited flags file beside as moecore_flags.toml: a checkpoint of a
// model HF's classes may not express, for the export refusals.
fs::path mixtral_model(const std::string& name,
                       const std::vector<std::pair<std::string, std::string>>& edits,
                       int steps = 0) {
  const fs::path base = fresh_dir(name + "_base");
  convert::import_hf(fixture("mixtral"), base);
  std::string toml = read_text(base / "moecore_flags.toml");
  for (const auto& [key, value] : edits) {
    const std::string line = key + " = " + value + "\n";
    const size_t at = toml.find("\n" + key + " = ");
    if (at == std::string::npos) {
      toml += line;
    } else {
      toml.replace(at + 1, toml.find('\n', at + 1) - at, line);
    }
  }
  const fs::path save = fresh_dir(name);
  fs::create_directories(save);
  std::ofstream(save / "moecore_flags.toml") << toml;
  std::vector<std::string> args = cli::config_file_args((save / "moecore_flags.toml").string());
  for (const char* a : {"--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "2",
                        "--lr", "1e-3", "--peak-tflops", "1", "--eval-iters", "0"})
    args.push_back(a);
  const cli::TrainFlags f = cli::parse_train_args(args);
  train::Trainer trainer(f.model, f.train);
  for (int i = 0; i < steps; ++i) trainer.train_step();
  trainer.save_checkpoint(save);
  fs::remove_all(base);
  return save;
}

// Exporting `save` stops with `expect` in a "[convert]" message and writes nothing.
void expect_export_refused(const fs::path& save, std::optional<convert::HfArch> arch,
                           const std::string& expect, const fs::path& flags = {}) {
  convert::ExportOptions o;
  o.input = save;
  o.output = save;
  o.output += "_hf";  // beside the checkpoint: each test's own
  fs::remove_all(o.output);
  o.arch = arch;
  o.flags = flags;
  const std::string e = error_of([&] { convert::export_hf(o); });
  EXPECT_EQ(e.rfind("[convert] ", 0), 0u) << e;
  EXPECT_NE(e.find(expect), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(o.output)) << "the refused export wrote " << o.output;
}

// Exporting `save` with the model flags `flags` stops because the checkpoint's model signature
// differs from theirs, naming `expect` (the flag and both values), and writes nothing.
void expect_export_names_difference(const fs::path& save, const fs::path& flags,
                                    const std::string& expect) {
  convert::ExportOptions o;
  o.input = save;
  o.output = save;
  o.output += "_hf";
  fs::remove_all(o.output);
  o.flags = flags;
  const std::string e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("holds another model:"), std::string::npos) << e;
  EXPECT_NE(e.find(expect), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(o.output)) << "the refused export wrote " << o.output;
}

// Every refusal of docs/hf_interop.md section 7, each alone on the Mixtral fixture's model:
// the router settings none of HF's classes computes, whatever the class, and the features a
// class has no place for, with the class to export as instead.
TEST(HfConvert, ExportRefusesEachSettingHfCannotExpress) {
  struct Case {
    std::string name;
    std::vector<std::pair<std::string, std::string>> edits;
    std::optional<convert::HfArch> arch;
    std::string expect;
  };
  using convert::HfArch;
  const std::string as_mixtral = "cannot be written as MixtralForCausalLM: ";
  const std::string as_qwen2 = "cannot be written as Qwen2MoeForCausalLM: ";
  const std::string as_qwen3 = "cannot be written as Qwen3MoeForCausalLM: ";
  const std::vector<Case> cases = {
      {"sigmoid",
       {{"moe-router-score-function", "'sigmoid'"}},
       {},
       as_mixtral + "--moe-router-score-function sigmoid (HF's routers are softmax)"},
      {"sqrtsoftplus",
       {{"moe-router-score-function", "'sqrtsoftplus'"}},
       HfArch::Qwen2Moe,
       as_qwen2 + "--moe-router-score-function sqrtsoftplus (HF's routers are softmax)"},
      {"group_limited",
       {{"moe-router-num-groups", "2"}, {"moe-router-group-topk", "1"}},
       {},
       as_mixtral + "group-limited routing (--moe-router-num-groups 2 --moe-router-group-topk 1)"},
      {"scaling_factor",
       {{"moe-router-topk-scaling-factor", "2.5"}},
       {},
       as_mixtral + "--moe-router-topk-scaling-factor 2.5 (HF scales by 1)"},
      {"capacity_factor",
       {{"moe-expert-capacity-factor", "1.5"}},
       HfArch::Qwen2Moe,
       as_qwen2 + "--moe-expert-capacity-factor 1.5 (HF's MoE blocks drop no token)"},
      {"mixtral_dense_layer",
       {{"moe-layer-freq", "'[1,0]'"}},
       HfArch::Mixtral,
       as_mixtral + "--moe-layer-freq has dense layers ([1,0]); every Mixtral layer is MoE "
                    "(export with --arch qwen2_moe or qwen3_moe)"},
      {"mixtral_shared_expert",
       {{"moe-shared-expert-intermediate-size", "16"}, {"moe-shared-expert-gate", "true"}},
       HfArch::Mixtral,
       as_mixtral + "a shared expert (--moe-shared-expert-intermediate-size 16): only Qwen2-MoE "
                    "has one (export with --arch qwen2_moe)"},
      {"mixtral_qkv_bias",
       {{"add-qkv-bias", "true"}},
       HfArch::Mixtral,
       as_mixtral + "--add-qkv-bias: Mixtral has no attention biases (export with --arch "
                    "qwen2_moe)"},
      {"mixtral_qk_norm",
       {{"qk-layernorm", "true"}},
       HfArch::Mixtral,
       as_mixtral + "--qk-layernorm: Mixtral has no q/k norms (export with --arch qwen3_moe)"},
      {"mixtral_pre_softmax",
       {{"moe-router-pre-softmax", "true"}},
       HfArch::Mixtral,
       as_mixtral + "--moe-router-pre-softmax: Mixtral always renormalises the top-k weights "
                    "(export with --arch qwen2_moe or qwen3_moe"},
      {"qwen2_qk_norm",
       {{"qk-layernorm", "true"}},
       HfArch::Qwen2Moe,
       as_qwen2 + "--qk-layernorm: Qwen2-MoE has no q/k norms (export with --arch qwen3_moe)"},
      {"qwen2_ungated_shared_expert",
       {{"moe-shared-expert-intermediate-size", "16"}},
       {},  // a shared expert: Qwen2-MoE by the model's features
       as_qwen2 + "a shared expert without --moe-shared-expert-gate: Qwen2-MoE always gates it"},
      {"qwen3_no_qk_norm",
       {},
       HfArch::Qwen3Moe,
       as_qwen3 + "no --qk-layernorm: Qwen3-MoE always has q/k norms (weights of ones are not "
                  "the identity; export with --arch mixtral or qwen2_moe)"},
      {"qwen3_qkv_bias_alone",
       {{"qk-layernorm", "true"}, {"add-qkv-bias", "true"}},
       {},  // q/k norms: Qwen3-MoE by the model's features
       as_qwen3 + "--add-qkv-bias without --add-attention-output-bias or the reverse"},
      {"qwen3_output_bias_alone",
       {{"qk-layernorm", "true"}, {"add-attention-output-bias", "true"}},
       {},
       as_qwen3 + "--add-qkv-bias without --add-attention-output-bias or the reverse"},
      {"qwen3_shared_expert",
       {{"qk-layernorm", "true"},
        {"moe-shared-expert-intermediate-size", "16"},
        {"moe-shared-expert-gate", "true"}},
       {},
       as_qwen3 + "a shared expert (--moe-shared-expert-intermediate-size 16): only Qwen2-MoE "
                  "has one (export with --arch qwen2_moe)"},
      {"qwen2_output_bias",
       {{"add-qkv-bias", "true"}, {"add-attention-output-bias", "true"}},
       HfArch::Qwen2Moe,
       as_qwen2 + "--add-attention-output-bias: only Qwen3-MoE (attention_bias) has an o_proj "
                  "bias (export with --arch qwen3_moe)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path save = mixtral_model("refuse_" + c.name, c.edits);
    expect_export_refused(save, c.arch, c.expect);
    fs::remove_all(save);
  }
  // Multi-token prediction: only DeepSeek-V3 stores MTP layers (a Mixtral model trained with a
  // depth; its checkpoint signature records it, so the flags are the training run's).
  const fs::path save = mixtral_model("refuse_mtp_save", {{"mtp-num-layers", "1"}});
  convert::ExportOptions o;
  o.input = save;
  o.output = fresh_dir("refuse_mtp_hf");
  const std::string e = error_of([&] { convert::export_hf(o); });
  EXPECT_NE(e.find("1 multi-token prediction depth(s) (--mtp-num-layers): only DeepSeek-V3 stores "
                   "MTP layers"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(o.output));
  fs::remove_all(save);
}

// The checkpoint's model signature records the routing (what the routers compute with the same
// weights): a checkpoint trained with sigmoid scores, another top-k, or quantile balancing,
// exported or loaded under flags that say otherwise, stops naming the flag and both values. The
// loss-only settings are not part of it: a run may resume with another aux-loss type.
TEST(HfConvert, ExportNamesARoutingThatDiffersFromTheCheckpoints) {
  const fs::path base = fresh_dir("routing_base");
  convert::import_hf(fixture("mixtral"), base);
  const fs::path softmax = fresh_dir("routing_softmax.toml");  // the import's flags: softmax, K 2
  fs::copy_file(base / "moecore_flags.toml", softmax);
  const auto edited = [&](const std::string& name, const std::string& key,
                          const std::string& value) {
    const fs::path p = fresh_dir(name);
    std::string toml = read_text(softmax);
    const std::string line = key + " = " + value + "\n";
    const size_t at = toml.find("\n" + key + " = ");
    if (at == std::string::npos) {
      toml += line;
    } else {
      toml.replace(at + 1, toml.find('\n', at + 1) - at, line);
    }
    std::ofstream(p) << toml;
    return p;
  };

  const fs::path sigmoid = mixtral_model("routing_sigmoid", {{"moe-router-score-function",
                                                              "'sigmoid'"}});
  expect_export_names_difference(sigmoid, softmax,
                                 "--moe-router-score-function: \"sigmoid\" in the checkpoint, "
                                 "\"softmax\" in this run");
  // The trainer's load compares the same signature.
  const auto trainer_of = [](const fs::path& flags) {
    std::vector<std::string> args = cli::config_file_args(flags.string());
    for (const char* a : {"--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "2",
                          "--lr", "1e-3", "--peak-tflops", "1", "--eval-iters", "0"})
      args.push_back(a);
    const cli::TrainFlags f = cli::parse_train_args(args);
    return std::make_unique<train::Trainer>(f.model, f.train);
  };
  std::string e = error_of([&] { trainer_of(softmax)->load_checkpoint(sigmoid); });
  EXPECT_NE(e.find("--moe-router-score-function: \"sigmoid\" in the checkpoint, \"softmax\" in "
                   "this run"),
            std::string::npos)
      << e;

  const fs::path top3 = edited("routing_top3.toml", "moe-router-topk", "3");
  expect_export_names_difference(base, top3, "--moe-router-topk: 2 in the checkpoint, 3 in this run");
  const fs::path quantile = mixtral_model(
      "routing_quantile", {{"moe-router-load-balancing-type", "'quantile_balancing'"}});
  expect_export_names_difference(quantile, softmax,
                                 "--moe-router-load-balancing-type (how experts are chosen): "
                                 "\"quantile_balancing\" in the checkpoint, \"top-k of the scores");
  const fs::path scaled = edited("routing_scaled.toml", "moe-router-topk-scaling-factor", "2.5");
  expect_export_names_difference(
      base, scaled, "--moe-router-topk-scaling-factor: 1.0 in the checkpoint, 2.5 in this run");
  // Another aux-loss type routes the same: the load goes through.
  const fs::path seq_aux =
      edited("routing_seq_aux.toml", "moe-router-load-balancing-type", "'seq_aux_loss'");
  train::Trainer::LoadOptions finetune;
  finetune.finetune = true;  // an import holds no optimizer state
  EXPECT_EQ(trainer_of(seq_aux)->load_checkpoint(base, finetune), std::optional<int64_t>(0));
  for (const fs::path& p : {base, softmax, sigmoid, top3, quantile, scaled, seq_aux})
    fs::remove_all(p);
}

// The routers' balancing state, which HF's routers have no place for: a non-zero expert bias
// (trained with sigmoid scores) or quantile beta stops the export naming the tensor and its
// value; the same quantile-balanced model before its first step (beta still 0) exports. Exported
// with flags that name neither sigmoid nor the expert bias, the checkpoint's model signature
// names the difference first; a checkpoint written before the signature recorded the routing
// (its router keys removed here) still meets the tensor's check.
TEST(HfConvert, ExportRefusesANonZeroExpertBiasOrQuantileBeta) {
  const fs::path bias = mixtral_model("refuse_expert_bias",
                                      {{"moe-router-score-function", "'sigmoid'"},
                                       {"moe-router-enable-expert-bias", "true"},
                                       {"moe-router-bias-update-rate", "0.01"}},
                                      /*steps=*/1);
  const fs::path softmax = fresh_dir("refuse_expert_bias_softmax.toml");
  {
    std::string toml = read_text(bias / "moecore_flags.toml");
    toml = toml.substr(0, toml.find("moe-router-enable-expert-bias"));
    toml.replace(toml.find("'sigmoid'"), 9, "'softmax'");
    std::ofstream(softmax) << toml;
  }
  expect_export_names_difference(
      bias, softmax,
      "--moe-router-score-function: \"sigmoid\" in the checkpoint, \"softmax\" in this run");
  expect_export_names_difference(
      bias, softmax, "--moe-router-enable-expert-bias: true in the checkpoint, false in this run");
  {
    const fs::path manifest = ckpt::iteration_dir(bias, 1) / ckpt::kManifestFile;
    json m = read_json(manifest);
    json& model = m["state"]["model"];
    for (auto it = model.begin(); it != model.end();) {
      it = it.key().rfind("--moe-router-", 0) == 0 ? model.erase(it) : std::next(it);
    }
    write_json(manifest, m);
  }
  expect_export_refused(bias, {}, "'decoder.layers.0.mlp.router.expert_bias' is not zero (",
                        softmax);
  expect_export_refused(bias, {}, "HF's routers select by the plain scores", softmax);
  // With its own flags, the score function is refused first.
  expect_export_refused(bias, {}, "--moe-router-score-function sigmoid");

  const std::vector<std::pair<std::string, std::string>> quantile = {
      {"moe-router-load-balancing-type", "'quantile_balancing'"}};
  const fs::path beta = mixtral_model("refuse_quantile_beta", quantile, /*steps=*/1);
  expect_export_refused(beta, {}, "'decoder.layers.0.mlp.router.quantile_beta' is not zero (");
  // Through the command line: a non-zero exit, the message, nothing written.
  const fs::path out = fresh_dir("refuse_quantile_beta_cli");
  const testing::CommandResult r = testing::run_moecore(
      "convert moecore-to-hf --input " + beta.string() + " --output " + out.string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[convert] '"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("quantile_beta' is not zero ("), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));

  const fs::path fresh = mixtral_model("quantile_beta_zero", quantile, /*steps=*/0);
  convert::ExportOptions o;
  o.input = fresh;
  o.output = fresh_dir("quantile_beta_zero_hf");
  EXPECT_EQ(error_of([&] { convert::export_hf(o); }), "");
  EXPECT_TRUE(fs::exists(o.output / "model.safetensors"));
  for (const fs::path& d : {bias, softmax, beta, fresh, o.output}) fs::remove_all(d);
}

// Weights in a dtype the importer does not take (F16, F8): refused naming the file, the tensor,
// its dtype and the fix, before anything is written; the same through the command line.
TEST(HfConvert, ImportRefusesF16AndF8Weights) {
  const std::string victim = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  for (const std::string dtype : {"F16", "F8_E4M3"}) {
    SCOPED_TRACE(dtype);
    const fs::path in = copy_fixture("mixtral", "dtype_in");
    {
      ckpt::SafetensorsFile f(fixture("mixtral") / "model.safetensors");
      ckpt::SafetensorsWriter w;
      w.set_metadata("format", "pt");
      for (const std::string& n : f.names()) {
        if (n != victim) {
          w.add(n, f.info(n).dtype, f.info(n).shape, f.bytes(n));
          continue;
        }
        const size_t size = dtype == "F16" ? 2 : 1;
        const std::vector<std::byte> bytes(
            static_cast<size_t>(convert::numel(f.info(n).shape)) * size, std::byte{0x3c});
        w.add(n, dtype, f.info(n).shape, bytes);
      }
      w.write(in / "model.safetensors");
    }
    const fs::path out = fresh_dir("dtype_out");
    const std::string e = error_of([&] { convert::import_hf(in, out); });
    EXPECT_NE(e.find("[convert] '" + (in / "model.safetensors").string() + "': tensor '" + victim +
                     "' is " + dtype +
                     ": moecore imports F32 and BF16 weights only; "
                     "save the model as float32 or bfloat16 first"),
              std::string::npos)
        << e;
    EXPECT_FALSE(fs::exists(out)) << "the refused import wrote " << out;
    const testing::CommandResult r = testing::run_moecore(
        "convert hf-to-moecore --input " + in.string() + " --output " + out.string());
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("' is " + dtype + ": moecore imports F32 and BF16"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(out));
    fs::remove_all(in);
  }
}

// A tied checkpoint (the Qwen2-MoE fixture) whose lm_head.weight is not the embedding: refused
// with the fix; one equal to the embedding imports (and is not a tensor of the moecore model).
TEST(HfConvert, ImportRefusesATiedHeadThatDiffersFromTheEmbedding) {
  for (const bool equal : {true, false}) {
    SCOPED_TRACE(equal ? "lm_head == embedding" : "one value apart");
    const fs::path in = copy_fixture("qwen2_moe", "tied_in");
    {
      ckpt::SafetensorsFile f(fixture("qwen2_moe") / "model.safetensors");
      ckpt::SafetensorsWriter w;
      w.set_metadata("format", "pt");
      for (const std::string& n : f.names()) w.add(n, f.info(n).dtype, f.info(n).shape, f.bytes(n));
      const std::string emb = "model.embed_tokens.weight";
      std::vector<float> head = hf_f32(fixture("qwen2_moe"), emb);
      if (!equal) head[100] += 1.0f;
      w.add("lm_head.weight", "F32", f.info(emb).shape, convert::f32_as("F32", head));
      w.write(in / "model.safetensors");
    }
    const fs::path out = fresh_dir("tied_out");
    const std::string e = error_of([&] { convert::import_hf(in, out); });
    fs::remove_all(in);
    if (equal) {
      EXPECT_EQ(e, "");
      fs::remove_all(out);
      continue;
    }
    EXPECT_NE(e.find("[convert] '" + in.string() +
                     "': tie_word_embeddings is true but "
                     "'lm_head.weight' differs from 'model.embed_tokens.weight': the checkpoint "
                     "is not tied (set tie_word_embeddings false) or is corrupt"),
              std::string::npos)
        << e;
    EXPECT_FALSE(fs::exists(out)) << "the refused import wrote " << out;
  }
}

// ---- (4) the numbers: transformers' logits, losses and expert choices ----

// The imported checkpoint loaded by the trainer (its flags file, --finetune), each reference
// sequence alone (micro-batch 1, --seq-length 8, eval mode): logits within docs/numerics.md's
// "HF import vs transformers" row, the same experts chosen with the same weights, and the mean
// next-token loss.
void check_against_transformers(const std::string& name) {
  const fs::path ck = fresh_dir("numbers_" + name);
  convert::import_hf(fixture(name), ck);
  std::vector<std::string> args = cli::config_file_args((ck / "moecore_flags.toml").string());
  for (const char* a : {"--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1",
                        "--lr", "1e-4", "--peak-tflops", "1", "--eval-iters", "0"})
    args.push_back(a);
  const cli::TrainFlags f = cli::parse_train_args(args);
  train::Trainer trainer(f.model, f.train);
  train::Trainer::LoadOptions lo;
  lo.finetune = true;
  ASSERT_EQ(trainer.load_checkpoint(ck, lo), 0);
  model::GPTModel<float>& model = trainer.model();
  model.set_training(false);

  const json ref = read_json(fixture(name) / "reference.json");
  const int64_t V = f.model.vocab_size, K = f.model.moe.router.topk;
  double worst = 0, worst_rel = 0, worst_weight = 0, worst_loss = 0;
  for (const json& seq : ref["sequences"]) {
    const std::vector<int32_t> ids = seq["input_ids"].get<std::vector<int32_t>>();
    const int64_t S = static_cast<int64_t>(ids.size());
    ASSERT_EQ(S, 8);
    std::vector<float> logits(S * V);
    model.forward_logits(ids.data(), logits.data());
    double scale = 0;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t v = 0; v < V; ++v) {
        const double want = seq["logits"][s][v].get<double>();
        scale = std::max(scale, std::abs(want));
        worst = std::max(worst, std::abs(logits[s * V + v] - want));
      }
    }
    worst_rel = std::max(worst_rel, worst / scale);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t v = 0; v < V; ++v) {
        const double want = seq["logits"][s][v].get<double>();
        EXPECT_NEAR(logits[s * V + v], want, testing::kHfLogitsRtol * scale)
            << name << " position " << s << " token " << v;
      }
    }
    // The routing of every MoE layer: transformers' experts in descending weight, its weights.
    const auto routers = model.routers();
    ASSERT_EQ(routers.size(), seq["routing"].size());
    for (size_t l = 0; l < routers.size(); ++l) {
      const json& r = seq["routing"][l];
      const int32_t* idx = testing::host(routers[l]->saved().idx_TK);
      const float* probs = testing::host(routers[l]->saved().probs_TK);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t k = 0; k < K; ++k) {
          EXPECT_EQ(idx[s * K + k], r["experts"][s][k].get<int32_t>())
              << name << " layer " << r["layer"] << " position " << s << " slot " << k;
          const double w = r["weights"][s][k].get<double>();
          worst_weight = std::max(worst_weight, std::abs(probs[s * K + k] - w));
          EXPECT_NEAR(probs[s * K + k], w, testing::kHfLogitsRtol)
              << name << " layer " << r["layer"] << " position " << s << " slot " << k;
        }
      }
    }
    // The loss: positions 0..6 predicting ids 1..7.
    std::vector<int32_t> targets(ids.begin() + 1, ids.end());
    targets.push_back(-1);
    const double loss = model.forward(ids.data(), targets.data());
    const double want = seq["loss"].get<double>();
    worst_loss = std::max(worst_loss, std::abs(loss - want) / want);
    EXPECT_NEAR(loss, want, testing::kHfLogitsRtol * want) << name;
  }
  std::cout << "[hf parity] " << name << ": max |logits - transformers| = " << worst << " ("
            << worst_rel << " of the largest logit), routing weights " << worst_weight << ", loss "
            << worst_loss << " relative\n";
}

TEST(HfConvert, MixtralMatchesTransformers) {
  check_against_transformers("mixtral");
}
TEST(HfConvert, Qwen2MoeMatchesTransformers) {
  check_against_transformers("qwen2_moe");
}
TEST(HfConvert, Qwen3MoeMatchesTransformers) {
  check_against_transformers("qwen3_moe");
}

// Qwen3-MoE's attention_bias: q, k, v and o_proj biases (--add-qkv-bias
// --add-attention-output-bias), here on the fixture with random biases added: imported and
// exported back byte for byte.
TEST(HfConvert, Qwen3MoeAttentionBiasRoundTrip) {
  const fs::path in = copy_fixture("qwen3_moe", "q3_bias_in");
  json cfg = read_json(in / "config.json");
  cfg["attention_bias"] = true;
  write_json(in / "config.json", cfg);
  json index = read_json(in / "model.safetensors.index.json");
  const std::string file = "model-00003-of-00003.safetensors";
  {
    ckpt::SafetensorsFile f(fixture("qwen3_moe") / file);
    ckpt::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const std::string& n : f.names()) w.add(n, f.info(n).dtype, f.info(n).shape, f.bytes(n));
    uint32_t seed = 1;
    for (int l = 0; l < 3; ++l) {
      for (const auto& [proj, rows] : std::vector<std::pair<std::string, int64_t>>{
               {"q_proj", 64}, {"k_proj", 32}, {"v_proj", 32}, {"o_proj", 32}}) {
        const std::vector<float> v = testing::random_vec<float>(rows, seed++);
        const std::string n = "model.layers." + std::to_string(l) + ".self_attn." + proj + ".bias";
        w.add(n, "BF16", {rows}, convert::f32_as("BF16", v));
        index["weight_map"][n] = file;
      }
    }
    w.write(in / file);
  }
  write_json(in / "model.safetensors.index.json", index);
  const fs::path ck = fresh_dir("q3_bias_ck");
  const convert::ImportResult r = convert::import_hf(in, ck);
  const std::vector<std::string> args = cli::config_file_args(r.flags_file.string());
  EXPECT_TRUE(has_arg(args, "--add-qkv-bias"));
  EXPECT_TRUE(has_arg(args, "--add-attention-output-bias"));
  convert::ExportOptions o;
  o.input = ck;
  o.output = fresh_dir("q3_bias_hf");
  o.dtype = "BF16";
  convert::export_hf(o);
  const auto a = hf_tensors(in), b = hf_tensors(o.output);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(b.at(name).bytes == t.bytes) << name;
  }
  EXPECT_EQ(read_json(o.output / "config.json")["attention_bias"], true);
}

// ---- (5) GPT-2: LayerNorm with bias, learned positions, gelu_new, Conv1D weights ----

// config.json -> the spec and the flags of Megatron's default GPT.
TEST(HfConvert, Gpt2ConfigReadsAsLayerNormLearnedPositionsAndGeluNew) {
  const convert::HfModelSpec s =
      convert::parse_hf_config(read_json(fixture("gpt2") / "config.json"), "gpt2");
  EXPECT_EQ(s.arch, convert::HfArch::Gpt2);
  EXPECT_EQ(s.vocab_size, 88);
  EXPECT_EQ(s.hidden, 32);
  EXPECT_EQ(s.num_layers, 2);
  EXPECT_EQ(s.num_heads, 4);
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.head_dim, 8);
  EXPECT_EQ(s.ffn_hidden, 128);  // n_inner null: 4 n_embd
  EXPECT_EQ(s.max_position_embeddings, 32);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_TRUE(s.layernorm && s.learned_positions && s.mlp_bias && s.qkv_bias &&
              s.attention_output_bias && s.tie_word_embeddings);
  EXPECT_EQ(s.activation, ops::Activation::GeLUTanh);
  EXPECT_EQ(s.num_experts, 0);
  std::vector<std::string> args;
  for (const convert::TrainFlag& f : convert::train_flags_of(s)) {
    args.push_back("--" + f.name);
    std::visit(
        [&](const auto& v) {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, std::string>) {
            args.push_back(v);
          } else if constexpr (!std::is_same_v<V, bool>) {
            args.push_back(fmt::format("{}", v));
          }
        },
        f.value);
  }
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--normalization", "LayerNorm"},
           {"--position-embedding-type", "learned_absolute"},
           {"--openai-gelu", ""},
           {"--ffn-hidden-size", "128"},
           {"--max-position-embeddings", "32"},
           {"--vocab-size", "88"},
           {"--make-vocab-size-divisible-by", "1"},
           {"--attention-dropout", "0"},
           {"--hidden-dropout", "0"}}) {
    EXPECT_TRUE(has_arg(args, flag, value)) << flag << " " << value;
  }
  for (const char* absent : {"--swiglu", "--disable-bias-linear", "--rotary-base",
                             "--untie-embeddings-and-output-weights", "--num-experts"})
    EXPECT_FALSE(has_arg(args, absent)) << absent;
  // gelu is the exact GeLU: Megatron's default, no flag.
  json cfg = read_json(fixture("gpt2") / "config.json");
  cfg["activation_function"] = "gelu";
  const convert::HfModelSpec exact = convert::parse_hf_config(cfg, "gelu");
  EXPECT_EQ(exact.activation, ops::Activation::GeLU);
  for (const convert::TrainFlag& f : convert::train_flags_of(exact))
    EXPECT_NE(f.name, "openai-gelu");
}

// The table on the fixture's own tensors: c_attn's Conv1D weight [H, 3H] transposed and its
// [q | k | v] columns fused per head into linear_qkv's rows (head g: q, k, v, D rows each), the
// MLP's Conv1D weights transposed, LayerNorm biases and the position table copied; every tensor
// of the file used once; and the way back gives every tensor byte for byte.
TEST(HfConvert, Gpt2TableTransposesConv1DAndFusesCAttnPerHead) {
  const convert::HfModelSpec s =
      convert::parse_hf_config(read_json(fixture("gpt2") / "config.json"), "gpt2");
  const convert::HfTensorMap map = convert::hf_tensor_map(s);
  convert::HfWeights w(fixture("gpt2"));
  std::map<std::string, std::vector<float>> m;
  for (const convert::TensorMapping& t : map.tensors) {
    std::vector<std::vector<float>> parts;
    for (const convert::HfTensor& h : t.hf) {
      ASSERT_TRUE(w.has(h.name)) << h.name;
      EXPECT_EQ(w.info(h.name).shape, h.shape) << h.name;
      parts.push_back(w.read_f32(h.name));
    }
    m[t.moecore] = convert::to_moecore(t, parts);
    EXPECT_EQ(static_cast<int64_t>(m[t.moecore].size()), convert::numel(t.shape)) << t.moecore;
  }
  EXPECT_EQ(w.unread(), std::vector<std::string>{});  // lm_head: tied, absent from the file
  ASSERT_TRUE(map.tied_head.has_value());
  EXPECT_EQ(map.embedding, "transformer.wte.weight");
  EXPECT_EQ(map.tensors.size(), 2u + 2u * 12u + 2u);

  const int64_t H = 32, D = 8, F = 128, heads = 4;
  auto hf = [&](const std::string& n) { return hf_f32(fixture("gpt2"), n); };
  const std::vector<float> c_attn = hf("transformer.h.1.attn.c_attn.weight");  // [H, 3H]
  const std::vector<float> c_attn_b = hf("transformer.h.1.attn.c_attn.bias");  // [3H]
  const std::vector<float>& qkv = m.at("decoder.layers.1.self_attention.linear_qkv.weight");
  const std::vector<float>& qkv_b = m.at("decoder.layers.1.self_attention.linear_qkv.bias");
  ASSERT_EQ(qkv.size(), static_cast<size_t>(3 * H * H));
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t part = 0; part < 3; ++part) {  // q, k, v
      for (int64_t d = 0; d < D; ++d) {
        const int64_t row = (g * 3 + part) * D + d, col = part * H + g * D + d;
        EXPECT_EQ(qkv_b[row], c_attn_b[col]) << "head " << g << " part " << part << " d " << d;
        for (int64_t i = 0; i < H; ++i) {
          ASSERT_EQ(qkv[row * H + i], c_attn[i * 3 * H + col])
              << "head " << g << " part " << part << " d " << d << " input " << i;
        }
      }
    }
  }
  // fc1 [F, H] = c_fc^T ([H, F] stored); fc2 [H, F] = c_proj^T ([F, H] stored).
  const std::vector<float> c_fc = hf("transformer.h.0.mlp.c_fc.weight");
  const std::vector<float> c_proj = hf("transformer.h.0.mlp.c_proj.weight");
  const std::vector<float>& fc1 = m.at("decoder.layers.0.mlp.linear_fc1.weight");
  const std::vector<float>& fc2 = m.at("decoder.layers.0.mlp.linear_fc2.weight");
  for (int64_t f : {int64_t{0}, int64_t{5}, F - 1}) {
    for (int64_t h : {int64_t{0}, int64_t{7}, H - 1}) {
      EXPECT_EQ(fc1[f * H + h], c_fc[h * F + f]) << f << " " << h;
      EXPECT_EQ(fc2[h * F + f], c_proj[f * H + h]) << f << " " << h;
    }
  }
  EXPECT_EQ(m.at("decoder.layers.0.mlp.linear_fc1.bias"), hf("transformer.h.0.mlp.c_fc.bias"));
  EXPECT_EQ(m.at("decoder.layers.1.pre_mlp_layernorm.bias"), hf("transformer.h.1.ln_2.bias"));
  EXPECT_EQ(m.at("decoder.final_layernorm.bias"), hf("transformer.ln_f.bias"));
  EXPECT_EQ(m.at("embedding.position_embeddings.weight"), hf("transformer.wpe.weight"));

  // Back: every HF tensor's bytes.
  const auto src = hf_tensors(fixture("gpt2"));
  for (const convert::TensorMapping& t : map.tensors) {
    const std::vector<std::vector<float>> back = convert::to_hf(t, m.at(t.moecore));
    for (size_t i = 0; i < t.hf.size(); ++i) {
      const std::vector<std::byte> b = convert::f32_as("F32", back[i]);
      EXPECT_TRUE(b == src.at(t.hf[i].name).bytes) << t.hf[i].name;
    }
  }
}

// What GPT-2's config can say that moecore cannot compute: refused naming the key and value.
TEST(HfConvert, Gpt2RefusesWhatMoecoreCannotCompute) {
  const json base = read_json(fixture("gpt2") / "config.json");
  for (const auto& [key, value, why] : std::vector<std::tuple<std::string, json, std::string>>{
           {"activation_function", "relu",
            "gelu_new and gelu_pytorch_tanh (the tanh form, --openai-gelu) and gelu"},
           {"scale_attn_by_inverse_layer_idx", true, "1/(layer + 1)"},
           {"reorder_and_upcast_attn", true, "reorder_and_upcast_attn"},
           {"scale_attn_weights", false, "always scales"},
           {"add_cross_attention", true, "cross-attention"},
           {"n_head", 5, "must divide n_embd 32"}}) {
    json cfg = base;
    cfg[key] = value;
    const std::string e = error_of([&] { convert::parse_hf_config(cfg, "cfg.json"); });
    EXPECT_NE(e.find("[convert] 'cfg.json': \"" + key + "\": " + value.dump()), std::string::npos)
        << key << ": " << e;
    EXPECT_NE(e.find(why), std::string::npos) << key << ": " << e;
  }
  json cfg = base;
  cfg["architectures"] = json::array({"GPT2Model"});
  EXPECT_NE(error_of([&] { convert::parse_hf_config(cfg, "cfg.json"); }).find("GPT2LMHeadModel"),
            std::string::npos);
}

// Export of a GPT-2 model's config: the keys transformers reads back as the same model.
TEST(HfConvert, Gpt2ConfigJsonReadsBackAsTheSameModel) {
  const json src = read_json(fixture("gpt2") / "config.json");
  const convert::HfModelSpec s = convert::parse_hf_config(src, "gpt2");
  const json out = convert::hf_config_json(s, "float32", &src);
  EXPECT_EQ(convert::parse_hf_config(out, "exported"), s);
  EXPECT_EQ(out["architectures"], json::array({"GPT2LMHeadModel"}));
  EXPECT_EQ(out["activation_function"], "gelu_new");
  EXPECT_EQ(out["n_inner"], 128);
  EXPECT_EQ(out["layer_norm_epsilon"], 1e-5);
  EXPECT_EQ(out["summary_type"], "cls_index");  // carried over
  EXPECT_FALSE(out.contains("rms_norm_eps"));
  EXPECT_FALSE(out.contains("rope_parameters"));
}

// Import then export through moecore's model (needs the model's LayerNorm, learned positions,
// GeLU MLP and biases, and their flags): the checkpoint holds Megatron's names and shapes, and
// the export gives the fixture's file back byte for byte.
TEST(HfConvert, Gpt2ImportExportRoundTripIsBytewise) {
  const fs::path ck = fresh_dir("gpt2_ck"), out = fresh_dir("gpt2_hf");
  const convert::ImportResult r = convert::import_hf(fixture("gpt2"), ck);
  EXPECT_EQ(r.spec.arch, convert::HfArch::Gpt2);
  EXPECT_EQ(r.hf_tensors, 28);
  ckpt::CheckpointReader reader(ckpt::iteration_dir(ck, 0));
  const ckpt::Manifest& man = reader.manifest();
  for (const auto& [name, shape] : std::map<std::string, std::vector<int64_t>>{
           {"embedding.word_embeddings.weight", {88, 32}},
           {"embedding.position_embeddings.weight", {32, 32}},
           {"decoder.layers.0.input_layernorm.bias", {32}},
           {"decoder.layers.0.self_attention.linear_qkv.weight", {96, 32}},
           {"decoder.layers.0.self_attention.linear_qkv.bias", {96}},
           {"decoder.layers.0.self_attention.linear_proj.bias", {32}},
           {"decoder.layers.1.mlp.linear_fc1.weight", {128, 32}},
           {"decoder.layers.1.mlp.linear_fc1.bias", {128}},
           {"decoder.layers.1.mlp.linear_fc2.weight", {32, 128}},
           {"decoder.final_layernorm.bias", {32}}}) {
    const ckpt::GlobalTensor* t = man.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
  }
  EXPECT_EQ(man.find("output_layer.weight"), nullptr);  // tied
  const cli::TrainFlags f =
      convert::parse_model_flags(cli::config_file_args(r.flags_file.string()));
  EXPECT_EQ(f.model.normalization, Normalization::LayerNorm);
  EXPECT_EQ(f.model.position_embedding, PositionEmbedding::LearnedAbsolute);
  EXPECT_EQ(f.model.activation, ops::Activation::GeLUTanh);
  EXPECT_TRUE(f.model.add_mlp_bias && f.model.add_qkv_bias && f.model.add_attention_output_bias);

  convert::ExportOptions o;
  o.input = ck;
  o.output = out;
  const convert::ExportResult x = convert::export_hf(o);
  EXPECT_EQ(x.spec.arch, convert::HfArch::Gpt2);
  EXPECT_EQ(read_text(out / "model.safetensors"), read_text(fixture("gpt2") / "model.safetensors"));
  EXPECT_EQ(convert::parse_hf_config(read_json(out / "config.json"), "exported"),
            convert::parse_hf_config(read_json(fixture("gpt2") / "config.json"), "source"));
}

TEST(HfConvert, Gpt2MatchesTransformers) {
  check_against_transformers("gpt2");
}

// GPT-2 as its checkpoints are published (tests/fixtures/hf/gpt2_published, made by
// tools/make_hf_fixtures.py): GPT2Model's keys without the "transformer." prefix, every layer's
// attn.bias (the causal mask) and attn.masked_bias buffers, and activation_function
// gelu_pytorch_tanh. Imported as transformers loads it, the model computes transformers' logits,
// expert-free, and losses within docs/numerics.md's HF row.
TEST(HfConvert, Gpt2AsPublishedMatchesTransformers) {
  check_against_transformers("gpt2_published");
}

// The published layout's import: the prefix added (said so), the buffers consumed, the weights
// those of the file; its export writes save_pretrained's layout (with the prefix, without the
// buffers) and keeps the imported activation's spelling. A mask that is not causal, or of
// another shape, is refused naming the tensor.
TEST(HfConvert, Gpt2AsPublishedImportsAndExports) {
  const fs::path src = fixture("gpt2_published");
  const fs::path ck = fresh_dir("gpt2_published_ck"), out = fresh_dir("gpt2_published_hf");
  const convert::ImportResult r = convert::import_hf(src, ck);
  EXPECT_EQ(r.spec.arch, convert::HfArch::Gpt2);
  EXPECT_EQ(r.spec.activation, ops::Activation::GeLUTanh);
  ASSERT_FALSE(r.warnings.empty());
  EXPECT_NE(r.warnings[0].find("no \"transformer.\" prefix"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.hf_tensors, 28 + 2 * 2);  // the weights and each layer's two buffers
  convert::ExportOptions o;
  o.input = ck;
  o.output = out;
  convert::export_hf(o);
  EXPECT_EQ(read_json(out / "config.json")["activation_function"], "gelu_pytorch_tanh");
  std::map<std::string, Tensor> want;
  for (auto& [name, t] : hf_tensors(src)) {
    if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) continue;
    want["transformer." + name] = t;
  }
  const std::map<std::string, Tensor> got = hf_tensors(out);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
  }

  // The fixture with layer 1's mask edited: one position seeing its future, or another shape.
  const auto with_mask = [&](const std::string& as, auto edit) {
    const fs::path d = copy_fixture("gpt2_published", as);
    std::map<std::string, Tensor> tensors = hf_tensors(src);
    edit(tensors.at("h.1.attn.bias"));
    ckpt::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const auto& [name, t] : tensors) w.add(name, t.dtype, t.shape, t.bytes);
    w.write(d / "model.safetensors");
    return d;
  };
  const fs::path future = with_mask("gpt2_mask_future", [](Tensor& t) {
    const float one = 1.0f;
    std::memcpy(t.bytes.data() + 4 * (2 * 16 + 5), &one, 4);  // position 2 sees position 5
  });
  std::string e = error_of([&] { convert::import_hf(future, fresh_dir("gpt2_mask_future_ck")); });
  EXPECT_NE(e.find("'transformer.h.1.attn.bias' is not the causal mask (position 2 sees position "
                   "5)"),
            std::string::npos)
      << e;
  const fs::path shape = with_mask("gpt2_mask_shape", [](Tensor& t) {
    t.shape = {1, 16, 16};
  });
  e = error_of([&] { convert::import_hf(shape, fresh_dir("gpt2_mask_shape_ck")); });
  EXPECT_NE(e.find("'transformer.h.1.attn.bias' is [1, 16, 16]"), std::string::npos) << e;
  for (const fs::path& d : {ck, out, future, shape, scratch_path("gpt2_mask_future_ck"),
                            scratch_path("gpt2_mask_shape_ck")})
    fs::remove_all(d);
}

// HF's three families have SwiGLU MLPs without biases: a model with another activation or with
// MLP biases is refused before anything is written, naming what and the flag that would fit.
TEST(HfConvert, ExportRefusesOtherActivationsAndMlpBiases) {
  ModelConfig m;
  m.num_experts = 4;
  m.moe.router.num_experts = 4;
  m.moe.ffn_hidden = 8;
  EXPECT_NO_THROW(convert::hf_spec_of_model(m, convert::HfArch::Mixtral));
  ModelConfig gelu = m;
  gelu.activation = ops::Activation::GeLU;
  std::string e = error_of([&] { convert::hf_spec_of_model(gelu, convert::HfArch::Mixtral); });
  EXPECT_NE(e.find("cannot be written as MixtralForCausalLM: the gelu MLP: its MLPs are SwiGLU "
                   "(--swiglu)"),
            std::string::npos)
      << e;
  ModelConfig biased = m;
  biased.add_mlp_bias = true;
  e = error_of([&] { convert::hf_spec_of_model(biased, convert::HfArch::Qwen2Moe); });
  EXPECT_NE(e.find("cannot be written as Qwen2MoeForCausalLM: MLP biases: its MLPs have none "
                   "(--disable-bias-linear)"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace moecore
