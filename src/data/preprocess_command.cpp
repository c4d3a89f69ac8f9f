#include "data/preprocess_command.h"

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "core/check.h"
#include "data/preprocess.h"

namespace moecore::data {

namespace {

// The most tokenizing threads: far above any machine's cores, far below what exhausts the
// process's stacks.
constexpr int kMaxPreprocessWorkers = 1024;

struct PreprocessFlags {
  PreprocessConfig cfg;
  bool split_sentences = false, keep_newlines = false;
  int partitions = 1;
};

}  // namespace

Subcommand add_preprocess_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "preprocess", "Tokenize text into a Megatron indexed dataset (.bin/.idx), as Megatron's "
                    "tools/preprocess_data.py");
  auto f = std::make_shared<PreprocessFlags>();
  PreprocessConfig& c = f->cfg;
  cli->add_option("--input", c.input, "JSON lines (one document per line), or plain text")
      ->required();
  cli->add_option("--input-format", c.input_format,
                  "auto (.json/.jsonl: JSON lines, else text), jsonl, or text (a document per "
                  "line)")
      ->check(CLI::IsMember({"auto", "jsonl", "text"}));
  cli->add_option("--json-keys", c.json_keys, "Keys to extract from each JSON line (default text)");
  cli->add_option("--output-prefix", c.output_prefix,
                  "Writes <prefix>_<key>_document.bin and .idx")
      ->required();
  cli->add_flag("--append-eod", c.append_eod, "Append the tokenizer's eod to every document");
  cli->add_option("--workers", c.workers, "Tokenizing threads (default: all cores)")
      ->check(CLI::Validator(
          [](const std::string& v) {
            return std::atol(v.c_str()) >= 1 ? std::string()
                                               : "--workers " + v + " must be >= 1 (threads; "
                                                 "leave it out for every core)";
          },
          "N >= 1"));
  cli->add_option("--log-interval", c.log_interval, "Documents between progress lines");
  cli->add_option("--tokenizer-type", c.tokenizer.type, std::string("One of ") + tokenizer_types());
  cli->add_option("--vocab-size", c.tokenizer.vocab_size, "NullTokenizer: the vocabulary");
  cli->add_option("--vocab-file", c.tokenizer.vocab_file, "GPT2BPETokenizer: vocab.json");
  cli->add_option("--merge-file", c.tokenizer.merge_file, "GPT2BPETokenizer: merges.txt");
  cli->add_option("--tokenizer-model", c.tokenizer.tokenizer_model,
                  "HuggingFaceTokenizer: tokenizer.json or its directory; the SentencePiece "
                  "types: the .model file");
  cli->add_flag("--split-sentences", f->split_sentences, "(not implemented: NLTK sentence splitting)")
      ->group("");
  cli->add_flag("--keep-newlines", f->keep_newlines, "(not implemented)")->group("");
  cli->add_option("--partitions", f->partitions, "Only 1 (the input is read in parallel blocks)");
  return Subcommand{cli, [f]() {
                      MOE_CHECK(!f->split_sentences && !f->keep_newlines,
                                "[preprocess] --split-sentences (NLTK punkt) is not implemented: "
                                "documents are kept whole");
                      // Each thread takes a stack: 100000 of them crashed the OpenMP runtime.
                      MOE_CHECK(f->cfg.workers <= kMaxPreprocessWorkers,
                                "[preprocess] --workers {} is more than {} threads: give at most "
                                "{} (leave it out for every core)",
                                f->cfg.workers, kMaxPreprocessWorkers, kMaxPreprocessWorkers);
                      MOE_CHECK(f->cfg.log_interval >= 1,
                                "[preprocess] --log-interval {} must be >= 1 (documents between "
                                "progress lines)",
                                f->cfg.log_interval);
                      MOE_CHECK(f->partitions == 1,
                                "[preprocess] --partitions {}: only 1 is implemented (the input "
                                "is tokenized by --workers threads already)",
                                f->partitions);
                      preprocess(f->cfg, std::cout);
                      return 0;
                    }};
}

}  // namespace moecore::data
