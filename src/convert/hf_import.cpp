#include "convert/hf_import.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>

#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "convert/hf_config_reader.h"
#include "convert/hf_deepseek_v3.h"
#include "convert/hf_tensor_map.h"
#include "convert/hf_weights.h"
#include "convert/model_flags.h"
#include "convert/output_dir.h"
#include "core/check.h"
#include "core/host_memory.h"
#include "model/gpt_model.h"
#include "train/checkpoint_state.h"
#include "cli/config_file.h"

namespace moecore::convert {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The moecore model's parameters as a checkpoint holds them (train::checkpoint_shape), from the
// model itself (its planning pass only: nothing is allocated), so "every parameter filled" is
// checked against what the trainer will load. With them the routers' expert bias, which a
// checkpoint holds beside each router's weight as "<router>.expert_bias" (F32 [E], the trainer's
// state_tensors) and the trainer loads with the weights: DeepSeek-V3's e_score_correction_bias.
std::vector<std::pair<std::string, std::vector<int64_t>>> model_parameters(const ModelConfig& m) {
  model::GPTModel<float> sized(m, 1, 0, nullptr, /*size_only=*/true);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const Param& p : sized.params().params()) out.emplace_back(p.name(), train::checkpoint_shape(p.spec));
  for (const moe::Router<float>* r : sized.routers()) {
    if (!r->config().enable_expert_bias) continue;
    std::string name = r->weight().name();
    const std::string suffix = ".weight";
    if (name.ends_with(suffix)) name.resize(name.size() - suffix.size());
    out.emplace_back(name + ".expert_bias", std::vector<int64_t>{r->config().num_experts});
  }
  return out;
}

// Parameters of the model config.json describes, in floating point (a config.json with a huge
// size must not overflow int64 before it is refused).
double approx_parameters(const HfModelSpec& s) {
  const double H = static_cast<double>(s.hidden), V = static_cast<double>(s.vocab_size);
  double attn = 2 * static_cast<double>(s.num_heads + 2 * s.num_kv_heads) *
                static_cast<double>(s.head_dim) * H;
  if (s.deepseek) {
    const DeepseekV3Spec& d = *s.deepseek;
    const double Hq = static_cast<double>(d.num_heads), kl = static_cast<double>(d.kv_lora_rank);
    const double dq = static_cast<double>(d.qk_nope_head_dim + d.qk_rope_head_dim);
    const double q =
        d.q_lora_rank ? static_cast<double>(*d.q_lora_rank) * (H + Hq * dq) : Hq * dq * H;
    attn = q + (kl + static_cast<double>(d.qk_rope_head_dim)) * H +
           Hq * static_cast<double>(d.qk_nope_head_dim + d.v_head_dim) * kl +
           H * Hq * static_cast<double>(d.v_head_dim);
  }
  const double mlp =
      3 * static_cast<double>(s.ffn_hidden) +
      3 * static_cast<double>(s.num_experts) * static_cast<double>(s.moe_ffn_hidden) +
      3 * static_cast<double>(s.shared_ffn_hidden);
  const double layers = static_cast<double>(s.num_layers) +
                        (s.deepseek ? static_cast<double>(s.deepseek->mtp_layers) : 0.0);
  return 2 * V * H + static_cast<double>(s.max_position_embeddings) * H + layers * (attn + H * mlp);
}

// Whether element i of a tensor of `dtype` stored in `b` is non-zero (the mask's dtypes: BOOL,
// U8, F32, BF16, F16; -0.0 is zero).
bool nonzero(std::span<const std::byte> b, const std::string& dtype, size_t i) {
  if (dtype == "BOOL" || dtype == "U8") return b[i] != std::byte{0};
  if (dtype == "F32") {
    uint32_t v;
    std::memcpy(&v, b.data() + 4 * i, 4);
    return (v & 0x7fffffffu) != 0;
  }
  uint16_t v;  // BF16, F16
  std::memcpy(&v, b.data() + 2 * i, 2);
  return (v & 0x7fffu) != 0;
}

