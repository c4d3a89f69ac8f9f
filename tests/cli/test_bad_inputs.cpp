// Bad input, as users and adversaries give it, ends in a message and a non-zero exit: never a
// signal, never a hang, never a run that goes on with the value read as something else. Every
// bound of every numeric flag (in process), then a row per class of bad input for each subcommand
// (train, eval, groups, plan, dataset-info, preprocess, convert, checkpoint): the command, the
// files it needs, the exit status and the words its message must hold.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/flag_ranges.h"
#include "cli/train_flags.h"
#include "common/command.h"
#include "common/paths.h"

namespace {

namespace fs = std::filesystem;
using moecore::testing::CommandResult;

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
    moecore::cli::parse_train_args(args);
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
  for (const moecore::cli::FlagRange& r : moecore::cli::flag_ranges()) {
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

// A row: {dir} in args is the case's scratch directory, {fx} the fixtures, {src} the checkout.
struct BadInput {
  std::string args;
  int exit_code;
  std::vector<std::string> words;
};

// Every row runs under this bound (coreutils timeout, exit 124): a hang fails the row instead of
// the suite. Generous for a loaded machine; each row takes well under a second here.
constexpr int kHangSeconds = 60;

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) {
    s.replace(p, from.size(), to);
  }
  return s;
}

class BadInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("moecore_bad_tools." + std::to_string(::getpid()) + "." +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/subdir");
    write("afile", "x");
    write("bad.json", "{\n");
    write("tokens.json", "[[1, 2, 3]]");
    write("empty_seqs.json", "[[], [], [7]]");
    write("one_token.json", "[[5]]");
    write("null_ids.jsonl", "{\"text\": \"1 2 40000\"}\n");
    // An HF model whose config asks for an absurd width, and a copy of the fixture.
    fs::copy(fixture("hf/mixtral"), dir_ + "/hf", fs::copy_options::recursive);
    nlohmann::json c;
    std::ifstream(fixture("hf/mixtral/config.json")) >> c;
    c["hidden_size"] = 1000000000000LL;
    fs::create_directories(dir_ + "/hf_huge");
    write("hf_huge/config.json", c.dump());
    fs::copy(fixture("hf/mixtral/model.safetensors"), dir_ + "/hf_huge/model.safetensors");
    // An HF config.json with wrongly typed keys, for the planner.
    c = nlohmann::json::parse(R"({"model_type": 5, "vocab_size": 96, "hidden_size": 32,
      "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64})");
    write("typed_model_type.json", c.dump());
    c["model_type"] = "llama";
    c["tie_word_embeddings"] = "yes";
    write("typed_tie.json", c.dump());
    c.erase("tie_word_embeddings");
    c["hidden_size"] = 1e30;
    write("typed_float.json", c.dump());
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string fixture(const std::string& rel) {
    return moecore::testing::source_dir() + "/tests/fixtures/" + rel;
  }
  void write(const std::string& rel, const std::string& text) const {
    std::ofstream(dir_ + "/" + rel) << text;
  }
  // A moecore checkpoint converted from the Mixtral fixture, at dir/name.
  void converted(const std::string& name) const {
    const CommandResult r = moecore::testing::run_moecore(
        "convert hf-to-moecore --input " + fixture("hf/mixtral") + " --output " + dir_ + "/" + name);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  // Edits the manifest of dir/name's iteration 0 with `edit`.
  template <typename F>
  void edit_manifest(const std::string& name, F edit) const {
    const std::string p = dir_ + "/" + name + "/iter_0000000/manifest.json";
    nlohmann::json j;
    std::ifstream(p) >> j;
    edit(j);
    std::ofstream(p) << j.dump();
  }

  void expect_rows(const std::vector<BadInput>& rows) const {
    const std::string src = moecore::testing::source_dir();
    for (const BadInput& row : rows) {
      std::string args = replace_all(row.args, "{dir}", dir_);
      args = replace_all(args, "{fx}", src + "/tests/fixtures");
      args = replace_all(args, "{src}", src);
      const CommandResult r = moecore::testing::run_command(
          "cd " + dir_ + " && timeout " + std::to_string(kHangSeconds) + " " +
          moecore::testing::moecore_binary() + " " + args);
      ASSERT_NE(r.exit_code, 124) << "hung (over " << kHangSeconds << " s): " << args;
      EXPECT_LT(r.seconds, 20) << "took " << r.seconds << " s: " << args;
      EXPECT_TRUE(!args.starts_with("train") || r.output.find(" iteration ") == std::string::npos)
          << "trained: " << args;
      EXPECT_LT(r.exit_code, 128) << "ended by a signal: " << args << "\n" << r.output;
      EXPECT_EQ(r.exit_code, row.exit_code) << args << "\n" << r.output;
      for (const std::string& word : row.words) {
        const std::string w = replace_all(word, "{dir}", dir_);
        EXPECT_NE(r.output.find(w), std::string::npos)
            << "'" << w << "' missing: " << args << "\n" << r.output;
      }
      // A user's message: no escaped library exception, no generic fallback.
      for (const char* leak : {"type_error", "[json.exception", "unexpected internal error",
                               "error: out of memory", "terminate called"}) {
        EXPECT_EQ(r.output.find(leak), std::string::npos) << leak << ": " << args << "\n"
                                                          << r.output;
      }
    }
  }

  std::string dir_;
};

TEST_F(BadInputs, Train) {
  const std::string t = "train " + kModel + " ";
  expect_rows({
      {t + "--hidden-size 0", 1, {"--hidden-size 0 is out of range: it must be >= 1"}},
      {t + "--ffn-hidden-size -5", 1, {"--ffn-hidden-size -5 is out of range"}},
      {t + "--num-experts 4 --moe-ffn-hidden-size 0", 1, {"--moe-ffn-hidden-size 0 is out of range"}},
      {t + "--moe-expert-capacity-factor nan --num-experts 4", 1, {"is not a finite number"}},
      {t + "--lr 1e400", 1, {"--lr 1e400 is not a finite number"}},
      {t + "--seed -1", 1, {"--seed -1 is out of range"}},
      {t + "--num-layers 99999999999999999999", 1, {"does not fit in 64 bits"}},
      {t + "--config {dir}/subdir", 1, {"is a directory: give a TOML file"}},
      {t + "--config {dir}/missing.toml", 1, {"missing.toml' does not exist"}},
      {t + "--config {dir}/bad.json", 1, {"[config] cannot read"}},
      {t + "--metrics-file {dir}/subdir", 1, {"is a directory: give a file name"}},
      {t + "--save {dir}/afile", 1, {"is not a directory"}},
      {t + "--load {dir}/afile", 1, {"is a file, not a checkpoint directory"}},
      {t + "--data-path {dir}/subdir --tokenizer-type NullTokenizer --vocab-size 64", 1,
       {"is a directory"}},
      // Sizes no machine holds: stopped before anything is built or zeroed.
      {t + "--num-layers 100000000", 1, {"[memory] the model needs at least"}},
      {t + "--micro-batch-size 100000000 --global-batch-size 100000000", 1, {"[memory]"}},
      {t + "--seq-length 1000000000 --max-position-embeddings 1000000000", 1,
       {"[memory] the model needs at least", "micro-batch of 2 x 1000000000 tokens"}},
      {t + "--seq-length 1000000000 --max-position-embeddings 1000000000 "
           "--position-embedding-type rope", 1, {"[memory] the model needs at least"}},
      {t + "--no-such-flag", 1, {"unrecognized argument --no-such-flag"}},
      // Tensor parallelism trains; its layout is checked against the world before any work.
      {t + "--tensor-model-parallel-size 2 --sequence-parallel", 1,
       {"world size 1 is not divisible by tp*cp*pp = 2*1*1 = 2"}},
      // Context parallelism: its layout, its comm types and what it is not built with yet.
      {t + "--context-parallel-size 2", 1,
       {"world size 1 is not divisible by tp*cp*pp = 1*2*1 = 2"}},
      {t + "--context-parallel-size 2 --cp-comm-type a2a", 1,
       {"--cp-comm-type a2a: the all-to-all (Ulysses) forms of context parallelism are not "
        "built"}},
      {t + "--context-parallel-size 2 --cp-comm-type ring", 1,
       {"--cp-comm-type ring is not one of p2p, allgather"}},
      {t + "--context-parallel-size 2 --mtp-num-layers 1 --position-embedding-type "
           "learned_absolute", 1,
       {"--context-parallel-size 2 with --mtp-num-layers and --position-embedding-type "
        "learned_absolute", "is not implemented yet"}},
      {t + "--context-parallel-size 2 --pipeline-model-parallel-size 2", 1,
       {"world size 1 is not divisible by tp*cp*pp = 1*2*2 = 4"}},
      {t + "--context-parallel-size 2 --seq-length 14 --max-position-embeddings 14", 1,
       {"--seq-length 14 must divide by 2 x --context-parallel-size = 4", "use --seq-length 16"}},
      {t + "--context-parallel-size 2 --cp-comm-type p2p p2p p2p", 1,
       {"--cp-comm-type has 3 values for"}},
      {t + "--context-parallel-size 2 --hierarchical-context-parallel-sizes 2 1", 1,
       {"--hierarchical-context-parallel-sizes", "hierarchical context parallelism"}},
  });
}

TEST_F(BadInputs, Plan) {
  const std::string tiny = "plan --config {src}/configs/tiny.toml";
  expect_rows({
      {tiny + " --num-layers 1000000", 1, {"--num-layers=1000000 must be in [1, 65536]"}},
      {tiny + " --num-layers -3", 1, {"--num-layers -3 is out of range: it must be >= 1"}},
      {tiny + " --hidden-size -1", 1, {"--hidden-size -1 is out of range: it must be >= 1"}},
      {tiny + " --ffn-hidden-size -5", 1, {"--ffn-hidden-size -5 is out of range: it must be >= 1"}},
      {tiny + " --moe-ffn-hidden-size 0", 1, {"--moe-ffn-hidden-size 0 is out of range: it must be >= 1"}},
      {tiny + " --kv-channels 0", 1, {"--kv-channels 0 is out of range: it must be >= 1"}},
      {tiny + " --global-batch-size -1", 1, {"--global-batch-size -1 is out of range: it must be >= 1"}},
      {tiny + " --hidden-size 1000000000000", 1, {"bytes of parameters", "more than any machine"}},
      {tiny + " --moe-expert-capacity-factor nan", 1, {"--moe-expert-capacity-factor nan"}},
      {tiny + " --gpus 1000000000000", 1, {"--gpus=1000000000000 must be >= 1 and <= 131072"}},
      {tiny + " --gpus 2.5", 1, {"--gpus takes a whole number, got '2.5'"}},
      {tiny + " --gpus 0", 1, {"--gpus=0 must be >= 1"}},
      {tiny + " --search --gpus 8 --top 0", 1, {"--top=0 must be >= 1"}},
      {tiny + " --device-memory-gib inf", 1, {"--device-memory-gib takes a finite number"}},
      {tiny + " --peak-tflops nan", 1, {"--peak-tflops nan is not a finite number"}},
      {tiny + " --hbm-tbps -1", 1, {"--hbm-tbps=-1 must be > 0"}},
      {tiny + " --reserved-gib -5", 1, {"--reserved-gib=-5 must be >= 0"}},
      {"plan --hf-config {dir}/subdir", 1, {"is a directory: give its config.json"}},
      {"plan --hf-config {dir}/typed_model_type.json", 1, {"\"model_type\" is 5, not a string"}},
      {"plan --hf-config {dir}/typed_tie.json", 1,
       {"\"tie_word_embeddings\" is \"yes\", not true or false"}},
      {"plan --hf-config {dir}/typed_float.json", 1, {"\"hidden_size\" is 1e+30, not an integer"}},
  });
}

TEST_F(BadInputs, DatasetInfoAndPreprocess) {
  const std::string info =
      "dataset-info --data-path {fx}/data/preprocess_bytelevel_text_document --seq-length 16";
  const std::string pre = "preprocess --output-prefix {dir}/out --input ";
  expect_rows({
      {info + " --train-samples 1000000000000", 1,
       {"1000000000000 samples of 17 tokens", "TiB", "more than this machine's"}},
      // A sample longer than the whole split: refused before any index is sized or built.
      {"dataset-info --data-path {fx}/data/preprocess_bytelevel_text_document --seq-length "
       "1000000000000 --train-samples 10",
       1, {"fewer than one sample of --seq-length 1000000000000 + 1 = 1000000000001 tokens",
           "none of the 10 samples", "give --seq-length at most"}},
      {"dataset-info --mock-data --seq-length 16 --train-samples 1000000000000", 1,
       {"1000000000000 samples of 17 tokens", "more than this machine's"}},
      {info + " --train-samples 10 --split a,b", 1, {"--split 'a,b': 'a' is not a number"}},
      {info + " --train-samples 10 --split -1,2,0", 1, {"'-1' is not a number"}},
      {info + " --train-samples 10 --split nan,1,1", 1, {"'nan' is not a number"}},
      {info + " --train-samples 10 --valid-samples -1", 1, {"--valid-samples=-1"}},
      {info + " --train-samples 10 --dump-samples -1", 1, {"--dump-samples=-1 must be >= 0"}},
      {"dataset-info --data-path {fx}/data/preprocess_bytelevel_text_document --seq-length 0 "
       "--train-samples 10",
       1, {"--seq-length=0 must be > 1"}},
      {info + " --train-samples 0", 1, {"--train-samples=0 must be >= 1"}},
      {"dataset-info --data-path {dir}/subdir --seq-length 16 --train-samples 10", 1,
       {"is a directory"}},
      {info + " --train-samples 10 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
              "{dir}/subdir",
       1, {"does not exist"}},
      {info + " --train-samples 10 --tokenizer-type GPT2BPETokenizer --vocab-file {dir}/subdir "
              "--merge-file {dir}/afile",
       1, {"--vocab-file", "is a directory"}},
      {pre + "{dir}/null_ids.jsonl --tokenizer-type NullTokenizer --vocab-size 100", 1,
       {"token id 40000 is outside the vocabulary [0, 100) of --vocab-size 100"}},
      {pre + "{dir}/null_ids.jsonl --tokenizer-type NullTokenizer --vocab-size 0", 1,
       {"NullTokenizer needs --vocab-size >= 2, not 0"}},
      {pre + "{dir}/null_ids.jsonl --tokenizer-type ByteLevel --workers 100000", 1,
       {"--workers 100000 is more than 1024 threads"}},
      {pre + "{dir}/null_ids.jsonl --tokenizer-type ByteLevel --log-interval -1", 1,
       {"--log-interval -1 must be >= 1"}},
      {pre + "{dir}/subdir --tokenizer-type ByteLevel", 1, {"is a directory"}},
  });
  // A preprocess that stops leaves no half-written dataset under the output prefix.
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    EXPECT_FALSE(name.ends_with(".bin") || name.ends_with(".idx") ||
                 name.find(".tmp.") != std::string::npos)
        << "left behind: " << name;
  }
}

