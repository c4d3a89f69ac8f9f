// `moecore convert hf-to-moecore --input HF_DIR --output CKPT_DIR` and `moecore convert
// moecore-to-hf --input CKPT_DIR --output HF_DIR [--arch A] [--flags FILE] [--dtype bf16]
// [--max-shard-size SIZE]`: HuggingFace checkpoints of Mixtral, Qwen2-MoE and Qwen3-MoE into
// moecore checkpoints and back (docs/hf_interop.md).
#pragma once

#include "core/command.h"

namespace moecore::convert {

Subcommand add_convert_command(CLI::App& app);

}  // namespace moecore::convert
