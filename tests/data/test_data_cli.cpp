// The data commands as a user meets them: `moecore preprocess` writes Megatron's bytes,
// `moecore dataset-info` reports splits and dumps samples, `moecore train --data-path PREFIX`
// trains with validation and test evaluation, and every data path that cannot serve stops
// with a message naming it (never an uncaught exception).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/command.h"
#include "common/paths.h"
#include "data/data_pipeline.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"

namespace {

using moecore::testing::CommandResult;

CommandResult run(const std::string& args) { return moecore::testing::run_moecore(args); }

std::string temp_dir() {
  const auto d = std::filesystem::temp_directory_path() /
                 ("moecore_data_cli." + std::to_string(::getpid()) + "." +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(d);
  return d.string();
}

std::string fixture(const std::string& name) {
  return ::moecore::testing::source_dir() + "/tests/fixtures/data/" + name;
}

std::vector<char> bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const char* kTiny =
    " --hidden-size 32 --num-attention-heads 2 --seq-length 16 --num-layers 2 --num-experts 4"
    " --moe-ffn-hidden-size 16 --ffn-hidden-size 32 --micro-batch-size 2"
    " --global-batch-size 4 --train-iters 4 --lr-warmup-iters 0 --log-interval 2"
    " --peak-tflops 0.1 --max-position-embeddings 16 --lr 1e-3 --swiglu --disable-bias-linear"
    " --normalization RMSNorm --position-embedding-type rope --attention-dropout 0"
    " --hidden-dropout 0";

// A corpus of a few hundred JSON lines preprocessed byte-level.
std::string make_corpus(const std::string& dir) {
  const std::string in = dir + "/corpus.jsonl";
  {
    std::ofstream out(in);
    for (int i = 0; i < 300; ++i) {
      out << nlohmann::json({{"text", "document " + std::to_string(i) +
                                          ": the quick brown fox jumps over the lazy dog."}})
                 .dump()
          << "\n";
    }
  }
  CommandResult r = run("preprocess --input " + in + " --output-prefix " + dir +
                        "/corpus --append-eod --workers 2 --log-interval 100");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Processed 300 documents"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MB/s of text"), std::string::npos) << r.output;
  return dir + "/corpus_text_document";
}

