// Every tokenizer against the ids the real libraries give (tests/fixtures/tokenizers/, made by
// tools/make_tokenizer_fixtures.py with HuggingFace tokenizers, tiktoken and sentencepiece):
// each line of a multilingual corpus (ASCII, accents, CJK, emoji, digits, whitespace runs,
// \r\n, contractions, special tokens in the text), id for id, with the vocabulary size and eod
// Megatron reports; `moecore preprocess` with each writes those ids; refusals name what is
// missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/command.h"
#include "common/paths.h"
#include "core/check.h"
#include "data/indexed_dataset.h"
#include "data/pretokenizer.h"
#include "data/tokenizer.h"
#include "data/unicode_classes.h"
#include "data/unicode_nfc.h"

namespace moecore::data {
namespace {

std::string fixture(const std::string& name) {
  return ::moecore::testing::source_dir() + "/tests/fixtures/tokenizers/" + name;
}

const nlohmann::json& reference() {
  static const nlohmann::json j = [] {
    std::ifstream in(fixture("reference.json"));
    return nlohmann::json::parse(in);
  }();
  return j;
}

// reference.json key -> the tokenizer flags.
struct Case {
  std::string key;
  TokenizerConfig cfg;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  TokenizerConfig g;
  g.type = "GPT2BPETokenizer";
  g.vocab_file = fixture("gpt2-vocab.json");
  g.merge_file = fixture("gpt2-merges.txt");
  out.push_back({"GPT2BPETokenizer", g});
  for (const char* dir : {"hf_gpt2", "hf_llama3", "hf_qwen2"}) {
    TokenizerConfig h;
    h.type = "HuggingFaceTokenizer";
    h.tokenizer_model = fixture(dir);  // the directory, as Megatron takes it
    out.push_back({std::string("HuggingFaceTokenizer:") + dir, h});
  }
  for (const char* model : {"sp_bpe", "sp_unigram"}) {
    for (const char* type :
         {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"}) {
      TokenizerConfig s;
      s.type = type;
      s.tokenizer_model = fixture(std::string(model) + ".model");
      out.push_back({std::string(type) + ":" + model, s});
    }
  }
  return out;
}

TEST(Tokenizers, EveryIdMatchesTheRealLibraries) {
  const nlohmann::json& ref = reference();
  const auto& lines = ref["lines"];
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.key);
    ASSERT_TRUE(ref.contains(c.key));
    const nlohmann::json& r = ref[c.key];
    const auto tok = make_tokenizer(c.cfg);
    EXPECT_EQ(tok->vocab_size(), r["vocab_size"].get<int64_t>());
    EXPECT_EQ(tok->eod(), r["eod"].get<int64_t>());
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string text = lines[i].get<std::string>();
      EXPECT_EQ(tok->tokenize(text), r["ids"][i].get<std::vector<int64_t>>())
          << "line " << i << ": '" << text << "'";
    }
  }
}

// ByteLevel's add_prefix_space, on a copy of hf_gpt2's tokenizer.json with it set.
TEST(Tokenizers, HuggingFaceAddPrefixSpace) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("moecore_tok_prefix." + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  nlohmann::json j;
  {
    std::ifstream in(fixture("hf_gpt2/tokenizer.json"));
    j = nlohmann::json::parse(in);
  }
  j["pre_tokenizer"]["add_prefix_space"] = true;
  std::ofstream(dir / "tokenizer.json") << j.dump();
  std::filesystem::copy_file(fixture("hf_gpt2/tokenizer_config.json"),
                             dir / "tokenizer_config.json");
  TokenizerConfig c;
  c.type = "HuggingFaceTokenizer";
  c.tokenizer_model = dir.string();
  const auto tok = make_tokenizer(c);
  const nlohmann::json& r = reference()["HuggingFaceTokenizer:hf_gpt2+add_prefix_space"];
  const auto& lines = reference()["lines"];
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string text = lines[i].get<std::string>();
    EXPECT_EQ(tok->tokenize(text), r["ids"][i].get<std::vector<int64_t>>())
        << "line " << i << ": '" << text << "'";
  }
  std::filesystem::remove_all(dir);
}

