// libFuzzer target for HuggingFace's config.json (src/convert/hf_config.cpp), read as
// `moecore convert hf-to-moecore` reads it (JSON text that does not parse is refused before
// parse_hf_config): any bytes either give a model spec that hf_config_json writes back as a
// config.json reading to the same spec, or fail with moecore::Error.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/hf_config.h"
#include "core/check.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::convert;
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;  // hf_import's read_config: "[convert] '...' is not valid JSON"
  }
  try {
    std::vector<std::string> warnings;
    const HfModelSpec s = parse_hf_config(cfg, "fuzz/config.json", &warnings);
    FUZZ_EXPECT(static_cast<int64_t>(s.moe_layers.size()) == s.num_layers);
    const nlohmann::json back = hf_config_json(s, "bfloat16", &cfg);
    const HfModelSpec s2 = parse_hf_config(back, "fuzz/config.json (written back)");
    FUZZ_EXPECT(s2 == s);
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
