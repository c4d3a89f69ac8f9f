// libFuzzer target for HuggingFace's config.json, read by both commands that take one, through
// the one reader of its keys (src/convert/hf_config_reader.cpp); JSON text that does not parse is
// refused before either: any bytes either give
//   - `moecore convert hf-to-moecore`'s model spec (src/convert/hf_config.cpp; DeepSeek-V3's
//     through src/convert/hf_deepseek_v3.cpp: MLA, YaRN, grouped routing, MTP, FP8 blocks) that
//     hf_config_json writes back as a config.json reading to the same spec, or fail with
//     moecore::Error;
//   - `moecore plan --hf-config`'s model (src/plan/hf_model_spec.cpp) with positive sizes, at
//     most kMaxHfLayers layers and one MoE-layer entry per layer, or fail with moecore::Error.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/hf_config.h"
#include "core/check.h"
#include "fuzz_common.h"
#include "plan/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::convert;
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;  // read_hf_config_file: "[convert] '...' is not valid JSON"
  }
  try {
    std::vector<std::string> warnings;
    const HfModelSpec s = parse_hf_config(cfg, "fuzz/config.json", &warnings);
    FUZZ_EXPECT(static_cast<int64_t>(s.moe_layers.size()) == s.num_layers);
    const nlohmann::json back = hf_config_json(s, "bfloat16", &cfg);
    // What the converter writes it reads (a refusal of its own config.json is a finding too).
    std::optional<HfModelSpec> s2;
    try {
      s2 = parse_hf_config(back, "fuzz/config.json (written back)");
    } catch (const moecore::Error&) {
    }
    FUZZ_EXPECT(s2.has_value() && *s2 == s);
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  try {
    const moecore::plan::ModelSpec m =
        moecore::plan::spec_from_hf_config(cfg, "fuzz/config.json");
    FUZZ_EXPECT(m.vocab_size >= 1 && m.hidden >= 1 && m.num_heads >= 1);
    FUZZ_EXPECT(m.num_layers >= 1 && m.num_layers <= kMaxHfLayers);
    FUZZ_EXPECT(m.num_experts <= 0 ||
                static_cast<int64_t>(m.moe_layer_pattern.size()) == m.num_layers);
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