// GPT-2's per-layer buffers, which checkpoints saved by older transformers hold beside the
// weights (published GPT-2 among them): attn.bias, the causal mask [1, 1, n_positions,
// n_positions] (ones on and below the diagonal), and attn.masked_bias, the scalar older
// transformers filled masked scores with. Neither is a weight: transformers ignores both today
// (it builds the causal mask itself); moecore's attention is causal. The mask is checked to be
// the causal one (a model trained with another mask computes something else); masked_bias is
// dropped, as transformers drops it.
void consume_gpt2_buffers(HfWeights& w, const HfModelSpec& s, const fs::path& dir) {
  const int64_t P = s.max_position_embeddings;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string mask = fmt::format("transformer.h.{}.attn.bias", l);
    if (w.has(mask)) {
      const ckpt::TensorInfo& t = w.info(mask);
      MOE_CHECK(t.shape == std::vector<int64_t>({1, 1, P, P}),
                "[convert] '{}': '{}' is {}: GPT-2's causal mask is [1, 1, {}, {}] (n_positions)",
                dir.string(), mask, ckpt::format_shape(t.shape), P, P);
      MOE_CHECK(t.dtype == "BOOL" || t.dtype == "U8" || t.dtype == "F32" || t.dtype == "BF16" ||
                    t.dtype == "F16",
                "[convert] '{}': '{}' is {}: GPT-2's causal mask is stored as BOOL, U8 or a float",
                dir.string(), mask, t.dtype);
      const std::span<const std::byte> b = w.read_bytes(mask);
      for (int64_t i = 0; i < P; ++i) {
        for (int64_t j = 0; j < P; ++j) {
          MOE_CHECK(nonzero(b, t.dtype, static_cast<size_t>(i * P + j)) == (j <= i),
                    "[convert] '{}': '{}' is not the causal mask (position {} {} position {}): "
                    "moecore's attention is causal, and so is transformers' (which ignores this "
                    "buffer)",
                    dir.string(), mask, i, j <= i ? "does not see" : "sees", j);
        }
      }
    }
    const std::string masked = fmt::format("transformer.h.{}.attn.masked_bias", l);
    if (w.has(masked)) (void)w.read_bytes(masked);
  }
}

}  // namespace

