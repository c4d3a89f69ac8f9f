#include "convert/hf_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/safetensors.h"
#include "ckpt/safetensors_writer.h"
#include "convert/output_dir.h"
#include "core/check.h"
#include "core/dtype.h"

namespace moecore::convert {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json read_json(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MOE_CHECK(in.good(), "[convert] cannot read '{}'", p.string());
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    MOE_FAIL("[convert] '{}' is not valid JSON: {}", p.string(), e.what());
  }
}

}  // namespace

HfWeights::HfWeights(const fs::path& dir) : dir_(dir) {
  const fs::path index = dir / kHfIndexFile;
  std::vector<std::string> files;
  json weight_map;
  if (fs::exists(index)) {
    const json j = read_json(index);
    MOE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
              "[convert] '{}' has no \"weight_map\" object", index.string());
    weight_map = j["weight_map"];
    for (const auto& [name, file] : weight_map.items()) {
      MOE_CHECK(file.is_string() && !file.get<std::string>().empty() &&
                    file.get<std::string>().find('/') == std::string::npos,
                "[convert] '{}': tensor '{}' is mapped to {}, not a file name in the directory",
                index.string(), name, file.dump());
      files.push_back(file.get<std::string>());
    }
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
  } else {
    MOE_CHECK(fs::exists(dir / kHfWeightsFile),
              "[convert] '{}' has neither {} nor {}: moecore reads safetensors weights (a "
              "pytorch_model.bin checkpoint must be saved again with safe_serialization)",
              dir.string(), kHfWeightsFile, kHfIndexFile);
    files.push_back(std::string(kHfWeightsFile));
  }
  for (const std::string& f : files) {
    // The name is the index's: a name the file system refuses (too long, ...) is reported as
    // such, not thrown as a filesystem_error.
    std::error_code ec;
    const bool exists = fs::exists(dir / f, ec);
    MOE_CHECK(!ec, "[convert] '{}' lists '{}', which cannot be looked up: {}", index.string(), f,
              ec.message());
    MOE_CHECK(exists, "[convert] '{}' lists '{}', which does not exist", index.string(), f);
    files_.push_back(std::make_unique<ckpt::SafetensorsFile>(dir / f));
    for (const std::string& name : files_.back()->names()) {
      MOE_CHECK(where_.emplace(name, files_.size() - 1).second,
                "[convert] '{}': tensor '{}' is in two files ('{}' and '{}')", dir.string(), name,
                files_[where_.at(name)]->path(), files_.back()->path());
      MOE_CHECK(weight_map.is_null() || (weight_map.contains(name) && weight_map[name] == f),
                "[convert] '{}': tensor '{}' is in '{}' but the index maps it to {}", dir.string(),
                name, f, weight_map.contains(name) ? weight_map[name].dump() : "nothing");
    }
  }
  if (!weight_map.is_null()) {
    for (const auto& [name, file] : weight_map.items()) {
      MOE_CHECK(where_.count(name) > 0,
                "[convert] '{}': the index maps tensor '{}' to '{}', which does not hold it",
                index.string(), name, file.get<std::string>());
    }
  }
  for (const auto& [name, f] : where_) names_.push_back(name);
}

const ckpt::SafetensorsFile& HfWeights::file_of(std::string_view name) const {
  auto it = where_.find(name);
  MOE_CHECK(it != where_.end(), "[convert] '{}' has no tensor '{}' ({} tensors)", dir_.string(),
            name, names_.size());
  return *files_[it->second];
}

std::string_view HfWeights::stored_name(std::string_view name) const {
  const auto it = stored_.find(name);
  return it == stored_.end() ? name : std::string_view(it->second);
}

const ckpt::TensorInfo& HfWeights::info(std::string_view name) const {
  return file_of(name).info(stored_name(name));
}

std::span<const std::byte> HfWeights::read_bytes(std::string_view name) {
  const std::span<const std::byte> b = file_of(name).bytes(stored_name(name));
  read_.insert(std::string(name));
  return b;
}

bool HfWeights::add_missing_prefix(const std::string& prefix) {
  const std::string p = prefix + ".";
  for (const std::string& n : names_) {
    if (n.starts_with(p)) return false;
  }
  std::map<std::string, size_t, std::less<>> where;
  std::map<std::string, std::string, std::less<>> stored;
  for (const auto& [name, file] : where_) {
    where.emplace(p + name, file);
    stored.emplace(p + name, std::string(stored_name(name)));
  }
  where_ = std::move(where);
  stored_ = std::move(stored);
  std::set<std::string, std::less<>> read;
  for (const std::string& n : read_) read.insert(p + n);
  read_ = std::move(read);
  names_.clear();
  for (const auto& [name, f] : where_) names_.push_back(name);
  return true;
}

