#include "data/hf_tokenizer.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "data/gpt2_bpe_tokenizer.h"
#include "data/unicode_nfc.h"

namespace moecore::data {

namespace {

using nlohmann::json;

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                      : std::string("?");
}

bool flag(const json& j, const char* key, bool dflt) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : dflt;
}

}  // namespace

HuggingFaceTokenizer::HuggingFaceTokenizer(const std::string& tokenizer_model) {
  namespace fs = std::filesystem;
  MOE_CHECK(!tokenizer_model.empty(),
            "[tokenizer] HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its "
            "directory)");
  path_ = fs::is_directory(tokenizer_model)
              ? (fs::path(tokenizer_model) / "tokenizer.json").string()
              : tokenizer_model;
  const std::string what = fmt::format("--tokenizer-model '{}'", path_);
  json j;
  try {
    j = json::parse(read_tokenizer_file(path_, "--tokenizer-model"));
  } catch (const json::exception& e) {
    MOE_FAIL("[tokenizer] {} is not JSON: {}", what, e.what());
  }
  MOE_CHECK(j.is_object() && j.contains("model"),
            "[tokenizer] {} has no \"model\": not a "
            "HuggingFace tokenizer.json",
            what);
  const json& model = j["model"];
  MOE_CHECK(type_of(model) == "BPE",
            "[tokenizer] {}: model type {} is not implemented: moecore reads byte-level BPE "
            "tokenizer.json files (GPT-2, Llama-3, Qwen2 style)",
            what, type_of(model));
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    MOE_CHECK(!model.contains(k) || model[k].is_null() || model[k] == "",
              "[tokenizer] {}: BPE {} {} is not implemented", what, k, model[k].dump());
  }
  MOE_CHECK(!model.contains("dropout") || model["dropout"].is_null(),
            "[tokenizer] {}: BPE dropout {} is not implemented (it samples)", what,
            model["dropout"].dump());
  MOE_CHECK(!flag(model, "byte_fallback", false),
            "[tokenizer] {}: BPE byte_fallback is not implemented", what);

  // Normalizer: none, or NFC (Qwen2's).
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const json& n = j["normalizer"];
    const bool lone_nfc = type_of(n) == "Sequence" && n["normalizers"].is_array() &&
                          n["normalizers"].size() == 1 && type_of(n["normalizers"][0]) == "NFC";
    MOE_CHECK(type_of(n) == "NFC" || lone_nfc,
              "[tokenizer] {}: normalizer {} is not implemented: moecore reads tokenizer.json "
              "files without a normalizer or with NFC",
              what, type_of(n) == "Sequence" ? n.dump().substr(0, 200) : type_of(n));
    nfc_ = true;
  }

  // Pre-tokenizer: ByteLevel (its regex is GPT-2's), or Sequence[Split(regex), ByteLevel].
  const json pre = j.value("pre_tokenizer", json());
  auto byte_level = [&](const json& p, bool regex_expected) {
    add_prefix_space_ = flag(p, "add_prefix_space", false);
    const bool use_regex = flag(p, "use_regex", true);
    MOE_CHECK(use_regex == regex_expected,
              "[tokenizer] {}: a ByteLevel pre-tokenizer with use_regex {} {} is not implemented",
              what, use_regex, regex_expected ? "alone" : "after a Split");
    // After a Split, ByteLevel would prefix every regex piece, not each text segment.
    MOE_CHECK(regex_expected || !add_prefix_space_,
              "[tokenizer] {}: a ByteLevel pre-tokenizer with add_prefix_space after a Split is "
              "not implemented",
              what);
  };
  if (type_of(pre) == "ByteLevel") {
    byte_level(pre, true);
    pattern_ = PreTokenizerPattern::Gpt2;
  } else if (type_of(pre) == "Sequence" && pre["pretokenizers"].is_array() &&
             pre["pretokenizers"].size() == 2 && type_of(pre["pretokenizers"][0]) == "Split" &&
             type_of(pre["pretokenizers"][1]) == "ByteLevel") {
    const json& split = pre["pretokenizers"][0];
    MOE_CHECK(split.contains("pattern") && split["pattern"].contains("Regex"),
              "[tokenizer] {}: a Split pre-tokenizer on {} is not implemented (a Regex only)", what,
              split.value("pattern", json()).dump());
    MOE_CHECK(split.value("behavior", "") == "Isolated" && !flag(split, "invert", false),
              "[tokenizer] {}: a Split with behavior {} invert {} is not implemented (Isolated, "
              "not inverted)",
              what, split.value("behavior", json()).dump(), flag(split, "invert", false));
    pattern_ = pretokenizer_pattern_from_regex(split["pattern"]["Regex"].get<std::string>());
    byte_level(pre["pretokenizers"][1], false);
  } else {
    MOE_FAIL(
        "[tokenizer] {}: pre-tokenizer {} is not implemented: moecore reads ByteLevel, or "
        "Sequence[Split(regex), ByteLevel]",
        what, pre.is_null() ? std::string("null") : pre.dump().substr(0, 200));
  }

  std::unordered_map<std::string, int64_t> vocab;
  std::set<int64_t> ids;
  for (const auto& [tok, id] : model["vocab"].items()) {
    vocab.emplace(tok, id.get<int64_t>());
    ids.insert(id.get<int64_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const json& m : model["merges"]) {
    // tokenizers writes "a b" (before 0.20) or ["a", "b"].
    if (m.is_array() && m.size() == 2) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      continue;
    }
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    MOE_CHECK(sp != std::string::npos, "[tokenizer] {}: merge '{}' is not two tokens", what, s);
    merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
  }
  bpe_ = std::make_unique<ByteLevelBpe>(vocab, merges, flag(model, "ignore_merges", false), what);

  std::unordered_map<std::string, int64_t> added_ids;
  for (const json& a : j.value("added_tokens", json::array())) {
    const std::string content = a["content"].get<std::string>();
    for (const char* k : {"single_word", "lstrip", "rstrip"}) {
      MOE_CHECK(!flag(a, k, false), "[tokenizer] {}: added token '{}' with {} is not implemented",
                what, content, k);
    }
    added_.add(content, a["id"].get<int64_t>());
    added_ids[content] = a["id"].get<int64_t>();
    ids.insert(a["id"].get<int64_t>());
  }
  vocab_size_ = static_cast<int64_t>(ids.size());

  // Post-processor: ByteLevel (offsets only), TemplateProcessing's single template, or both.
  std::vector<json> procs;
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    const json& pp = j["post_processor"];
    if (type_of(pp) == "Sequence") {
      for (const json& p : pp["processors"]) procs.push_back(p);
    } else {
      procs.push_back(pp);
    }
  }
  for (const json& p : procs) {
    if (type_of(p) == "ByteLevel") continue;
    MOE_CHECK(type_of(p) == "TemplateProcessing",
              "[tokenizer] {}: post-processor {} is not implemented (ByteLevel, "
              "TemplateProcessing)",
              what, type_of(p));
    bool seen_a = false;
    for (const json& piece : p["single"]) {
      if (piece.contains("Sequence")) {
        seen_a = true;
        continue;
      }
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      const json& st = p["special_tokens"][name];
      for (const json& id : st["ids"])
        (seen_a ? suffix_ids_ : prefix_ids_).push_back(id.get<int64_t>());
    }
  }

  // eos_token from tokenizer_config.json, as AutoTokenizer reads it.
  const fs::path config = fs::path(path_).parent_path() / "tokenizer_config.json";
  if (!fs::exists(config)) {
    eod_why_ = fmt::format("no {} beside it to name the eos_token", config.string());
    return;
  }
  json c;
  try {
    c = json::parse(read_tokenizer_file(config.string(), "--tokenizer-model"));
  } catch (const json::exception& e) {
    MOE_FAIL("[tokenizer] '{}' is not JSON: {}", config.string(), e.what());
  }
  const json eos = c.value("eos_token", json());
  const std::string name = eos.is_string() ? eos.get<std::string>()
                           : eos.is_object() && eos.contains("content")
                               ? eos["content"].get<std::string>()
                               : std::string();
  if (name.empty()) {
    eod_why_ = fmt::format("'{}' names no eos_token", config.string());
    return;
  }
  auto it = added_ids.find(name);
  if (it != added_ids.end()) {
    eod_ = it->second;
  } else if (auto v = vocab.find(name); v != vocab.end()) {
    eod_ = v->second;
  } else {
    eod_why_ = fmt::format("eos_token '{}' of '{}' is not a token", name, config.string());
  }
}

