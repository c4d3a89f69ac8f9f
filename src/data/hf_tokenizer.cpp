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

// The file is untrusted: every member is looked up (a const operator[] on a missing key is UB in
// nlohmann::json) and every value's kind checked before it is read, so a malformed file fails
// here with the path, the key and what it holds, never as a json type_error or a crash.

// j[key], or null when j is not an object or has no such key.
const json& member(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  const auto it = j.find(key);
  return it == j.end() ? null : *it;
}

std::string type_of(const json& j) {
  const json& t = member(j, "type");
  return t.is_string() ? t.get<std::string>() : std::string("?");
}

bool flag(const json& j, const char* key, bool dflt) {
  const json& v = member(j, key);
  return v.is_boolean() ? v.get<bool>() : dflt;
}

// A JSON value for a message: its text, cut short.
std::string shown(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 200 ? s.substr(0, 197) + "..." : s;
}

std::string string_of(const json& j, const std::string& what, const std::string& where) {
  MOE_CHECK(j.is_string(), "[tokenizer] {}: {} is {}, not a string", where, what, shown(j));
  return j.get<std::string>();
}

const json& array_of(const json& j, const std::string& what, const std::string& where) {
  MOE_CHECK(j.is_array(), "[tokenizer] {}: {} is {}, not a list", where, what, shown(j));
  return j;
}

