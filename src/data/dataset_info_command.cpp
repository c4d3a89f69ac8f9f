#include "data/dataset_info_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "data/blended_dataset.h"
#include "data/data_pipeline.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"

namespace moecore::data {

namespace {

struct InfoFlags {
  DataConfig data;
  int64_t seq_length = 0;
  uint32_t seed = 1234;
  std::array<int64_t, kNumSplits> samples{0, 0, 0};
  int64_t dump = 0;
  bool json = false;
};

nlohmann::ordered_json gpt_json(const GPTDataset& g) {
  const GPTIndices& x = g.indices();
  return {{"documents", {g.doc_begin(), g.doc_end()}},
          {"tokens_per_epoch", x.tokens_per_epoch},
          {"epochs", x.num_epochs},
          {"separate_final_epoch", x.separate_final_epoch},
          {"samples", x.num_samples()},
          {"from_cache", g.loaded_from_cache()}};
}

nlohmann::ordered_json split_json(const TokenSource& src) {
  nlohmann::ordered_json j;
  j["samples"] = src.num_samples();
  if (const auto* g = dynamic_cast<const GPTDataset*>(&src)) {
    j["datasets"] = nlohmann::ordered_json::array({gpt_json(*g)});
  } else if (const auto* b = dynamic_cast<const BlendedDataset*>(&src)) {
    j["datasets"] = nlohmann::ordered_json::array();
    std::vector<int64_t> drawn(b->num_datasets(), 0);
    for (int16_t d : b->indices().dataset_index) ++drawn[d];
    for (int d = 0; d < b->num_datasets(); ++d) {
      nlohmann::ordered_json e;
      if (const auto* g = dynamic_cast<const GPTDataset*>(&b->dataset(d))) e = gpt_json(*g);
      e["drawn_by_blend"] = drawn[d];
      j["datasets"].push_back(e);
    }
  } else {
    j["description"] = src.describe();
  }
  return j;
}

int run_info(const InfoFlags& f) {
  MOE_CHECK(f.seq_length > 1,
            "[dataset-info] --seq-length={} must be > 1 (a sample is seq-length + 1 tokens)",
            f.seq_length);
  MOE_CHECK(!f.data.data_path.empty() || f.data.mock_data,
            "[dataset-info] give --data-path (or --mock-data)");
  MOE_CHECK(f.samples[0] > 0, "[dataset-info] --train-samples={} must be >= 1", f.samples[0]);
  MOE_CHECK(f.samples[1] >= 0 && f.samples[2] >= 0,
            "[dataset-info] --valid-samples={} and --test-samples={} must be >= 0 (0: one epoch)",
            f.samples[1], f.samples[2]);
  MOE_CHECK(f.dump >= 0, "[dataset-info] --dump-samples={} must be >= 0", f.dump);
  const auto tok = make_tokenizer(f.data.tokenizer);
  nlohmann::ordered_json out;
  out["datasets"] = nlohmann::ordered_json::array();
  if (!f.data.mock_data) {
    bool has_weights = false;
    for (const BlendEntry& e : parse_blend(f.data.data_path, &has_weights)) {
      nlohmann::ordered_json d;
      d["prefix"] = e.prefix;
      if (has_weights) d["weight"] = e.weight;
      if (classify_data_path(e.prefix) == DataPathKind::IndexedPrefix) {
        IndexedDataset ds(e.prefix);
        const std::vector<int32_t> lens = ds.sequence_lengths();
        d["dtype"] = dtype_name(ds.dtype());
        d["sequences"] = ds.num_sequences();
        d["documents"] = ds.num_documents();
        d["tokens"] = ds.num_tokens();
        if (!lens.empty()) {
          d["min_sequence_length"] = *std::min_element(lens.begin(), lens.end());
          d["max_sequence_length"] = *std::max_element(lens.begin(), lens.end());
          d["mean_sequence_length"] =
              static_cast<double>(ds.num_tokens()) / static_cast<double>(lens.size());
        }
      } else {
        d["kind"] = "plain text (byte-level)";
      }
      out["datasets"].push_back(d);
    }
  }
  const DataSplits splits = build_data_splits(f.data, f.seq_length, f.seed, f.samples,
                                              tok->vocab_size(),
                                              f.data.mock_data ? tok->eod() : -1);
  out["splits"] = nlohmann::ordered_json::object();
  for (int s = 0; s < kNumSplits; ++s) {
    const char* name = split_name(static_cast<Split>(s));
    if (splits.split[s]) out["splits"][name] = split_json(*splits.split[s]);
  }
  out["notes"] = splits.notes;
  std::vector<std::vector<int32_t>> dumped;
  if (f.dump > 0) {
    const TokenSource& train = *splits.train();
    const int64_t n = train.num_samples() < 0 ? f.dump : std::min(f.dump, train.num_samples());
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> t(f.seq_length + 1);
      train.sample(t.data(), f.seq_length + 1, static_cast<uint64_t>(i));
      dumped.push_back(std::move(t));
    }
  }
  if (f.json) {
    if (f.dump > 0) out["samples"] = dumped;
    std::cout << out.dump() << "\n";
    return 0;
  }
  for (const auto& d : out["datasets"]) std::cout << "[dataset] " << d.dump() << "\n";
  for (int s = 0; s < kNumSplits; ++s) {
    if (!splits.split[s]) continue;
    const char* name = split_name(static_cast<Split>(s));
    std::cout << fmt::format("[{}] {}\n", name, splits.split[s]->describe());
  }
  for (const std::string& n : splits.notes) std::cout << n << "\n";
  for (size_t i = 0; i < dumped.size(); ++i) {
    std::cout << fmt::format("[sample {}] {}\n", i, fmt::join(dumped[i], " "));
  }
  return 0;
}

}  // namespace

