#include "convert/convert_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <memory>

#include "convert/hf_export.h"
#include "convert/hf_import.h"
#include "convert/hf_weights.h"
#include "core/check.h"

namespace moecore::convert {
namespace {

struct ConvertArgs {
  std::string input, output, arch, flags, dtype = "f32", max_shard_size;
};

int run_import(const ConvertArgs& a) {
  const ImportResult r = import_hf(a.input, a.output);
  for (const std::string& w : r.warnings) std::cerr << w << "\n";
  std::cout << fmt::format(
      "[convert] {} ({}): {} HF tensors -> {} moecore tensors ({} parameters), every tensor "
      "consumed\n  checkpoint {}\n  flags      {} (moecore train --config {} --load {} "
      "--finetune ...)\n",
      a.input, hf_arch_class(r.spec.arch), r.hf_tensors, r.moecore_tensors, r.parameters,
      r.checkpoint.string(), r.flags_file.string(), r.flags_file.string(), a.output);
  return 0;
}

int run_export(const ConvertArgs& a) {
  ExportOptions o;
  o.input = a.input;
  o.output = a.output;
  if (!a.arch.empty()) {
    o.arch = parse_hf_arch(a.arch);
    MOE_CHECK(o.arch.has_value(),
              "[convert] --arch {}: mixtral, qwen2_moe, qwen3_moe, gpt2 or deepseek_v3", a.arch);
  }
  o.flags = a.flags;
  o.dtype = a.dtype == "bf16" ? "BF16" : "F32";
  if (!a.max_shard_size.empty()) o.max_shard_bytes = parse_shard_size(a.max_shard_size);
  const ExportResult r = export_hf(o);
  for (const std::string& w : r.warnings) std::cerr << w << "\n";
  std::cout << fmt::format("[convert] {} -> {} ({}, from {}): {} HF tensors in {} ({})\n",
                           r.checkpoint.string(), a.output, hf_arch_class(r.spec.arch), r.arch_from,
                           r.hf_tensors, o.dtype, fmt::join(r.files, ", "));
  return 0;
}

}  // namespace

Subcommand add_convert_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "convert",
      "HuggingFace checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-2, DeepSeek-V3) to moecore and "
      "back");
  cli->require_subcommand(1);
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* in = cli->add_subcommand(
      "hf-to-moecore",
      "An HF checkpoint into a moecore checkpoint at iteration 0 and its moecore_flags.toml");
  in->add_option("--input", args->input, "HF directory: config.json and safetensors weights")
      ->required();
  in->add_option("--output", args->output, "moecore checkpoint directory (a --load directory)")
      ->required();
  CLI::App* out = cli->add_subcommand(
      "moecore-to-hf", "A moecore checkpoint into an HF directory (config.json + safetensors)");
  out->add_option("--input", args->input, "--save directory or iter_NNNNNNN directory")->required();
  out->add_option("--output", args->output, "HF directory to create")->required();
  out->add_option(
         "--arch", args->arch,
         "mixtral | qwen2_moe | qwen3_moe | gpt2 | deepseek_v3 (default: the class recorded at "
         "import, else from the model's features)")
      ->check(CLI::IsMember({"mixtral", "qwen2_moe", "qwen3_moe", "gpt2", "deepseek_v3"}));
  out->add_option("--flags", args->flags,
                  "the model's moecore train flags (TOML, as --config takes; default: "
                  "moecore_flags.toml of the --save directory)");
  out->add_option("--dtype", args->dtype, "f32 | bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  out->add_option("--max-shard-size", args->max_shard_size,
                  "shard the weights with an index, e.g. 5GB, 500MiB (default: one file)");
  return Subcommand{cli,
                    [in, args]() { return in->parsed() ? run_import(*args) : run_export(*args); }};
}

}  // namespace moecore::convert
