#include "data/preprocess.h"

#include <fmt/ostream.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string_view>

#include "core/check.h"
#include "data/indexed_dataset.h"
#include "data/mapped_file.h"

namespace moecore::data {

std::string preprocess_output_prefix(const std::string& prefix, const std::string& key) {
  return fmt::format("{}_{}_document", prefix, key);
}

namespace {

struct EncodedDoc {
  std::vector<int64_t> ids;      // per key, concatenated
  std::vector<int32_t> lengths;  // per key, concatenated
  std::vector<size_t> key_ids_end, key_len_end;  // per key: end offsets into ids / lengths
};

// preprocess_data.py's Encoder.encode for one document (no sentence splitting): every sentence
// (the text, or each item of a list) tokenized; empty ones dropped; eod appended to the last.
void encode_text(const Tokenizer& tok, const std::vector<std::string_view>& sentences,
                 bool append_eod, EncodedDoc& d) {
  const size_t ids_begin = d.ids.size();
  for (std::string_view s : sentences) {
    const size_t before = d.ids.size();
    tok.tokenize(s, d.ids);
    const size_t n = d.ids.size() - before;
    if (n > 0) d.lengths.push_back(static_cast<int32_t>(n));
  }
  if (append_eod && d.ids.size() > ids_begin) {
    d.ids.push_back(tok.eod());
    d.lengths.back() += 1;
  }
  d.key_ids_end.push_back(d.ids.size());
  d.key_len_end.push_back(d.lengths.size());
}

void encode_line(const Tokenizer& tok, const PreprocessConfig& cfg, bool jsonl,
                 std::string_view line, int64_t line_no, EncodedDoc& d) {
  d.ids.clear();
  d.lengths.clear();
  d.key_ids_end.clear();
  d.key_len_end.clear();
  if (!jsonl) {
    encode_text(tok, {line}, cfg.append_eod, d);
    return;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("[preprocess] '{}' line {} is not JSON: {}", cfg.input, line_no, e.what());
  }
  MOE_CHECK(j.is_object(), "[preprocess] '{}' line {} is not a JSON object", cfg.input, line_no);
  for (const std::string& key : cfg.json_keys) {
    auto it = j.find(key);
    MOE_CHECK(it != j.end(), "[preprocess] '{}' line {} has no key \"{}\" (--json-keys)",
              cfg.input, line_no, key);
    std::vector<std::string_view> sentences;
    if (it->is_string()) {
      sentences.push_back(it->get_ref<const std::string&>());
    } else {
      MOE_CHECK(it->is_array(), "[preprocess] '{}' line {}: \"{}\" is neither a string nor a list",
                cfg.input, line_no, key);
      for (const auto& s : *it) {
        MOE_CHECK(s.is_string(), "[preprocess] '{}' line {}: \"{}\" holds a non-string",
                  cfg.input, line_no, key);
        sentences.push_back(s.get_ref<const std::string&>());
      }
    }
    encode_text(tok, sentences, cfg.append_eod, d);
  }
}

// Python's len(json_line): the characters of the line including its newline (UTF-8 code
// points), which preprocess_data.py reports as bytes processed.
int64_t python_len(std::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

PreprocessStats preprocess(const PreprocessConfig& cfg, std::ostream& log) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto tok = make_tokenizer(cfg.tokenizer);
  bool jsonl = cfg.input_format == "jsonl";
  if (cfg.input_format == "auto") {
    const std::string& p = cfg.input;
    jsonl = p.size() >= 5 && (p.ends_with(".jsonl") || p.ends_with(".json"));
  } else {
    MOE_CHECK(cfg.input_format == "jsonl" || cfg.input_format == "text",
              "[preprocess] --input-format {}: use auto, jsonl or text", cfg.input_format);
  }
  MOE_CHECK(!cfg.output_prefix.empty(), "[preprocess] --output-prefix is required");
  MOE_CHECK(jsonl || cfg.json_keys.size() == 1,
            "[preprocess] plain text input has one document per line: --json-keys applies to "
            "JSON lines only");
  MappedFile in(cfg.input, "--input");
  const std::string_view text(reinterpret_cast<const char*>(in.data()), in.size());

  const TokenDType dtype = optimal_dtype(tok->vocab_size());
  // A missing output folder is created (as `--output-prefix data/corpus` suggests).
  if (const auto dir = std::filesystem::path(cfg.output_prefix).parent_path(); !dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    MOE_CHECK(!ec, "[preprocess] cannot create the folder '{}' of --output-prefix: {}",
              dir.string(), ec.message());
  }
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  PreprocessStats st;
  for (const std::string& key : cfg.json_keys) {
    const std::string prefix = preprocess_output_prefix(cfg.output_prefix, key);
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(prefix + ".bin", dtype));
    st.outputs.push_back(prefix);
  }
  st.tokens.assign(cfg.json_keys.size(), 0);
  fmt::print(log, "[preprocess] '{}' ({} bytes, {}) with {} -> {} ({} tokens)\n", cfg.input,
             in.size(), jsonl ? "JSON lines" : "plain text, a document per line", tok->describe(),
             fmt::join(st.outputs, ", "), dtype_name(dtype));

