#include "convert/hf_config_reader.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "core/check.h"

namespace moecore::convert {

using nlohmann::json;

HfConfigReader::HfConfigReader(const json& cfg, std::string where, std::string component,
                               std::string source)
    : cfg_(cfg), where_(std::move(where)), component_(std::move(component)) {
  label_ = fmt::format("[{}] {}{}'{}'", component_, source, source.empty() ? "" : " ", where_);
  MOE_CHECK(cfg.is_object(), "{} is {}, not a JSON object", label_, cfg.type_name());
}

bool HfConfigReader::has(const char* key) const {
  const auto it = cfg_.find(key);
  return it != cfg_.end() && !it->is_null();
}

int64_t HfConfigReader::integer(const char* key) const {
  MOE_CHECK(cfg_.contains(key),
            "{} has no \"{}\": a config.json that save_pretrained writes always has it", label_,
            key);
  return as_integer(key);
}

int64_t HfConfigReader::integer(const char* key, int64_t absent) const {
  return has(key) ? as_integer(key) : absent;
}

int64_t HfConfigReader::integer(std::initializer_list<const char*> keys, int64_t absent) const {
  for (const char* k : keys) {
    if (has(k)) return as_integer(k);
  }
  return absent;
}

double HfConfigReader::number(const char* key, double absent) const {
  if (!has(key)) return absent;
  MOE_CHECK(cfg_[key].is_number(), "{}: \"{}\" is {}, not a number", label_, key, text(key));
  return cfg_[key].get<double>();
}

bool HfConfigReader::boolean(const char* key, bool absent) const {
  if (!has(key)) return absent;
  MOE_CHECK(cfg_[key].is_boolean(), "{}: \"{}\" is {}, not true or false", label_, key,
            text(key));
  return cfg_[key].get<bool>();
}

std::string HfConfigReader::string(const char* key, const std::string& absent) const {
  if (!has(key)) return absent;
  MOE_CHECK(cfg_[key].is_string(), "{}: \"{}\" is {}, not a string", label_, key, text(key));
  return cfg_[key].get<std::string>();
}

int64_t HfConfigReader::num_layers(const char* key) const {
  const int64_t n = integer(key);
  // The count sizes vectors and a model: a corrupt value must not ask for billions of layers.
  if (n > kMaxHfLayers)
    refuse(key, std::to_string(n), fmt::format("moecore reads models of at most {} layers", kMaxHfLayers));
  MOE_CHECK(n >= 1, "{}: \"{}\" is {}, not a layer count >= 1", label_, key, n);
  return n;
}

void HfConfigReader::refuse(const std::string& key, const std::string& value,
                            const std::string& why) const {
  MOE_FAIL("{}: \"{}\": {} is not supported: {}", label_, key, value, why);
}

// 1e300 must fail here, not wrap around in a cast (undefined behaviour) or as an unsigned
// 2^64 - 1.
int64_t HfConfigReader::as_integer(const char* key) const {
  const json& v = cfg_[key];
  const bool fits =
      v.is_number_unsigned()
          ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
      : v.is_number_integer() ? true
      : v.is_number_float()   ? std::floor(v.get<double>()) == v.get<double>() &&
                                  v.get<double>() >= -0x1p63 && v.get<double>() < 0x1p63
                            : false;
  MOE_CHECK(fits, "{}: \"{}\" is {}, not an integer", label_, key, text(key));
  return v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
}

json read_hf_config_file(const std::filesystem::path& path, const std::string& component,
                         const std::string& source) {
  const std::string label =
      fmt::format("[{}] {}{}'{}'", component, source, source.empty() ? "" : " ", path.string());
  std::error_code ec;
  MOE_CHECK(!std::filesystem::is_directory(path, ec), "{} is a directory: give its config.json",
            label);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "{} cannot be read ({}): an HF checkpoint directory holds config.json",
            label, std::strerror(errno));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    MOE_FAIL("{} is not valid JSON: {}", label, e.what());
  }
}

}  // namespace moecore::convert
