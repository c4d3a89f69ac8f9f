// The HF model as moecore sees it (docs/hf_interop.md, section 3): the `moecore train` flags of
// an HfModelSpec (what `convert hf-to-moecore` writes as moecore_flags.toml, usable as
// `moecore train --config`), the ModelConfig those flags give through the trainer's own parser,
// and the way back: the HfModelSpec of a moecore model in one of HF's three classes, refusing
// what that class cannot express.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "convert/hf_config.h"
#include "model/config.h"
#include "cli/train_flags.h"

namespace moecore::convert {

// One `moecore train` flag: its name without the dashes ("num-layers") and its value; a bool
// is a switch (true: given).
struct TrainFlag {
  std::string name;
  std::variant<bool, int64_t, double, std::string> value;
};

// The model flags of `s`: sizes, vocabulary (unpadded: --make-vocab-size-divisible-by 1), the
// router mode matching norm_topk_prob, --moe-layer-freq as an explicit list, and the options
// every HF model of the three implies (--swiglu, --disable-bias-linear, RMSNorm, RoPE, no
// dropout). Training choices (sequence length, batch, iterations, learning rate, data) are the
// run's, not the model's, and are not among them.
std::vector<TrainFlag> train_flags_of(const HfModelSpec& s);
// The flags as a TOML file of top-level keys (cli/config_file.h), `comment` as its first
// lines.
std::string flags_toml(const std::vector<TrainFlag>& flags, const std::string& comment);

// Parses `moecore train` arguments (a flags file's, config_file_args / config_text_args) with
// the trainer's parser, so the ModelConfig is exactly the one `moecore train` builds from them.
// The flags Megatron requires that a model's flags file leaves to the training run
// (--seq-length, --micro-batch-size, --train-iters, --lr) get placeholders unless given.
cli::TrainFlags parse_model_flags(const std::vector<std::string>& args);

// The HF class an exported moecore model becomes when the command names none
// (docs/hf_interop.md, section 7): q/k norms -> Qwen3-MoE; else a shared expert or a QKV bias
// -> Qwen2-MoE; else every layer MoE with renormalised weights -> Mixtral; else Qwen2-MoE.
HfArch default_hf_arch(const ModelConfig& m);
// The HF model of moecore model `m` as class `arch`, of the model's vocabulary m.vocab_size (the
// padding rows are not part of the model). Throws naming the setting for what the class cannot
// express.
HfModelSpec hf_spec_of_model(const ModelConfig& m, HfArch arch);

}  // namespace moecore::convert
