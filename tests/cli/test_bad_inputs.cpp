// Bad input, as users and adversaries give it, ends in a message and a non-zero exit: never a
// signal, never a hang, never a run that goes on with the value read as something else. One table
// per kind: every bound of every numeric flag (in process), and a row per class of bad input for
// each subcommand (the binary, timed).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/flag_ranges.h"
#include "cli/train_flags.h"
#include "common/command.h"
#include "core/check.h"

namespace moecore::cli {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Megatron's default model, small, stated in full.
const std::string kModel =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16"
    " --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 2"
    " --lr 1e-3 --log-interval 1 --peak-tflops 0.1";

std::string parse_error(const std::vector<std::string>& extra) {
  std::vector<std::string> args = words(kModel);
  args.insert(args.end(), extra.begin(), extra.end());
  try {
    parse_train_args(args);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string fmt_value(double v) { return fmt::format("{}", v); }

// Each bound of flag_ranges(): the first value past it is refused, naming the flag and the
// range, whether or not anything else would have caught it later. A table row whose flag
// `moecore train` does not take fails here too (the parser's own message).
TEST(FlagRanges, EveryBoundIsEnforced) {
  for (const FlagRange& r : flag_ranges()) {
    std::vector<double> outside = {r.lo_open ? r.lo : r.lo - 1};
    if (std::isfinite(r.hi)) outside.push_back(r.hi_open ? r.hi : r.hi + 1);
    for (double v : outside) {
      const std::string value = fmt_value(v);
      const std::string e = parse_error({r.flag, value});
      EXPECT_NE(e.find(std::string(r.flag) + " " + value + " is out of range"), std::string::npos)
          << r.flag << " " << value << ": " << e;
    }
  }
}

// Values that are numbers but none a run can use.
TEST(FlagRanges, NonFiniteAndOversizedValuesAreRefused) {
  EXPECT_NE(parse_error({"--lr", "nan"}).find("--lr nan is not a finite number"),
            std::string::npos);
  EXPECT_NE(parse_error({"--adam-eps", "1e400"}).find("is not a finite number"), std::string::npos);
  EXPECT_NE(parse_error({"--num-layers", "99999999999999999999"}).find("does not fit in 64 bits"),
            std::string::npos);
  // Inside the ranges, the same flags parse.
  EXPECT_EQ(parse_error({"--seed", "0", "--hidden-dropout", "0", "--moe-aux-loss-coeff", "0"}), "");
}

struct Row {
  std::string args;    // {dir} is the case's scratch directory
  int exit_code;       // expected
  std::string needle;  // the message must contain it
};

// The scratch directory of this process: a regular file, a directory, an empty file, bad JSON.
class BadInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_bad_inputs." + std::to_string(::getpid()));
    fs::create_directories(dir_ / "a_dir");
    std::ofstream(dir_ / "file") << "x\n";
    std::ofstream(dir_ / "empty");
    std::ofstream(dir_ / "bad.json") << "{\n";
    std::ofstream(dir_ / "tokens.json") << "[[1, 2, 3]]\n";
  }
  void TearDown() override { fs::remove_all(dir_); }

  void check(const std::vector<Row>& rows) {
    for (const Row& row : rows) {
      std::string args = row.args;
      for (size_t at; (at = args.find("{dir}")) != std::string::npos;)
        args.replace(at, 5, dir_.string());
      const testing::CommandResult r = testing::run_moecore(args);
      EXPECT_EQ(r.exit_code, row.exit_code) << args << "\n" << r.output;
      EXPECT_LT(r.exit_code, 128) << "ended by a signal: " << args << "\n" << r.output;
      EXPECT_NE(r.output.find(row.needle), std::string::npos) << args << "\n" << r.output;
      EXPECT_EQ(r.output.find("internal error"), std::string::npos) << args << "\n" << r.output;
      EXPECT_EQ(r.output.find(" iteration "), std::string::npos) << "trained: " << args;
      EXPECT_LT(r.seconds, 20) << "took " << r.seconds << " s: " << args;
    }
  }

  fs::path dir_;
};

TEST_F(BadInputs, Train) {
  const std::string t = "train " + kModel + " ";
  check({
      {t + "--hidden-size 0", 1, "--hidden-size 0 is out of range: it must be >= 1"},
      {t + "--ffn-hidden-size -5", 1, "--ffn-hidden-size -5 is out of range"},
      {t + "--num-experts 4 --moe-ffn-hidden-size 0", 1, "--moe-ffn-hidden-size 0 is out of range"},
      {t + "--moe-expert-capacity-factor nan --num-experts 4", 1, "is not a finite number"},
      {t + "--lr 1e400", 1, "--lr 1e400 is not a finite number"},
      {t + "--seed -1", 1, "--seed -1 is out of range"},
      {t + "--num-layers 99999999999999999999", 1, "does not fit in 64 bits"},
      {t + "--config {dir}/a_dir", 1, "is a directory: give a TOML file"},
      {t + "--config {dir}/missing.toml", 1, "missing.toml' does not exist"},
      {t + "--config {dir}/bad.json", 1, "[config] cannot read"},
      {t + "--metrics-file {dir}/a_dir", 1, "--metrics-file '" },
      {t + "--save {dir}/file", 1, "is not a directory"},
      {t + "--load {dir}/file", 1, "is a file, not a checkpoint directory"},
      {t + "--data-path {dir}/a_dir --tokenizer-type NullTokenizer --vocab-size 64", 1,
       "is a directory"},
      // Sizes no machine holds: stopped before anything is built or zeroed.
      {t + "--num-layers 100000000", 1, "[memory] the model needs at least"},
      {t + "--micro-batch-size 100000000 --global-batch-size 100000000", 1, "[memory]"},
      {t + "--seq-length 1000000000 --max-position-embeddings 1000000000", 1, "memory"},
      {t + "--no-such-flag", 1, "unrecognized argument --no-such-flag"},
  });
}

TEST_F(BadInputs, Eval) {
  const std::string e = "eval " + kModel + " ";
  check({
      {e + "--load {dir}/a_dir --tokens-json {dir}/tokens.json", 1, "holds no checkpoint"},
      {e + "--load {dir}/file --tokens-json {dir}/tokens.json", 1, "a checkpoint directory"},
      {e + "--hidden-size -1 --load {dir}/a_dir --tokens-json {dir}/tokens.json", 1,
       "--hidden-size -1 is out of range"},
  });
}

TEST_F(BadInputs, Groups) {
  check({
      {"groups --world-size 0", 1, "world size 0 must be in [1, 1048576]"},
      {"groups --world-size 100000000", 1, "world size 100000000 must be in [1, 1048576]"},
      {"groups --world-size 8 --num-layers -1", 1, "--num-layers -1 must be >= 1"},
      {"groups --world-size 8 --num-experts -3", 1, "--num-experts -3 must be >= 0"},
      {"groups --world-size 8 --rank 99", 1, "--rank 99 outside the world of 8 ranks"},
      {"groups --world-size 8 --expert-model-parallel-size 3", 1, "not divisible"},
      {"groups --world-size 8 --distributed-timeout-minutes 0", 1,
       "--distributed-timeout-minutes 0 must be > 0"},
  });
}

}  // namespace
}  // namespace moecore::cli
