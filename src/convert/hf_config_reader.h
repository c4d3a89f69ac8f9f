// The one reader of a HuggingFace config.json's keys, for every command that takes one
// (`moecore convert`'s parse_hf_config, `moecore plan --hf-config`; both fuzzed by
// tests/fuzz/fuzz_hf_config.cpp): each key typed before it is read, so a wrong type, a number
// that is no int64 (1e300, 2^64 - 1: never a wrapping cast) or a layer count that would size
// tables of billions of entries is refused naming the file, the key and what it holds, never a
// json type_error or undefined behaviour.
#pragma once

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>

#include <nlohmann/json.hpp>

namespace moecore::convert {

// The most layers a config.json may declare (real models have a few hundred at most; the
// count sizes per-layer tables here, the model the importer plans and the planner's stages).
inline constexpr int64_t kMaxHfLayers = 1 << 16;

class HfConfigReader {
 public:
  // `where` names the file in messages, which start with "[<component>] <source> 'where':"
  // (source: how the user gave it, e.g. "--hf-config"; may be empty). Throws unless cfg is a
  // JSON object.
  HfConfigReader(const nlohmann::json& cfg, std::string where, std::string component = "convert",
                 std::string source = "");

  // Present and not null.
  bool has(const char* key) const;
  const nlohmann::json& at(const char* key) const { return cfg_[key]; }
  std::string text(const char* key) const { return cfg_[key].dump(); }
  const std::string& where() const { return where_; }
  // "[component] source 'where'", the start of every message.
  const std::string& label() const { return label_; }

  // An integer, or a float with an integral value (some writers emit 4096.0), that fits int64.
  // Without `absent` the key is required (save_pretrained always writes it).
  int64_t integer(const char* key) const;
  int64_t integer(const char* key, int64_t absent) const;
  // The first of `keys` that is present (configs of different families name one size
  // differently: n_routed_experts, num_experts, num_local_experts); `absent` when none is.
  int64_t integer(std::initializer_list<const char*> keys, int64_t absent) const;
  double number(const char* key, double absent) const;
  bool boolean(const char* key, bool absent) const;
  std::string string(const char* key, const std::string& absent) const;
  // A layer count: integer(key), within 1..kMaxHfLayers.
  int64_t num_layers(const char* key) const;

  // A setting the reader's command cannot represent: the key, its value, why, and what would be
  // needed.
  [[noreturn]] void refuse(const std::string& key, const std::string& value,
                           const std::string& why) const;

 private:
  int64_t as_integer(const char* key) const;

  const nlohmann::json& cfg_;
  std::string where_, component_, label_;
};

// config.json read and parsed as JSON, refused naming `path` when it is a directory, cannot be
// read or is not JSON (component and source as for HfConfigReader).
nlohmann::json read_hf_config_file(const std::filesystem::path& path,
                                   const std::string& component = "convert",
                                   const std::string& source = "");

}  // namespace moecore::convert
