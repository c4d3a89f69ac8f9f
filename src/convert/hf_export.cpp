#include "convert/hf_export.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_command.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "convert/hf_import.h"
#include "convert/hf_tensor_map.h"
#include "convert/hf_weights.h"
#include "convert/model_flags.h"
#include "convert/output_dir.h"
#include "core/check.h"
#include "core/host_memory.h"
#include "train/checkpoint_state.h"
#include "cli/config_file.h"

namespace moecore::convert {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<float> read_whole_f32(ckpt::CheckpointReader& r, const ckpt::GlobalTensor& g) {
  MOE_CHECK(g.dtype == "F32", "[convert] '{}': tensor '{}' is {}: moecore's weights are F32",
            r.dir().string(), g.name, g.dtype);
  std::vector<float> v(static_cast<size_t>(numel(g.shape)));
  r.read(g.name, "F32", -1, 0, 0, {reinterpret_cast<std::byte*>(v.data()), v.size() * 4});
  return v;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ExportResult export_hf(const ExportOptions& opt) {
  ExportResult res;
  MOE_CHECK(opt.dtype == "F32" || opt.dtype == "BF16",
            "[convert] --dtype {}: HF weights are written as f32 or bf16", opt.dtype);
  check_output_dir(opt.output, "an HF checkpoint", /*empty=*/true);
  const bool iteration_given = fs::exists(opt.input / ckpt::kManifestFile);
  res.checkpoint = ckpt::resolve_checkpoint(opt.input);
  ckpt::CheckpointReader reader(res.checkpoint);
  const ckpt::Manifest& man = reader.manifest();
  const std::string dir = reader.dir().string();

  // The model's flags: --flags, else the save directory's moecore_flags.toml, else the flags
  // the checkpoint records (--use-checkpoint-args).
  const fs::path save_dir = iteration_given ? opt.input.parent_path() : opt.input;
  const fs::path flags_path = !opt.flags.empty() ? opt.flags : save_dir / kFlagsFile;
  const bool recorded_args =
      opt.flags.empty() && !fs::exists(flags_path) && man.state.contains("args");
  MOE_CHECK(recorded_args || fs::exists(flags_path),
            "[convert] '{}' does not exist and '{}' records no flags: give --flags FILE, the "
            "`moecore train` flags (the --config TOML) of the checkpoint's model; `convert "
            "hf-to-moecore` writes them as {}",
            flags_path.string(), dir, kFlagsFile);
  const cli::TrainFlags tf =
      recorded_args ? parse_model_flags({"--use-checkpoint-args", "--load=" + save_dir.string(),
                                         "--ckpt-step=" + std::to_string(man.iteration)})
                    : parse_model_flags(cli::config_file_args(flags_path.string()));
  const ModelConfig& m = tf.model;
  MOE_CHECK(man.state.contains("model"), "[convert] '{}': the manifest's state has no \"model\"",
            dir);
  train::check_same_model(man.state["model"], train::model_signature(m), dir);

  const json* recorded = nullptr;
  if (man.state.contains("hf") && man.state["hf"].is_object()) recorded = &man.state["hf"];
  HfArch arch;
  if (opt.arch) {
    arch = *opt.arch;
    res.arch_from = "--arch";
  } else if (recorded && recorded->contains("architecture") &&
             parse_hf_arch((*recorded)["architecture"].get<std::string>())) {
    arch = *parse_hf_arch((*recorded)["architecture"].get<std::string>());
    res.arch_from = "the import";
  } else {
    arch = default_hf_arch(m);
    res.arch_from = "the model's features";
  }
  res.spec = hf_spec_of_model(m, arch);
  // DeepSeek-V3 imported from a checkpoint whose rotary rows pair half-split (rope_interleave
  // false) goes back in that layout: its rows permuted back, the key as it was.
  if (res.spec.deepseek && recorded != nullptr && recorded->contains("config")) {
    const json& c = (*recorded)["config"];
    if (c.is_object() && c.value("model_type", json()) == "deepseek_v3" &&
        c.value("rope_interleave", json(true)) == json(false))
      res.spec.deepseek->rope_interleave = false;
  }
  const HfModelSpec& s = res.spec;
  const HfTensorMap map = hf_tensor_map(s);

  // Every tensor the table reads present with its shape, before any is converted.
  std::vector<std::string> missing;
  std::set<std::string> used;
  for (const TensorMapping& t : map.tensors) {
    const ckpt::GlobalTensor* g = man.find(t.moecore);
    if (g == nullptr) {
      missing.push_back(t.moecore);
      continue;
    }
    MOE_CHECK(g->shape == t.shape, "[convert] '{}': tensor '{}' is {}, the flags imply {}", dir,
              t.moecore, ckpt::format_shape(g->shape), ckpt::format_shape(t.shape));
    used.insert(t.moecore);
  }
  MOE_CHECK(missing.empty(), "[convert] '{}': {} tensor(s) of the model are missing: {}", dir,
            missing.size(), name_list(missing));
  // The HF tensors are held in memory until their shard is written, with the largest one's f32
  // read and conversion beside them: checked before any is read.
  double total = 0, largest = 0;
  for (const TensorMapping& t : map.tensors) {
    double n = 1;
    for (int64_t d : t.shape) n *= static_cast<double>(d);
    total += n * (opt.dtype == "BF16" ? 2 : 4);
    largest = std::max(largest, 4 * n);
  }
  const double need = total + 2 * largest;
  const double memory = static_cast<double>(host_memory_bytes());
  MOE_CHECK(need <= memory,
            "[convert] '{}': the HF weights are {} in {}, and the converter holds them in memory "
            "while writing ({} with the largest tensor's f32 copies), more than this machine's {} "
            "of memory",
            dir, format_bytes(total), opt.dtype, format_bytes(need), format_bytes(memory));
  // The rest: optimizer state is not exported; the routers' balancing state has no place in HF
  // (its routers select by the plain scores), so it must be zero; anything else is left over.
  std::vector<std::string> left;
  for (const ckpt::GlobalTensor& g : man.tensors) {
    if (used.count(g.name) > 0 || g.name.rfind("exp_avg.", 0) == 0 ||
        g.name.rfind("exp_avg_sq.", 0) == 0)
      continue;
    if (ends_with(g.name, ".router.expert_bias") || ends_with(g.name, ".router.quantile_beta")) {
      for (float x : read_whole_f32(reader, g)) {
        MOE_CHECK(x == 0.0f,
                  "[convert] '{}': '{}' is not zero ({}): HF's routers select by the plain "
                  "scores, so the exported model would route differently",
                  dir, g.name, x);
      }
      continue;
    }
    left.push_back(g.name);
  }
  MOE_CHECK(left.empty(),
            "[convert] '{}': {} tensor(s) of the checkpoint have no place in {}: {}. Nothing was "
            "written",
            dir, left.size(), hf_arch_class(arch), name_list(left));

  std::vector<HfTensorBytes> out;
  for (const TensorMapping& t : map.tensors) {
    const std::vector<float> v = read_whole_f32(reader, reader.tensor(t.moecore));
    std::vector<std::vector<float>> parts = to_hf(t, v);
    for (size_t i = 0; i < parts.size(); ++i)
      out.push_back({t.hf[i].name, opt.dtype, t.hf[i].shape, f32_as(opt.dtype, parts[i])});
  }
  // DeepSeek-V3's MTP layers hold copies of the embedding and the head, as its checkpoints do.
  for (const HfTensorMap::Copy& c : map.copies) {
    const auto of = std::find_if(out.begin(), out.end(),
                                 [&](const HfTensorBytes& t) { return t.name == c.of; });
    MOE_CHECK(of != out.end(), "[convert] '{}': '{}' is a copy of '{}', which is not written", dir,
              c.tensor.name, c.of);
    HfTensorBytes copy = *of;
    copy.name = c.tensor.name;
    out.push_back(std::move(copy));
  }
  for (const HfTensor& h : map.empty_shared_expert) {
    out.push_back({h.name, opt.dtype, h.shape,
                   f32_as(opt.dtype, std::vector<float>(static_cast<size_t>(numel(h.shape))))});
  }
  res.hf_tensors = static_cast<int64_t>(out.size());

  // Only now, and beside --output: a refused export leaves nothing behind, and a failed or
  // killed one no config.json without its weights (or shards without their index).
  StagedOutput staged(opt.output);
  const json carry = recorded && recorded->contains("config") ? (*recorded)["config"] : json();
  const json config = hf_config_json(s, opt.dtype == "BF16" ? "bfloat16" : "float32",
                                     carry.is_null() ? nullptr : &carry);
  ckpt::write_file_atomic(staged.dir() / "config.json", config.dump(2) + "\n");
  res.files.push_back("config.json");
  convert_fault_point("export.after_config");
  for (std::string& f : write_hf_weights(staged.dir(), std::move(out), opt.max_shard_bytes))
    res.files.push_back(std::move(f));
  convert_fault_point("export.after_weights");
  staged.publish();
  return res;
}

}  // namespace moecore::convert