TEST_F(BadInputs, Convert) {
  converted("ckpt");
  const std::string to_moecore = "convert hf-to-moecore --input ";
  const std::string to_hf = "convert moecore-to-hf --input {dir}/ckpt --output ";
  expect_rows({
      {to_moecore + "{dir}/hf_huge --output {dir}/out", 1,
       {"hidden_size 1000000000000", "parameters", "more than this machine's"}},
      {to_moecore + "{dir}/hf --output {dir}/afile", 1,
       {"--output '{dir}/afile' is a file, not a directory"}},
      {to_moecore + "{dir}/hf --output {dir}/afile/sub", 1, {"cannot be created", "is a file"}},
      {to_moecore + "{dir}/hf --output /proc/moecore_nope/x", 1, {"cannot be created"}},
      {to_moecore + "{dir}/hf --output {dir}/hf", 1, {"(an HF checkpoint) already"}},
      {to_moecore + "{dir}/hf --output {dir}/ckpt", 1, {"(a moecore checkpoint) already"}},
      {to_hf + "{dir}/ckpt", 1, {"(a moecore checkpoint) already"}},
      {to_hf + "{dir}/hf", 1, {"(an HF checkpoint) already"}},
      {to_hf + "{dir}/afile", 1, {"is a file, not a directory"}},
      {"convert moecore-to-hf --input {dir}/afile --output {dir}/x", 1, {"neither a checkpoint"}},
  });
  EXPECT_FALSE(fs::exists(dir_ + "/out")) << "a refused conversion created its --output";
}

