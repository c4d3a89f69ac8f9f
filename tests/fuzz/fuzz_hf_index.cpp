// libFuzzer target for HuggingFace's model.safetensors.index.json (src/convert/hf_weights.cpp),
// read as `moecore convert hf-to-moecore` reads a sharded checkpoint: any bytes, as the index of
// a directory that holds two valid shards (model-00001-of-00002.safetensors with "a" F32 [2] and
// "b" BF16 [3], model-00002-of-00002.safetensors with "c" F32 [1]), either give weights whose
// every tensor is in exactly the file the index maps it to and reads back as f32 of its size, or
// fail with moecore::Error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/hf_weights.h"
#include "core/check.h"
#include "fuzz_common.h"

namespace {

namespace fs = std::filesystem;

// A safetensors file: the header's length (u64 little-endian), the header, the data.
std::string safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// The directory with the two shards, written once per process.
const fs::path& weights_dir() {
  static const fs::path dir = [] {
    const fs::path d = moecore::fuzz::scratch_dir() / "hf_index";
    fs::create_directories(d);
    const std::string one = safetensors(
        R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
        R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}})",
        std::string("\x00\x00\x80\x3f\x00\x00\x00\x40\x80\x3f\x00\x40\x40\x40", 14));
    const std::string two = safetensors(
        R"({"c":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
        std::string("\x00\x00\x40\x40", 4));
    moecore::fuzz::write_path((d / "model-00001-of-00002.safetensors").string(), one.data(),
                              one.size());
    moecore::fuzz::write_path((d / "model-00002-of-00002.safetensors").string(), two.data(),
                              two.size());
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::convert;
  const fs::path& dir = weights_dir();
  moecore::fuzz::write_path((dir / kHfIndexFile).string(), data, size);
  try {
    HfWeights w(dir);
    // Accepted: the index is a JSON object whose weight_map names, for every tensor of the files
    // it lists, the file that holds it, and nothing else.
    const nlohmann::json index = nlohmann::json::parse(data, data + size);
    const nlohmann::json& map = index.at("weight_map");
    FUZZ_EXPECT(map.size() == w.names().size());
    static const std::map<std::string, std::pair<std::string, size_t>> kTensors = {
        {"a", {"model-00001-of-00002.safetensors", 2}},
        {"b", {"model-00001-of-00002.safetensors", 3}},
        {"c", {"model-00002-of-00002.safetensors", 1}}};
    for (const std::string& name : w.names()) {
      const auto it = kTensors.find(name);
      FUZZ_EXPECT(it != kTensors.end());
      FUZZ_EXPECT(map.at(name) == it->second.first);
      FUZZ_EXPECT(w.has(name));
      FUZZ_EXPECT(w.read_f32(name).size() == it->second.second);
    }
    FUZZ_EXPECT(w.unread().empty());
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