// The id of token `name` (`kind`: "token", "added token", ...): an integer in [0, 2^31) (the
// ids are int32 in the .bin and index the embedding).
int64_t id_of(const json& j, const char* kind, std::string_view name, const std::string& where) {
  MOE_CHECK(j.is_number_integer() && (j.is_number_unsigned() || j.get<int64_t>() >= 0) &&
                j.get<uint64_t>() < (uint64_t{1} << 31),
            "[tokenizer] {}: {} '{}' has id {}, not an integer in [0, 2^31)", where, kind, name,
            shown(j));
  return j.get<int64_t>();
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
  const json& model = member(j, "model");
  MOE_CHECK(type_of(model) == "BPE",
            "[tokenizer] {}: model type {} is not implemented: moecore reads byte-level BPE "
            "tokenizer.json files (GPT-2, Llama-3, Qwen2 style)",
            what, type_of(model));
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    MOE_CHECK(member(model, k).is_null() || member(model, k) == "",
              "[tokenizer] {}: BPE {} {} is not implemented", what, k, shown(member(model, k)));
  }
  MOE_CHECK(member(model, "dropout").is_null(),
            "[tokenizer] {}: BPE dropout {} is not implemented (it samples)", what,
            shown(member(model, "dropout")));
  MOE_CHECK(!flag(model, "byte_fallback", false),
            "[tokenizer] {}: BPE byte_fallback is not implemented", what);

  // Normalizer: none, or NFC (Qwen2's).
  if (const json& n = member(j, "normalizer"); !n.is_null()) {
    const json& seq = member(n, "normalizers");
    const bool lone_nfc = type_of(n) == "Sequence" && seq.is_array() && seq.size() == 1 &&
                          type_of(seq[0]) == "NFC";
    MOE_CHECK(type_of(n) == "NFC" || lone_nfc,
              "[tokenizer] {}: normalizer {} is not implemented: moecore reads tokenizer.json "
              "files without a normalizer or with NFC",
              what, type_of(n) == "Sequence" ? shown(n) : type_of(n));
    nfc_ = true;
  }

  // Pre-tokenizer: ByteLevel (its regex is GPT-2's), or Sequence[Split(regex), ByteLevel].
  const json& pre = member(j, "pre_tokenizer");
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
  } else if (const json& seq = member(pre, "pretokenizers");
             type_of(pre) == "Sequence" && seq.is_array() && seq.size() == 2 &&
             type_of(seq[0]) == "Split" && type_of(seq[1]) == "ByteLevel") {
    const json& split = seq[0];
    const json& regex = member(member(split, "pattern"), "Regex");
    MOE_CHECK(regex.is_string(),
              "[tokenizer] {}: a Split pre-tokenizer on {} is not implemented (a Regex only)", what,
              shown(member(split, "pattern")));
    MOE_CHECK(member(split, "behavior") == "Isolated" && !flag(split, "invert", false),
              "[tokenizer] {}: a Split with behavior {} invert {} is not implemented (Isolated, "
              "not inverted)",
              what, shown(member(split, "behavior")), flag(split, "invert", false));
    pattern_ = pretokenizer_pattern_from_regex(regex.get<std::string>());
    byte_level(seq[1], false);
  } else {
    MOE_FAIL(
        "[tokenizer] {}: pre-tokenizer {} is not implemented: moecore reads ByteLevel, or "
        "Sequence[Split(regex), ByteLevel]",
        what, shown(pre));
  }

  std::unordered_map<std::string, int64_t> vocab;
  std::set<int64_t> ids;
  const json& model_vocab = member(model, "vocab");
  MOE_CHECK(model_vocab.is_object(),
            "[tokenizer] {}: the BPE model's \"vocab\" is {}, not an object of token: id", what,
            shown(model_vocab));
  for (const auto& [tok, id] : model_vocab.items()) {
    const int64_t v = id_of(id, "token", tok, what);
    vocab.emplace(tok, v);
    ids.insert(v);
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const json& m : array_of(member(model, "merges"), "the BPE model's \"merges\"", what)) {
    // tokenizers writes "a b" (before 0.20) or ["a", "b"].
    if (m.is_array() && m.size() == 2) {
      merges.emplace_back(string_of(m[0], "a merge's token", what),
                          string_of(m[1], "a merge's token", what));
      continue;
    }
    const std::string s = string_of(m, "a merge", what);
    const size_t sp = s.find(' ');
    MOE_CHECK(sp != std::string::npos, "[tokenizer] {}: merge '{}' is not two tokens", what, s);
    merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
  }
  bpe_ = std::make_unique<ByteLevelBpe>(vocab, merges, flag(model, "ignore_merges", false), what);

  std::unordered_map<std::string, int64_t> added_ids;
  const json& added = member(j, "added_tokens");
  for (const json& a : added.is_null() ? json::array() : array_of(added, "\"added_tokens\"", what)) {
    const std::string content = string_of(member(a, "content"), "an added token's content", what);
    for (const char* k : {"single_word", "lstrip", "rstrip"}) {
      MOE_CHECK(!flag(a, k, false), "[tokenizer] {}: added token '{}' with {} is not implemented",
                what, content, k);
    }
    const int64_t id = id_of(member(a, "id"), "added token", content, what);
    added_.add(content, id);
    added_ids[content] = id;
    ids.insert(id);
  }
  // len(tokenizer), the embedding's rows: the distinct ids, which must then be 0..n-1. A gap or
  // two tokens sharing an id would leave ids at or past the vocabulary size.
  vocab_size_ = static_cast<int64_t>(ids.size());
  MOE_CHECK(!ids.empty() && *ids.rbegin() < vocab_size_,
            "[tokenizer] {}: the vocabulary and added tokens have {} distinct ids but the largest "
            "is {}: ids must be 0..{} without gaps (a duplicate or missing id in \"vocab\" or "
            "\"added_tokens\")",
            what, ids.size(), ids.empty() ? -1 : *ids.rbegin(), vocab_size_ - 1);

  // Post-processor: ByteLevel (offsets only), TemplateProcessing's single template, or both.
  std::vector<const json*> procs;
  if (const json& pp = member(j, "post_processor"); !pp.is_null()) {
    if (type_of(pp) == "Sequence") {
      for (const json& p : array_of(member(pp, "processors"), "the post-processor's processors",
                                    what)) {
        procs.push_back(&p);
      }
    } else {
      procs.push_back(&pp);
    }
  }
  for (const json* p : procs) {
    if (type_of(*p) == "ByteLevel") continue;
    MOE_CHECK(type_of(*p) == "TemplateProcessing",
              "[tokenizer] {}: post-processor {} is not implemented (ByteLevel, "
              "TemplateProcessing)",
              what, type_of(*p));
    bool seen_a = false;
    for (const json& piece : array_of(member(*p, "single"), "TemplateProcessing's single", what)) {
      if (member(piece, "Sequence").is_object()) {
        seen_a = true;
        continue;
      }
      const std::string name = string_of(member(member(piece, "SpecialToken"), "id"),
                                         "a TemplateProcessing piece's SpecialToken id", what);
      const json& st = member(member(*p, "special_tokens"), name.c_str());
      MOE_CHECK(st.is_object(),
                "[tokenizer] {}: TemplateProcessing names the special token '{}' but its "
                "special_tokens do not define it",
                what, name);
      for (const json& id : array_of(member(st, "ids"), "special token '" + name + "' ids", what)) {
        const int64_t v = id_of(id, "special token", name, what);
        MOE_CHECK(v < vocab_size_,
                  "[tokenizer] {}: TemplateProcessing's special token '{}' has id {}, outside the "
                  "vocabulary of {}",
                  what, name, v, vocab_size_);
        (seen_a ? suffix_ids_ : prefix_ids_).push_back(v);
      }
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
  // A string, or an AddedToken object with its content; anything else names no eos.
  const json& eos = member(c, "eos_token");
  const json& content = eos.is_object() ? member(eos, "content") : eos;
  const std::string name = content.is_string() ? content.get<std::string>() : std::string();
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