ImportResult import_hf(const fs::path& hf_dir, const fs::path& out_dir) {
  ImportResult res;
  check_output_dir(out_dir, "a moecore checkpoint");

  // The model: config.json -> HF's view -> moecore's flags -> the ModelConfig the trainer builds
  // from exactly that flags file.
  const fs::path config_path = hf_dir / "config.json";
  const json config = read_hf_config_file(config_path);
  res.spec = parse_hf_config(config, config_path.string(), &res.warnings);
  // The weights' headers (each file validated), before the flags: what the checkpoint holds can
  // decide them (DeepSeek-V3's MTP layers).
  HfWeights w(hf_dir);
  if (res.spec.deepseek) {
    DeepseekV3Spec& d = *res.spec.deepseek;
    if (d.fp8_block) w.set_fp8_block_size(*d.fp8_block);
    // transformers neither builds nor saves the MTP layers (save_pretrained drops
    // model.layers.{L}.*) but keeps num_nextn_predict_layers in config.json: such a checkpoint
    // is the main model alone, imported without MTP layers (a run may add new ones with
    // --mtp-num-layers). Some but not all MTP tensors: the table names the missing ones.
    const std::string mtp = fmt::format("model.layers.{}.", d.num_layers);
    const bool any = std::any_of(w.names().begin(), w.names().end(),
                                 [&](const std::string& n) { return n.starts_with(mtp); });
    if (d.mtp_layers > 0 && !any) {
      res.warnings.push_back(fmt::format(
          "[convert] '{}': config.json has num_nextn_predict_layers {} but the weights hold no "
          "'{}*' tensor (transformers' save_pretrained drops the multi-token-prediction layers): "
          "the main model is imported without them (no --mtp-num-layers)",
          hf_dir.string(), d.mtp_layers, mtp));
      d.mtp_layers = 0;
    }
  }
  const HfModelSpec& s = res.spec;
  // The parameters in floating point before the model is sized in int64: a config.json with a
  // huge size stops here, naming the sizes and the bytes.
  {
    const double params = approx_parameters(s);
    const double memory = static_cast<double>(host_memory_bytes());
    MOE_CHECK(params * 4 <= memory,
              "[convert] '{}': the model has about {:.3g} parameters ({} in F32: hidden_size {}, "
              "{} layers, vocab_size {}, intermediate sizes {} / {} x {} experts), more than this "
              "machine's {} of memory",
              config_path.string(), params, format_bytes(params * 4), s.hidden,
              s.num_layers, s.vocab_size, s.ffn_hidden, s.moe_ffn_hidden, s.num_experts,
              format_bytes(memory));
  }
  res.flags_file = out_dir / kFlagsFile;
  const std::string toml = flags_toml(
      train_flags_of(s),
      fmt::format("The moecore train flags of the {} in {}, written by `moecore convert "
                  "hf-to-moecore`.\nTrain it with: moecore train --config {} --load {} "
                  "--finetune\n  --seq-length N --micro-batch-size N --train-iters N --lr LR "
                  "(and the data flags)",
                  hf_arch_class(s.arch), fs::absolute(hf_dir).lexically_normal().string(),
                  fs::absolute(res.flags_file).lexically_normal().string(),
                  fs::absolute(out_dir).lexically_normal().string()));
  const std::vector<std::string> flag_args = cli::config_text_args(toml, res.flags_file.string());
  const ModelConfig m = parse_model_flags(flag_args).model;

  // The table, checked against the model's own parameter list both ways.
  const HfTensorMap map = hf_tensor_map(s);
  std::map<std::string, const TensorMapping*> by_name;
  for (const TensorMapping& t : map.tensors) by_name[t.moecore] = &t;
  const std::map<std::string, const TensorMapping*> table = by_name;
  const auto params = model_parameters(m);
  std::vector<std::string> unfilled;
  for (const auto& [name, shape] : params) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      unfilled.push_back(name);
      continue;
    }
    MOE_CHECK(it->second->shape == shape,
              "[convert] moecore parameter '{}' is {} in the model, {} in the HF table", name,
              ckpt::format_shape(shape), ckpt::format_shape(it->second->shape));
    by_name.erase(it);
  }
  MOE_CHECK(unfilled.empty(),
            "[convert] {} parameter(s) of the moecore model would not be filled from the HF "
            "checkpoint: {}",
            unfilled.size(), name_list(unfilled));
  std::vector<std::string> extra;
  for (const auto& [name, t] : by_name)
    extra.push_back(fmt::format("{}' -> '{}", t->hf.at(0).name, name));
  MOE_CHECK(extra.empty(),
            "[convert] '{}': {} tensor(s) of the checkpoint have no place in the moecore model its "
            "flags build: {}. Nothing was written",
            hf_dir.string(), extra.size(), name_list(extra));

  // The weights: every tensor the table names present with its shape, before any is read.
  // GPT-2 as it is published (openai-community/gpt2): GPT2Model's weights, without the
  // "transformer." prefix, which transformers adds when it loads them into GPT2LMHeadModel.
  if (s.arch == HfArch::Gpt2 && w.add_missing_prefix("transformer")) {
    res.warnings.push_back(fmt::format(
        "[convert] '{}': the tensors have no \"transformer.\" prefix (GPT2Model's weights, as "
        "GPT-2 is published): read with it, as transformers loads them",
        hf_dir.string()));
  }
  std::vector<std::string> missing;
  for (const HfTensorMap::Copy& c : map.copies) {
    if (!w.has(c.tensor.name)) missing.push_back(c.tensor.name);
  }
  for (const TensorMapping& t : map.tensors) {
    for (const HfTensor& h : t.hf) {
      if (!w.has(h.name)) {
        missing.push_back(h.name);
        continue;
      }
      const ckpt::TensorInfo& info = w.info(h.name);
      MOE_CHECK(info.shape == h.shape,
                "[convert] '{}': tensor '{}' is {}, config.json implies {} (for moecore's "
                "'{}')",
                hf_dir.string(), h.name, ckpt::format_shape(info.shape),
                ckpt::format_shape(h.shape), t.moecore);
    }
  }
  MOE_CHECK(missing.empty(),
            "[convert] '{}': {} tensor(s) that config.json implies are missing: "
            "{}",
            hf_dir.string(), missing.size(), name_list(missing));

  // The shard is built in memory and written whole: its bytes, then a copy as it is serialized
  // (SafetensorsWriter), and the largest tensor's HF parts and conversion beside them.
  double total = 0, largest = 0;
  for (const auto& [name, shape] : params) {
    double n = 4;
    for (int64_t d : shape) n *= static_cast<double>(d);
    total += n;
    largest = std::max(largest, n);
  }
  const double need = 2 * total + 2 * largest;
  const double memory = static_cast<double>(host_memory_bytes());
  MOE_CHECK(need <= memory,
            "[convert] '{}': the moecore checkpoint of {} parameters is {} in F32, and the "
            "converter holds it in memory twice while writing its shard ({} with the largest "
            "tensor's parts), more than this machine's {} of memory",
            hf_dir.string(), static_cast<int64_t>(total / 4), format_bytes(total),
            format_bytes(need), format_bytes(memory));

  // Converted in the model's parameter order, which is the order the trainer writes.
  ckpt::SafetensorsWriter shard;
  const std::string file = ckpt::shard_name("model", 0);
  ckpt::Manifest man;
  for (const auto& [name, shape] : params) {
    const TensorMapping& t = *table.at(name);
    std::vector<std::vector<float>> parts;
    for (const HfTensor& h : t.hf) parts.push_back(w.read_f32(h.name));
    const std::vector<float> v = to_moecore(t, parts);
    shard.add(name, "F32", shape,
              {reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)});
    man.tensors.push_back({name, "F32", shape, {ckpt::SliceRef{file}}});
    res.parameters += static_cast<int64_t>(v.size());
  }
  res.moecore_tensors = static_cast<int64_t>(params.size());
  // Qwen2-MoE without a shared expert: its empty shared-expert tensors and gate, dropped.
  for (const HfTensor& h : map.empty_shared_expert) {
    if (!w.has(h.name)) continue;
    MOE_CHECK(w.info(h.name).shape == h.shape,
              "[convert] '{}': tensor '{}' is {}: shared_expert_intermediate_size 0 implies {}",
              hf_dir.string(), h.name, ckpt::format_shape(w.info(h.name).shape),
              ckpt::format_shape(h.shape));
    (void)w.read_f32(h.name);
  }
  // A tied model's head, if the file has one, is the embedding.
  if (map.tied_head && w.has(map.tied_head->name)) {
    const std::string& n = map.tied_head->name;
    MOE_CHECK(w.info(n).shape == map.tied_head->shape,
              "[convert] '{}': tensor '{}' is {}, the embedding {}", hf_dir.string(), n,
              ckpt::format_shape(w.info(n).shape), ckpt::format_shape(map.tied_head->shape));
    MOE_CHECK(w.read_f32(n) == w.read_f32(map.embedding),
              "[convert] '{}': tie_word_embeddings is true but '{}' differs from "
              "'{}': the checkpoint is not tied (set "
              "tie_word_embeddings false) or is corrupt",
              hf_dir.string(), n, map.embedding);
  }
  // DeepSeek-V3's MTP layers store the embedding and the head again: the same values, read once.
  for (const HfTensorMap::Copy& c : map.copies) {
    const std::string& n = c.tensor.name;
    MOE_CHECK(w.info(n).shape == c.tensor.shape, "[convert] '{}': tensor '{}' is {}, '{}' {}",
              hf_dir.string(), n, ckpt::format_shape(w.info(n).shape), c.of,
              ckpt::format_shape(c.tensor.shape));
    MOE_CHECK(w.read_f32(n) == w.read_f32(c.of),
              "[convert] '{}': '{}' differs from '{}', of which it is a copy in DeepSeek-V3's "
              "checkpoints (moecore's MTP layers share the main model's embedding and output "
              "layer): the checkpoint is corrupt or of another model",
              hf_dir.string(), n, c.of);
  }
  if (s.arch == HfArch::Gpt2) consume_gpt2_buffers(w, s, hf_dir);
  // Megatron's converter once dropped expert weights silently (issue #5844): here nothing may be
  // left over.
  const std::vector<std::string> left = w.unread();
  MOE_CHECK(left.empty(),
            "[convert] '{}': {} tensor(s) of the checkpoint have no place in the model config.json "
            "describes, and would be dropped: {}. Nothing was written",
            hf_dir.string(), left.size(), name_list(left));
  res.hf_tensors = static_cast<int64_t>(w.names().size());

  // The checkpoint, as the trainer writes iteration 0 of one rank (checkpointing.cpp).
  create_output_dir(out_dir);  // only now: a refused import leaves nothing behind
  const fs::path staging = ckpt::begin_staging(out_dir, 0);
  man.iteration = 0;
  man.world_size = 1;
  shard.set_metadata("format", "moecore");
  shard.set_metadata("format_version", std::to_string(ckpt::kManifestVersion));
  shard.set_metadata("iteration", "0");
  shard.set_metadata("rank", "0");
  man.files.push_back(ckpt::write_shard(staging, file, 0, shard));
  man.layout = {{"dp", 1}, {"ep", 1}, {"expt_dp", 1}};
  man.state = {{"iteration", 0},
               {"optimizer_steps", 0},
               {"has_optimizer", false},
               {"consumed_train_samples", 0},
               {"consumed_valid_samples", 0},
               {"model", train::model_signature(m)},
               {"args", flag_args},  // for --use-checkpoint-args, as a trained checkpoint's
               // Where it came from: export's default class, and the config's other keys.
               {"hf", {{"architecture", hf_arch_class(s.arch)}, {"config", config}}}};
  ckpt::write_manifest(staging, man);
  ckpt::write_file_atomic(res.flags_file, toml);
  res.checkpoint = ckpt::iteration_dir(out_dir, 0);
  ckpt::publish_iteration_dir(out_dir, 0);
  ckpt::write_tracker(out_dir, 0);
  return res;
}

}  // namespace moecore::convert