Subcommand add_dataset_info_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "dataset-info", "Splits, epochs, samples and token statistics of --data-path, and the "
                      "first training samples, without training");
  auto f = std::make_shared<InfoFlags>();
  cli->add_option("--data-path", f->data.data_path, "As `moecore train --data-path`");
  cli->add_flag("--mock-data", f->data.mock_data, "Megatron's mock GPT dataset");
  cli->add_option("--split", f->data.split, "Train, validation, test proportions (default 969, 30, 1)");
  cli->add_option("--data-cache-path", f->data.data_cache_path, "Index cache directory");
  cli->add_option("--seq-length", f->seq_length, "Sequence length")->required();
  cli->add_option("--seed", f->seed, "Seed of the shuffles (default 1234)");
  cli->add_option("--train-samples", f->samples[0], "Training samples to plan for")->required();
  cli->add_option("--valid-samples", f->samples[1], "Validation samples (default 0: one epoch)");
  cli->add_option("--test-samples", f->samples[2], "Test samples (default 0: one epoch)");
  cli->add_option("--tokenizer-type", f->data.tokenizer.type, std::string("One of ") + tokenizer_types());
  cli->add_option("--vocab-size", f->data.tokenizer.vocab_size, "NullTokenizer: the vocabulary");
  cli->add_option("--vocab-file", f->data.tokenizer.vocab_file, "GPT2BPETokenizer: vocab.json");
  cli->add_option("--merge-file", f->data.tokenizer.merge_file, "GPT2BPETokenizer: merges.txt");
  cli->add_option("--tokenizer-model", f->data.tokenizer.tokenizer_model,
                  "HuggingFaceTokenizer: tokenizer.json or its directory; the SentencePiece "
                  "types: the .model file");
  cli->add_option("--dump-samples", f->dump, "Print the token ids of the first K training samples");
  cli->add_flag("--json", f->json, "One JSON object (with --dump-samples: \"samples\")");
  return Subcommand{cli, [f]() { return run_info(*f); }};
}

}  // namespace moecore::data
