#include "data/gpt2_bpe_tokenizer.h"

#include <fmt/format.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "data/mapped_file.h"
#include "data/pretokenizer.h"

namespace moecore::data {

std::string read_tokenizer_file(const std::string& path, const std::string& flag) {
  MOE_CHECK(!path.empty(), "[tokenizer] {} is required", flag);
  const std::string why = unreadable_reason(path);
  MOE_CHECK(why.empty(), "[tokenizer] {} '{}': {}", flag, path, why);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "[tokenizer] {} '{}' cannot be opened", flag, path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file)
    : vocab_file_(vocab_file) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_tokenizer_file(vocab_file, "--vocab-file"));
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("[tokenizer] --vocab-file '{}' is not JSON: {}", vocab_file, e.what());
  }
  MOE_CHECK(j.is_object(), "[tokenizer] --vocab-file '{}' is not a JSON object of token: id",
            vocab_file);
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : j.items()) {
    // ids are int32 in the .bin and index the embedding: a negative or huge one is no token.
    MOE_CHECK(id.is_number_integer() && (id.is_number_unsigned() || id.get<int64_t>() >= 0) &&
                  id.get<uint64_t>() < (uint64_t{1} << 31),
              "[tokenizer] --vocab-file '{}': token '{}' has id {}, not an integer in [0, 2^31)",
              vocab_file, tok, id.dump());
    vocab.emplace(tok, id.get<int64_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream lines(read_tokenizer_file(merge_file, "--merge-file"));
  int64_t line_no = 0;
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    const size_t sp = line.find(' ');
    MOE_CHECK(sp != std::string::npos && sp > 0 && line.find(' ', sp + 1) == std::string::npos,
              "[tokenizer] --merge-file '{}' line {}: '{}' is not two tokens separated by a space",
              merge_file, line_no, line);
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  auto eod = vocab.find("<|endoftext|>");
  MOE_CHECK(eod != vocab.end(), "[tokenizer] --vocab-file '{}' has no <|endoftext|> token",
            vocab_file);
  eod_ = eod->second;
  vocab_size_ = static_cast<int64_t>(vocab.size());
  // The embedding has vocab_size rows: every id must be below it, i.e. the ids are 0..n-1 (a
  // gap or two tokens sharing an id would leave ids at or past it).
  std::vector<bool> seen(vocab.size());
  for (const auto& [tok, id] : vocab) {
    MOE_CHECK(id >= 0 && id < vocab_size_ && !seen[id],
              "[tokenizer] --vocab-file '{}': token '{}' has id {}, but the {} tokens must have "
              "the ids 0..{}, each once",
              vocab_file, tok, id, vocab_size_, vocab_size_ - 1);
    seen[id] = true;
  }
  added_.add("<|endoftext|>", eod_);
  bpe_ = std::make_unique<ByteLevelBpe>(
      vocab, merges, false,
      fmt::format("--vocab-file '{}' / --merge-file '{}'", vocab_file, merge_file));
}

void Gpt2BpeTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<std::string_view> pieces;
  for (size_t pos = 0; pos <= text.size();) {
    const AddedTokens::Match m = added_.find(text, pos);
    const size_t end = m.pos == std::string_view::npos ? text.size() : m.pos;
    pieces.clear();
    pretokenize(PreTokenizerPattern::Gpt2, text.substr(pos, end - pos), pieces);
    for (std::string_view p : pieces) bpe_->encode(p, out);
    if (m.pos == std::string_view::npos) break;
    out.push_back(m.id);
    pos = m.pos + m.length;
  }
}

std::string Gpt2BpeTokenizer::describe() const {
  return fmt::format("GPT2BPETokenizer ('{}', vocab {}, eod {})", vocab_file_, vocab_size_, eod_);
}

}  // namespace moecore::data