std::vector<float> HfWeights::read_f32(std::string_view name) {
  const ckpt::SafetensorsFile& f = file_of(name);
  const ckpt::TensorInfo& t = f.info(stored_name(name));
  const std::span<const std::byte> b = f.bytes(stored_name(name));
  std::vector<float> out;
  if (t.dtype == "F32") {
    out.resize(b.size() / 4);
    std::memcpy(out.data(), b.data(), b.size());
  } else if (t.dtype == "BF16") {  // moecore's master weights are f32: widened exactly
    out.resize(b.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      bf16 v;
      std::memcpy(&v.bits, b.data() + 2 * i, 2);
      out[i] = bf16_to_float(v);
    }
  } else if (t.dtype == "F8_E4M3" && has(std::string(name) + "_scale_inv")) {
    // DeepSeek-V3's FP8 weights: codes with one scale per block beside them, `<name>_scale_inv`.
    const std::string scale_name = std::string(name) + "_scale_inv";
    const std::vector<int64_t> scale_shape = info(scale_name).shape;
    const std::vector<float> scale = read_f32(scale_name);
    out = fp8_block_dequant(
        name, std::span(reinterpret_cast<const uint8_t*>(b.data()), b.size()), t.shape, scale,
        scale_shape, fp8_block_);
  } else {
    MOE_FAIL(
        "[convert] '{}': tensor '{}' is {}: moecore imports F32 and BF16 weights only; save "
        "the model as float32 or bfloat16 first (`model.to(torch.float32).save_pretrained(DIR)`)",
        f.path(), name, t.dtype);
  }
  read_.insert(std::string(name));
  return out;
}

std::vector<std::string> HfWeights::unread() const {
  std::vector<std::string> out;
  for (const std::string& n : names_) {
    if (read_.count(n) == 0) out.push_back(n);
  }
  return out;
}

std::set<std::string> HfWeights::dtypes() const {
  std::set<std::string> out;
  for (const auto& [name, f] : where_) out.insert(files_[f]->info(stored_name(name)).dtype);
  return out;
}

std::vector<std::byte> f32_as(std::string_view dtype, const std::vector<float>& v) {
  std::vector<std::byte> out;
  if (dtype == "F32") {
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
  } else if (dtype == "BF16") {
    out.resize(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      const bf16 h = float_to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h.bits, 2);
    }
  } else {
    MOE_FAIL("[convert] cannot write dtype '{}': F32 or BF16", dtype);
  }
  return out;
}

std::vector<std::string> write_hf_weights(const fs::path& dir, std::vector<HfTensorBytes> tensors,
                                          uint64_t max_shard_bytes) {
  // The reference writer's order: larger dtypes first, then by name (keeps every tensor aligned
  // to its element size; moecore's writer then writes the reference's bytes).
  std::sort(tensors.begin(), tensors.end(), [](const HfTensorBytes& a, const HfTensorBytes& b) {
    const size_t sa = ckpt::dtype_size(a.dtype), sb = ckpt::dtype_size(b.dtype);
    return sa != sb ? sa > sb : a.name < b.name;
  });
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0, total = 0, params = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = tensors[i].bytes.size();
    if (max_shard_bytes > 0 && !shards.back().empty() && in_shard + n > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += n;
    total += n;
    params += static_cast<uint64_t>(tensors[i].bytes.size() / ckpt::dtype_size(tensors[i].dtype));
  }
  std::vector<std::string> files;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? std::string(kHfWeightsFile)
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                              s + 1, shards.size());
    ckpt::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (size_t i : shards[s]) {
      HfTensorBytes& t = tensors[i];
      w.add(t.name, t.dtype, t.shape, t.bytes);
      weight_map[t.name] = file;
      std::vector<std::byte>().swap(t.bytes);  // written into the shard's buffer
    }
    w.write(dir / file);
    files.push_back(file);
    convert_fault_point("export.after_shard");
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_parameters", params}, {"total_size", total}}},
                        {"weight_map", weight_map}};
    ckpt::write_file_atomic(dir / kHfIndexFile, index.dump(2) + "\n");
    files.push_back(std::string(kHfIndexFile));
  }
  return files;
}

uint64_t parse_shard_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  static const std::pair<const char*, uint64_t> kUnits[] = {{"", 1},
                                                            {"B", 1},
                                                            {"KB", 1000},
                                                            {"MB", 1000'000},
                                                            {"GB", 1000'000'000},
                                                            {"KiB", 1ull << 10},
                                                            {"MiB", 1ull << 20},
                                                            {"GiB", 1ull << 30}};
  for (const auto& [u, scale] : kUnits) {
    if (digits > 0 && digits <= 12 && unit == u) {
      const uint64_t n = std::stoull(text.substr(0, digits)) * scale;
      MOE_CHECK(n > 0, "[convert] --max-shard-size {} must be > 0", text);
      return n;
    }
  }
  MOE_FAIL(
      "[convert] --max-shard-size '{}': give bytes, or a number with KB, MB, GB (powers of "
      "1000) or KiB, MiB, GiB (powers of 1024), e.g. 5GB",
      text);
}

}  // namespace moecore::convert