TEST(DataCli, PreprocessWritesMegatronsBytes) {
  const std::string dir = temp_dir();
  // The output folder does not exist yet: preprocess creates it.
  CommandResult r = run("preprocess --input " + fixture("preprocess_input.jsonl") +
                        " --output-prefix " + dir + "/new/b --append-eod --tokenizer-type ByteLevel");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(bytes(dir + "/new/b_text_document.bin"), bytes(fixture("preprocess_bytelevel_text_document.bin")));
  EXPECT_EQ(bytes(dir + "/new/b_text_document.idx"), bytes(fixture("preprocess_bytelevel_text_document.idx")));
  r = run("preprocess --input " + fixture("preprocess_null.jsonl") + " --output-prefix " + dir +
          "/n --append-eod --tokenizer-type NullTokenizer --vocab-size 70000 --workers 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("int32 tokens"), std::string::npos) << r.output;  // vocab >= 65500
  EXPECT_EQ(bytes(dir + "/n_text_document.bin"), bytes(fixture("preprocess_null_text_document.bin")));
  EXPECT_EQ(bytes(dir + "/n_text_document.idx"), bytes(fixture("preprocess_null_text_document.idx")));
  // Bad input: a line that is not JSON, a missing key; named with the line number.
  {
    std::ofstream(dir + "/bad.jsonl") << "{\"text\": \"ok\"}\nnot json\n";
  }
  r = run("preprocess --input " + dir + "/bad.jsonl --output-prefix " + dir + "/x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("line 2 is not JSON"), std::string::npos) << r.output;
  r = run("preprocess --input " + fixture("preprocess_input.jsonl") + " --json-keys body --output-prefix " + dir + "/x");
  EXPECT_NE(r.output.find("line 1 has no key \"body\""), std::string::npos) << r.output;
  r = run("preprocess --input " + dir + " --output-prefix " + dir + "/x");
  EXPECT_NE(r.output.find("is a directory"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

TEST(DataCli, DatasetInfoDumpsTheTrainingSamplesInOrder) {
  const std::string dir = temp_dir();
  const std::string prefix = make_corpus(dir);
  CommandResult r = run("dataset-info --data-path " + prefix +
                        " --seq-length 16 --split 90,8,2 --seed 5 --train-samples 40 "
                        "--dump-samples 6 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["datasets"][0]["sequences"].get<int64_t>(), 300);
  EXPECT_EQ(j["datasets"][0]["dtype"].get<std::string>(), "uint16");
  EXPECT_TRUE(j["splits"].contains("valid"));
  ASSERT_EQ(j["samples"].size(), 6u);
  // The same samples the library builds for training.
  using namespace moecore::data;
  GPTDatasetConfig cfg;
  cfg.seq_length = 16;
  cfg.seed = 5;
  cfg.split = "90,8,2";
  cfg.vocab = 256;
  GPTDataset train(std::make_shared<const IndexedDataset>(prefix), Split::Train, 40, cfg);
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> t(17);
    train.sample(t.data(), 17, i);
    EXPECT_EQ(j["samples"][i].get<std::vector<int32_t>>(), t) << i;
  }
  std::filesystem::remove_all(dir);
}

TEST(DataCli, TrainsOnAPrefixWithValidationAndTest) {
  const std::string dir = temp_dir();
  const std::string prefix = make_corpus(dir);
  const std::string metrics = dir + "/m.jsonl";
  CommandResult r = run("train" + std::string(kTiny) + " --data-path " + prefix +
                        " --split 90,8,2 --eval-interval 2 --eval-iters 2 --data-cache-path " +
                        dir + "/cache --metrics-file " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train split: sequences [0, 270) of 300"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" validation loss at iteration 2 | lm loss value: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" validation loss at iteration 4 on validation set | "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" validation loss at iteration 4 on test set | "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lm loss PPL: "), std::string::npos);
  int valid_rows = 0, test_rows = 0;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto row = nlohmann::json::parse(line);
    if (row.contains("valid_lm_loss")) {
      ++valid_rows;
      EXPECT_NEAR(row["valid_lm_loss_ppl"].get<double>(), std::exp(row["valid_lm_loss"].get<double>()), 1e-9 * row["valid_lm_loss_ppl"].get<double>());
    }
    test_rows += row.contains("test_lm_loss");
  }
  EXPECT_EQ(valid_rows, 3);  // iterations 2 and 4, then after training
  EXPECT_EQ(test_rows, 1);
  // The second run finds the indices in the cache and trains bitwise the same.
  CommandResult again = run("train" + std::string(kTiny) + " --data-path " + prefix +
                            " --split 90,8,2 --eval-interval 2 --eval-iters 2 --data-cache-path " +
                            dir + "/cache");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("indices from --data-cache-path"), std::string::npos) << again.output;
  auto losses = [](const std::string& out) {
    std::vector<std::string> v;
    for (size_t p = out.find("lm loss: "); p != std::string::npos; p = out.find("lm loss: ", p + 1)) {
      v.push_back(out.substr(p, 21));
    }
    return v;
  };
  EXPECT_EQ(losses(r.output), losses(again.output));
  // A blend of the prefix with itself, weighted, also trains.
  CommandResult blend = run("train" + std::string(kTiny) + " --data-path 0.25 " + prefix + " 0.75 " +
                            prefix + " --split 90,8,2 --eval-iters 1");
  ASSERT_EQ(blend.exit_code, 0) << blend.output;
  EXPECT_NE(blend.output.find("blend of 2 datasets"), std::string::npos) << blend.output;
  std::filesystem::remove_all(dir);
}

TEST(DataCli, MockDataTrains) {
  CommandResult r = run("train" + std::string(kTiny) +
                        " --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --eval-iters 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("'mock' train split: sequences [0, 33333) of 100000"), std::string::npos)
      << r.output;
}

void expect_stops(const std::string& args, const std::string& needle) {
  CommandResult r = run("train" + std::string(kTiny) + " " + args);
  EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;  // a clean error, not an abort (134)
  EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  EXPECT_EQ(r.output.find("iteration "), std::string::npos) << "trained despite: " << args;
}

TEST(DataCli, DataPathsThatCannotServeStopWithTheirName) {
  const std::string dir = temp_dir();
  expect_stops("--data-path " + dir, "'" + dir + "' is a directory");
  expect_stops("--data-path /dev/null", "'/dev/null' is not a regular file");
  expect_stops("--data-path " + dir + "/missing", "'" + dir + "/missing' does not exist");
  std::ofstream(dir + "/empty.txt").close();
  expect_stops("--data-path " + dir + "/empty.txt", "is empty");
  const std::string prefix = make_corpus(dir);
  std::filesystem::remove(prefix + ".bin");
  expect_stops("--data-path " + prefix, "the data file '" + prefix + ".bin' beside its index does not exist");
  expect_stops("--data-path " + prefix + ".idx", "give the prefix without the extension");
  expect_stops("--mock-data --data-path x", "--mock-data and --data-path exclude each other");
  expect_stops("--split 1,0,0", "--split needs --data-path");
  expect_stops("--data-path x --tokenizer-type BertWordPieceCase", "not implemented yet (issue 14)");
  std::filesystem::remove_all(dir);
}

// A request no split can serve: samples (--seq-length + 1 tokens each) longer than the whole
// split. dataset-info and train stop before any index is built (Megatron would build one sample
// out of as many repeated epochs as it takes), naming the split's tokens, the sample's and the
// fix. An evaluation split is held to it when samples are asked of it: train's with
// --eval-iters > 0, dataset-info's with --valid-samples / --test-samples > 0.
TEST(DataCli, ASampleLongerThanItsSplitIsRefused) {
  const std::string dir = temp_dir();
  const std::string prefix = make_corpus(dir);
  CommandResult r = run("dataset-info --data-path " + prefix +
                        " --seq-length 1000000000 --train-samples 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the train split (documents [0, 291) of 300, --split '969, 30, 1') "
                          "holds "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("fewer than one sample of --seq-length 1000000000 + 1 = 1000000001 "
                          "tokens, so none of the 1 samples asked of it exists"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("give --seq-length at most "), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 5) << "the refusal comes before any index is built";

  // The validation split of 90,8,2 holds about 1,300 tokens, the training split about 15,000.
  const std::string info = "dataset-info --data-path " + prefix +
                           " --seq-length 2048 --split 90,8,2 --train-samples 4";
  r = run(info);
  EXPECT_EQ(r.exit_code, 0) << "nothing is asked of the validation split: " << r.output;
  EXPECT_NE(r.output.find("valid split: sequences [270, 294) of 300"), std::string::npos)
      << r.output;
  r = run(info + " --valid-samples 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the valid split (documents [270, 294) of 300, --split '90,8,2')"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("or more valid data"), std::string::npos) << r.output;

  const std::string train = "--seq-length 2048 --max-position-embeddings 2048 --train-iters 1 "
                            "--data-path " + prefix + " --split 90,8,2";
  expect_stops(train + " --eval-iters 1",
               "the valid split (documents [270, 294) of 300, --split '90,8,2')");
  r = run("train" + std::string(kTiny) + " " + train + " --eval-iters 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
