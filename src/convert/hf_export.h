// `moecore convert moecore-to-hf`: a moecore checkpoint (any layout: each global tensor is read
// whole through CheckpointReader's resharding read) into a HuggingFace checkpoint directory,
// config.json and model.safetensors (or shards with their index), for MixtralForCausalLM,
// Qwen2MoeForCausalLM or Qwen3MoeForCausalLM. The model's configuration comes from its
// `moecore train` flags (the import's moecore_flags.toml, or the run's --config file); the
// class from the command, else the one recorded at import, else the model's features
// (docs/hf_interop.md, section 7).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "convert/hf_config.h"

namespace moecore::convert {

struct ExportOptions {
  std::filesystem::path input;   // a --save directory (its latest checkpoint) or an iter_* one
  std::filesystem::path output;  // the HF directory (created; refused when it holds weights)
  std::optional<HfArch> arch;    // unset: recorded at import, else default_hf_arch
  // The model's `moecore train` flags file; empty: moecore_flags.toml of the --save directory.
  std::filesystem::path flags;
  std::string dtype = "F32";     // "F32" or "BF16" (rounded to nearest even)
  uint64_t max_shard_bytes = 0;  // 0: one model.safetensors
};

struct ExportResult {
  HfModelSpec spec;
  std::filesystem::path checkpoint;  // the iteration directory read
  std::string arch_from;             // "--arch", "the import", "the model's features"
  std::vector<std::string> files;    // written into output, config.json first
  std::vector<std::string> warnings;
  int64_t hf_tensors = 0;
};

ExportResult export_hf(const ExportOptions& opt);

}  // namespace moecore::convert
