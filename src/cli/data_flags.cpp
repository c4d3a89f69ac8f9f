#include <CLI/CLI.hpp>

#include "cli/data_flags.h"

#include "core/check.h"
#include "data/tokenizer.h"

namespace moecore::cli {

void add_data_flags(CLI::App& app, TrainConfig& t) {
  data::DataConfig& d = t.data;
  const char* kData = "Data";
  app.add_option("--data-path", d.data_path,
                 "Indexed dataset prefix(es) (.bin/.idx from `moecore preprocess`): PREFIX, "
                 "W1 PREFIX1 W2 PREFIX2 ... (blend), or PREFIX1 PREFIX2 ...; a plain text file "
                 "trains byte-level. Default: the synthetic language")
      ->group(kData);
  app.add_option("--split", d.split,
                 "Train, validation, test proportions of the documents, e.g. 969,30,1 (the "
                 "default with --data-path)")
      ->group(kData);
  app.add_option("--data-cache-path", d.data_cache_path,
                 "Directory for the cached document, sample and shuffle indices")
      ->group(kData);
  app.add_flag("--eod-mask-loss", d.eod_mask_loss,
               "No loss where the input token is the end-of-document token (Megatron's "
               "loss mask); the synthetic language has none")
      ->group(kData);
  app.add_flag("--mock-data", d.mock_data, "Megatron's mock GPT dataset instead of files")
      ->group(kData);
  app.add_option("--tokenizer-type", d.tokenizer.type,
                 std::string("Tokenizer of the data: ") + data::tokenizer_types())
      ->group(kData);
  app.add_option("--vocab-file", d.tokenizer.vocab_file, "GPT2BPETokenizer: vocab.json")
      ->group(kData);
  app.add_option("--merge-file", d.tokenizer.merge_file, "GPT2BPETokenizer: merges.txt")
      ->group(kData);
  app.add_option("--tokenizer-model", d.tokenizer.tokenizer_model,
                 "HuggingFaceTokenizer: tokenizer.json (or its directory); "
                 "SentencePieceTokenizer: the .model file")
      ->group(kData);

  const char* kEval = "Validation";
  app.add_option("--eval-interval", t.eval_interval,
                 "Iterations between evaluations on the validation split (default: only after "
                 "training)")
      ->group(kEval);
  app.add_option("--eval-iters", t.eval_iters,
                 "Global batches per evaluation (validation and test); 0: no evaluation")
      ->group(kEval);
}

int64_t finalize_data_flags(TrainConfig& t, int64_t vocab_size_flag) {
  data::DataConfig& d = t.data;
  MOE_CHECK(!(d.mock_data && !d.data_path.empty()),
            "[flags] --mock-data and --data-path exclude each other: drop one");
  if (d.synthetic()) {
    MOE_CHECK(d.split.empty(),
              "[flags] --split needs --data-path or --mock-data (the synthetic language has no "
              "splits)");
    // Without data and without --vocab-size, the synthetic language speaks in bytes.
    return vocab_size_flag != 0 ? vocab_size_flag : kSyntheticDefaultVocab;
  }
  d.tokenizer.vocab_size = vocab_size_flag;
  if (d.tokenizer.type == "ByteLevel") {
    MOE_CHECK(vocab_size_flag == 0 || vocab_size_flag == 256,
              "[flags] --vocab-size={} conflicts with the byte-level tokenizer (256 tokens): drop "
              "--vocab-size",
              vocab_size_flag);
  }
  // The tokenizer is built once here for its vocabulary (and to check its files early).
  const auto tok = data::make_tokenizer(d.tokenizer);
  return tok->vocab_size();
}

}  // namespace moecore::cli