  const int workers = cfg.workers > 0 ? cfg.workers : omp_get_max_threads();
  constexpr size_t kBlockBytes = 8 << 20;  // lines tokenized together, then written in order
  std::vector<std::string_view> lines;
  std::vector<EncodedDoc> docs;
  int64_t line_no = 0, next_log = cfg.log_interval, chars = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    lines.clear();
    size_t block_end = std::min(text.size(), pos + kBlockBytes);
    while (pos < block_end || (lines.empty() && pos < text.size())) {
      size_t nl = text.find('\n', pos);
      const size_t end = nl == std::string_view::npos ? text.size() : nl + 1;
      lines.push_back(text.substr(pos, end - pos));
      pos = end;
    }
    docs.resize(std::max(docs.size(), lines.size()));
    const int64_t first_line = line_no + 1;
    std::string error;
#pragma omp parallel for schedule(dynamic, 64) num_threads(workers)
    for (int64_t i = 0; i < static_cast<int64_t>(lines.size()); ++i) {
      std::string_view l = lines[i];
      const std::string_view full = l;
      if (!l.empty() && l.back() == '\n') l.remove_suffix(1);
      if (!jsonl && !l.empty() && l.back() == '\r') l.remove_suffix(1);
      try {
        encode_line(*tok, cfg, jsonl, jsonl ? full : l, first_line + i, docs[i]);
      } catch (const std::exception& e) {
#pragma omp critical
        if (error.empty()) error = e.what();
      }
    }
    if (!error.empty()) throw Error(error);
    for (size_t i = 0; i < lines.size(); ++i) {
      const EncodedDoc& d = docs[i];
      size_t ib = 0, lb = 0;
      for (size_t k = 0; k < builders.size(); ++k) {
        const size_t ie = d.key_ids_end[k], le = d.key_len_end[k];
        builders[k]->add_document(std::span<const int64_t>(d.ids.data() + ib, ie - ib),
                                  std::span<const int32_t>(d.lengths.data() + lb, le - lb));
        st.tokens[k] += static_cast<int64_t>(ie - ib);
        ib = ie;
        lb = le;
      }
      chars += python_len(lines[i]);
      ++line_no;
      if (cfg.log_interval > 0 && line_no >= next_log) {
        next_log += cfg.log_interval;
        const double el =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        fmt::print(log, "Processed {} documents ({:.1f} docs/s, {:.2f} MB/s).\n", line_no,
                   line_no / el, chars / el / 1024 / 1024);
      }
    }
  }
  for (size_t k = 0; k < builders.size(); ++k) builders[k]->finalize(st.outputs[k] + ".idx");
  st.documents = line_no;
  st.input_bytes = static_cast<int64_t>(in.size());
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t total_tokens = 0;
  for (int64_t t : st.tokens) total_tokens += t;
  fmt::print(log,
             "[preprocess] {} documents, {} tokens in {:.3f} s: {:.2f} MB/s of text, {:.0f} "
             "tokens/s ({} threads)\n",
             st.documents, total_tokens, st.seconds, st.input_bytes / st.seconds / 1e6,
             total_tokens / st.seconds, workers);
  return st;
}

}  // namespace moecore::data