TEST_F(BadInputs, CheckpointManifestState) {
  const std::vector<std::pair<std::string, void (*)(nlohmann::json&)>> edits = {
      {"state.model has no \"--num-layers\"", [](nlohmann::json& j) { j["state"]["model"] = nlohmann::json::object(); }},
      {"state.model is \"x\", not an object",
       [](nlohmann::json& j) { j["state"]["model"] = "x"; }},
      {"state.has_optimizer is \"yes\", not true or false",
       [](nlohmann::json& j) { j["state"]["has_optimizer"] = "yes"; }},
      {"state.iteration is \"0\", not an integer",
       [](nlohmann::json& j) { j["state"]["iteration"] = "0"; }},
      {"state.hf.architecture is 5, not a string",
       [](nlohmann::json& j) { j["state"]["hf"]["architecture"] = 5; }},
      {"state.args holds 1, not a string", [](nlohmann::json& j) { j["state"]["args"] = {1}; }},
      {"state.model.--num-experts is \"4\", not an integer",
       [](nlohmann::json& j) { j["state"]["model"]["--num-experts"] = "4"; }},
      {"state.consumed_train_samples is -3, not a count >= 0",
       [](nlohmann::json& j) { j["state"]["consumed_train_samples"] = -3; }},
  };
  std::vector<BadInput> rows;
  for (size_t i = 0; i < edits.size(); ++i) {
    const std::string name = fmt::format("c{}", i);  // not "c" + to_string: GCC 12's -Wrestrict
    converted(name);
    edit_manifest(name, edits[i].second);
    rows.push_back({"checkpoint info {dir}/" + name, 1, {edits[i].first}});
    rows.push_back({"convert moecore-to-hf --input {dir}/" + name + " --output {dir}/o" + name,
                    1, {edits[i].first}});
  }
  rows.push_back({"checkpoint compare {dir}/c0 {dir}/c1", 2, {"state.model has no"}});
  expect_rows(rows);
}