TEST(Tokenizers, HuggingFaceTokenizerTakesTheFileOrItsDirectory) {
  TokenizerConfig h;
  h.type = "HuggingFaceTokenizer";
  h.tokenizer_model = fixture("hf_llama3/tokenizer.json");
  const auto a = make_tokenizer(h);
  h.tokenizer_model = fixture("hf_llama3");
  const auto b = make_tokenizer(h);
  EXPECT_EQ(a->tokenize("Hello <|end_of_text|> world"), b->tokenize("Hello <|end_of_text|> world"));
  EXPECT_EQ(a->eod(), b->eod());
}

// Pieces of the pre-tokenizer scanners on the regex's hard cases (each checked by hand against
// the regex's leftmost-alternative semantics).
TEST(Tokenizers, PreTokenizerScannersSplitAsTheRegexes) {
  auto split = [](PreTokenizerPattern p, std::string_view s) {
    std::vector<std::string_view> v;
    pretokenize(p, s, v);
    return std::vector<std::string>(v.begin(), v.end());
  };
  using V = std::vector<std::string>;
  const auto G = PreTokenizerPattern::Gpt2, L = PreTokenizerPattern::Llama3,
             Q = PreTokenizerPattern::Qwen2;
  EXPECT_EQ(split(G, "it's  a   b\n"), (V{"it", "'s", " ", " a", "  ", " b", "\n"}));
  EXPECT_EQ(split(G, "IT'S 12345 ok!!"), (V{"IT", "'", "S", " 12345", " ok", "!!"}));
  EXPECT_EQ(split(G, "x   "), (V{"x", "   "}));
  EXPECT_EQ(split(L, "IT'S 12345\r\n\n  x"),
            (V{"IT", "'S", " ", "123", "45", "\r\n\n", " ", " x"}));
  EXPECT_EQ(split(L, "\thi ..\n\nok"), (V{"\thi", " ..\n\n", "ok"}));
  EXPECT_EQ(split(Q, "12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split(G, "日本語 abc"), (V{"日本語", " abc"}));
  EXPECT_EQ(split(G, ""), V{});
  EXPECT_THROW(pretokenizer_pattern_from_regex("\\w+"), Error);
}

TEST(Tokenizers, UnicodeClasses) {
  EXPECT_TRUE(is_letter('a') && is_letter(0x00E9) && is_letter(0x6771) && is_letter(0x1D518));
  EXPECT_FALSE(is_letter('1') || is_letter(' ') || is_letter(0x1F600) || is_letter(0x0301));
  EXPECT_TRUE(is_number('7') && is_number(0x0663) && is_number(0x00BD) && is_number(0x216B));
  EXPECT_TRUE(is_whitespace(0x3000) && is_whitespace('\r') && !is_whitespace(0x200B));
  size_t n = 0;
  EXPECT_EQ(decode_utf8("\xF0\x9F\x98\x80", 0, &n), 0x1F600u);
  EXPECT_EQ(n, 4u);
  EXPECT_EQ(decode_utf8("\xC0\xAF", 0, &n), 0xFFFDu);  // overlong
  EXPECT_EQ(n, 1u);
}

// NFC (Qwen2's normalizer) against Python's unicodedata: composition, singletons, exclusions,
// Hangul, canonical reordering, blocked marks.
TEST(Tokenizers, NfcMatchesUnicodedata) {
  std::string out;
  for (const auto& pair : reference()["nfc"]) {
    const std::string in = pair[0].get<std::string>();
    nfc_normalize(in, out);
    EXPECT_EQ(out, pair[1].get<std::string>()) << "'" << in << "'";
  }
  nfc_normalize("a\xFF\xC3", out);  // malformed bytes kept
  EXPECT_EQ(out, "a\xFF\xC3");
}

TEST(Tokenizers, RefusalsNameWhatIsMissing) {
  auto fails_with = [](const TokenizerConfig& c, const std::string& what) {
    try {
      make_tokenizer(c);
      ADD_FAILURE() << "accepted " << c.type;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  TokenizerConfig c;
  c.type = "GPT2BPETokenizer";
  fails_with(c, "--vocab-file is required");
  c.vocab_file = fixture("gpt2-vocab.json");
  c.merge_file = fixture("nope.txt");
  fails_with(c, "nope.txt");
  c = {};
  c.type = "SentencePieceTokenizer";
  c.tokenizer_model = fixture("gpt2-vocab.json");
  fails_with(c, "is not a SentencePiece model");
  c = {};
  c.type = "BertWordPieceCase";
  fails_with(c, "is not implemented");
  // A tokenizer.json with a normalizer, another pattern, another model: refused by name.
  const auto dir =
      std::filesystem::temp_directory_path() / ("moecore_tok." + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  nlohmann::json j;
  {
    std::ifstream in(fixture("hf_llama3/tokenizer.json"));
    j = nlohmann::json::parse(in);
  }
  c = {};
  c.type = "HuggingFaceTokenizer";
  c.tokenizer_model = (dir / "t.json").string();
  auto with = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
    nlohmann::json k = j;
    edit(k);
    std::ofstream(dir / "t.json") << k.dump();
    fails_with(c, what);
  };
  with([](nlohmann::json& k) { k["normalizer"] = {{"type", "NFKC"}}; }, "normalizer NFKC");
  with(
      [](nlohmann::json& k) {
        k["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+";
      },
      "regex '\\w+' is not implemented");
  with([](nlohmann::json& k) { k["model"]["type"] = "WordPiece"; }, "model type WordPiece");
  with([](nlohmann::json& k) { k["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
       "add_prefix_space after a Split");
  // Malformed files (found by tests/fuzz/fuzz_hf_tokenizer): a missing or mistyped member is
  // named, never a json type_error, an assertion (a const operator[] on a missing key), or ids
  // past the vocabulary size.
  with([](nlohmann::json& k) { k["model"].erase("vocab"); },
       "the BPE model's \"vocab\" is null, not an object of token: id");
  with([](nlohmann::json& k) { k["model"]["merges"] = 5; },
       "the BPE model's \"merges\" is 5, not a list");
  with([](nlohmann::json& k) { k["model"]["merges"][0] = 7; }, "a merge is 7, not a string");
  with([](nlohmann::json& k) { k["model"]["vocab"]["!"] = "0"; },
       "token '!' has id \"0\", not an integer in [0, 2^31)");
  with([](nlohmann::json& k) { k["added_tokens"][0]["id"] = int64_t{1} << 40; },
       "added token '<|begin_of_text|>' has id 1099511627776, not an integer in [0, 2^31)");
  with([](nlohmann::json& k) { k["added_tokens"][0].erase("content"); },
       "an added token's content is null, not a string");
  with([](nlohmann::json& k) { k["pre_tokenizer"].erase("pretokenizers"); },
       "pre-tokenizer {\"type\":\"Sequence\"} is not implemented");
  with([](nlohmann::json& k) { k["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 1; },
       "a Split with behavior 1 invert false is not implemented");
  with([](nlohmann::json& k) { k["post_processor"].erase("special_tokens"); },
       "TemplateProcessing names the special token '<|begin_of_text|>' but its special_tokens "
       "do not define it");
  with([](nlohmann::json& k) { k["post_processor"]["special_tokens"]["<|begin_of_text|>"]["ids"] = {5000}; },
       "TemplateProcessing's special token '<|begin_of_text|>' has id 5000, outside the "
       "vocabulary of 700");
  // Two tokens sharing an id: 699 distinct ids, the largest 699.
  with([](nlohmann::json& k) { k["model"]["vocab"]["!"] = k["model"]["vocab"]["\""]; },
       "have 699 distinct ids but the largest is 699: ids must be 0..698 without gaps");
  // tokenizer_config.json's eos_token of another kind names no eos (eod() says so).
  std::ofstream(dir / "t.json") << j.dump();
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": {"content": 5}})";
  EXPECT_THROW(make_tokenizer(c)->eod(), Error);
  std::ofstream(dir / "tokenizer_config.json") << "[1]";
  EXPECT_THROW(make_tokenizer(c)->eod(), Error);
  std::filesystem::remove(dir / "tokenizer_config.json");
  // GPT-2's vocab.json likewise: its ids are the embedding rows, 0..n-1.
  {
    nlohmann::json v;
    std::ifstream in(fixture("gpt2-vocab.json"));
    v = nlohmann::json::parse(in);
    v["!"] = v["\""];
    std::ofstream(dir / "vocab.json") << v.dump();
    TokenizerConfig g;
    g.type = "GPT2BPETokenizer";
    g.vocab_file = (dir / "vocab.json").string();
    g.merge_file = fixture("gpt2-merges.txt");
    fails_with(g, "but the 700 tokens must have the ids 0..699, each once");
  }
  // No tokenizer_config.json: no eos, and eod says so.
  std::ofstream(dir / "t.json") << j.dump();
  const auto t = make_tokenizer(c);
  EXPECT_THROW(t->eod(), Error);
  std::filesystem::remove_all(dir);
}

using moecore::testing::CommandResult;

CommandResult run(const std::string& args) { return moecore::testing::run_moecore(args); }

std::string flags(const TokenizerConfig& c) {
  std::string s = " --tokenizer-type " + c.type;
  if (!c.vocab_file.empty()) s += " --vocab-file " + c.vocab_file;
  if (!c.merge_file.empty()) s += " --merge-file " + c.merge_file;
  if (!c.tokenizer_model.empty()) s += " --tokenizer-model " + c.tokenizer_model;
  return s;
}

TEST(Tokenizers, PreprocessWritesTheReferenceTokens) {
  const nlohmann::json& ref = reference();
  const auto dir =
      std::filesystem::temp_directory_path() / ("moecore_tok_pre." + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.key);
    const std::string prefix = (dir / "out").string();
    const CommandResult r =
        run("preprocess --input " + fixture("test_corpus.jsonl") + " --output-prefix " + prefix +
            " --append-eod --workers 2" + flags(c.cfg));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const IndexedDataset ds(prefix + "_text_document");
    const nlohmann::json& want = ref[c.key]["ids"];
    const int64_t eod = ref[c.key]["eod"].get<int64_t>();
    ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(want.size()));
    int64_t seq = 0;
    for (size_t d = 0; d < want.size(); ++d) {
      std::vector<int64_t> ids = want[d].get<std::vector<int64_t>>();
      if (ids.empty()) continue;  // an empty document: no sequence
      ids.push_back(eod);
      ASSERT_EQ(ds.sequence_length(seq), static_cast<int32_t>(ids.size())) << "document " << d;
      std::vector<int32_t> got(ids.size());
      ds.get(seq++, 0, static_cast<int64_t>(ids.size()), got.data());
      EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), ids) << "document " << d;
    }
    EXPECT_EQ(ds.num_sequences(), seq);
  }
  std::filesystem::remove_all(dir);
}

// A tokenizer.json without tokenizer_config.json has no eos: --append-eod stops naming that,
// while preprocessing without it and reading the data (which needs no eod) work.
TEST(Tokenizers, NoEosStopsOnlyWhatNeedsIt) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("moecore_tok_noeos." + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "tok");
  std::filesystem::copy_file(fixture("hf_llama3/tokenizer.json"), dir / "tok" / "tokenizer.json");
  const std::string tok =
      " --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + (dir / "tok").string();
  const std::string prefix = (dir / "out").string();
  CommandResult r = run("preprocess --input " + fixture("test_corpus.jsonl") + " --output-prefix " +
                        prefix + " --append-eod" + tok);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no end-of-document token"), std::string::npos) << r.output;
  r = run("preprocess --input " + fixture("test_corpus.jsonl") + " --output-prefix " + prefix +
          tok);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run("dataset-info --data-path " + prefix + "_text_document --seq-length 4 --split 1,0,0" +
          " --train-samples 4" + tok);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moecore::data