int64_t HuggingFaceTokenizer::eod() const {
  MOE_CHECK(eod_ >= 0, "[tokenizer] HuggingFaceTokenizer {}: no end-of-document token: {}", path_,
            eod_why_);
  return eod_;
}

void HuggingFaceTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  out.insert(out.end(), prefix_ids_.begin(), prefix_ids_.end());
  std::vector<std::string_view> pieces;
  std::string prefixed, normalized;
  for (size_t pos = 0; pos <= text.size();) {
    const AddedTokens::Match m = added_.find(text, pos);
    const size_t end = m.pos == std::string_view::npos ? text.size() : m.pos;
    std::string_view segment = text.substr(pos, end - pos);
    if (nfc_) {
      nfc_normalize(segment, normalized);
      segment = normalized;
    }
    if (add_prefix_space_ && !segment.empty() && segment[0] != ' ') {
      prefixed.assign(1, ' ');
      prefixed.append(segment);
      segment = prefixed;
    }
    pieces.clear();
    pretokenize(pattern_, segment, pieces);
    for (std::string_view p : pieces) bpe_->encode(p, out);
    if (m.pos == std::string_view::npos) break;
    out.push_back(m.id);
    pos = m.pos + m.length;
  }
  out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
}

std::string HuggingFaceTokenizer::describe() const {
  return fmt::format("HuggingFaceTokenizer ('{}', {}{} pre-tokenizer, vocab {}, eod {})", path_,
                     nfc_ ? "NFC, " : "",
                     pattern_ == PreTokenizerPattern::Gpt2     ? "GPT-2"
                     : pattern_ == PreTokenizerPattern::Llama3 ? "Llama-3"
                                                               : "Qwen2",
                     vocab_size_, eod_ >= 0 ? std::to_string(eod_) : std::string("none"));
}

}  // namespace moecore::data