TEST_F(BadInputs, EvalAndGroups) {
  converted("ckpt");
  const std::string eval = "eval --load {dir}/ckpt --config {dir}/ckpt/moecore_flags.toml "
                           "--seq-length 16 --tokens-json ";
  expect_rows({
      {eval + "{dir}/empty_seqs.json", 1, {"its 3 sequence(s) hold nothing to score"}},
      {eval + "{dir}/one_token.json", 1, {"its 1 sequence(s) hold nothing to score"}},
      {eval + "{dir}/subdir", 1, {"is a directory"}},
      {"eval " + kModel + " --load {dir}/subdir --tokens-json {dir}/tokens.json", 1,
       {"holds no checkpoint"}},
      {"eval " + kModel + " --load {dir}/afile --tokens-json {dir}/tokens.json", 1,
       {"a checkpoint directory"}},
      {"eval " + kModel + " --hidden-size -1 --load {dir}/subdir --tokens-json {dir}/tokens.json",
       1, {"--hidden-size -1 is out of range"}},
      {"groups --world-size 0", 1, {"world size 0 must be in [1, 131072]"}},
      {"groups --world-size 100000000", 1, {"world size 100000000 must be in [1, 131072]"}},
      {"groups --world-size 8 --num-layers -1", 1, {"--num-layers -1 must be >= 1"}},
      {"groups --world-size 8 --num-experts -3", 1, {"--num-experts -3 must be >= 0"}},
      {"groups --world-size 8 --rank 99", 1, {"--rank 99 outside the world of 8 ranks"}},
      {"groups --world-size 8 --rank -2", 1, {"--rank -2 outside the world of 8 ranks"}},
      {"groups --world-size 8 --expert-model-parallel-size 3", 1, {"not divisible"}},
      {"groups --world-size 8 --distributed-timeout-minutes 0", 1,
       {"--distributed-timeout-minutes 0 must be > 0"}},
      {"groups --world-size 8 --tensor-model-parallel-size -2", 1,
       {"--tensor-model-parallel-size -2 must be >= 1"}},
      {"groups --world-size 8 --rank 8", 1, {"--rank 8 outside the world of 8 ranks"}},
  });
}

}  // namespace
