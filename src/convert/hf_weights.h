// The weight files of a HuggingFace checkpoint directory as save_pretrained writes them:
// model.safetensors, or shards listed by model.safetensors.index.json (its weight_map names the
// file of every tensor; tensors in any shard, in any order). The reader serves each tensor as
// f32 (F32 copied, BF16 widened exactly, F8_E4M3 with its block scales dequantized) and keeps
// count of what was read, so a converter can name every tensor it left over; the writer writes
// tensors in HF's order, in one file or in shards of a maximum size with their index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/safetensors_file.h"
#include "convert/fp8_block_dequant.h"

namespace moecore::convert {

inline constexpr std::string_view kHfWeightsFile = "model.safetensors";
inline constexpr std::string_view kHfIndexFile = "model.safetensors.index.json";

class HfWeights {
 public:
  // Opens `dir`'s weights (the index when there is one) and validates every file
  // (SafetensorsFile); the index and the files must list the same tensors.
  explicit HfWeights(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const std::vector<std::string>& names() const { return names_; }  // sorted
  bool has(std::string_view name) const { return where_.count(std::string(name)) > 0; }
  // A missing name throws naming the directory.
  const ckpt::TensorInfo& info(std::string_view name) const;
  // The tensor as f32 values, marked as read. F32, BF16, and F8_E4M3 where a tensor
  // `name` + "_scale_inv" (F32 or BF16, one scale per fp8_block_size() block) stands beside it,
  // as in DeepSeek-V3's FP8 checkpoints: dequantized, and the scale marked as read too. Another
  // dtype, or F8_E4M3 without its scale, throws naming it.
  std::vector<float> read_f32(std::string_view name);
  // The block of the FP8 scales: the checkpoint's quantization_config.weight_block_size.
  void set_fp8_block_size(Fp8BlockSize block) { fp8_block_ = block; }
  Fp8BlockSize fp8_block_size() const { return fp8_block_; }
  // The tensor's bytes as stored (any dtype; info() has it), marked as read: for buffers that
  // are checked rather than converted (GPT-2's attention mask).
  std::span<const std::byte> read_bytes(std::string_view name);
  // The tensors never read, in name order.
  std::vector<std::string> unread() const;
  // transformers' rule for a checkpoint of the base model loaded into the model with a head
  // (GPT2Model's weights into GPT2LMHeadModel): when no tensor's name starts with `prefix` + ".",
  // every name is read as `prefix` + "." + name from now on. Returns whether it did so.
  bool add_missing_prefix(const std::string& prefix);
  // The dtypes of the tensors ("F32", "BF16", ...).
  std::set<std::string> dtypes() const;

 private:
  const ckpt::SafetensorsFile& file_of(std::string_view name) const;
  std::string_view stored_name(std::string_view name) const;

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<ckpt::SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor -> its file in files_
  // The name in its file, where add_missing_prefix changed it.
  std::map<std::string, std::string, std::less<>> stored_;
  std::vector<std::string> names_;
  std::set<std::string, std::less<>> read_;
  Fp8BlockSize fp8_block_;
};

// One tensor to write: its name, safetensors dtype, shape and little-endian bytes.
struct HfTensorBytes {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// f32 values as the bytes of `dtype`: "F32" as they are, "BF16" rounded to nearest even (what
// torch's cast does; exact for values that were bf16).
std::vector<std::byte> f32_as(std::string_view dtype, const std::vector<float>& v);

// Writes `tensors` into `dir` in HF's order (larger dtypes first, then by name) with HF's
// metadata {"format": "pt"}: one model.safetensors when max_shard_bytes is 0 or everything fits,
// else model-0000k-of-0000n.safetensors of at most max_shard_bytes of tensor data each (a larger
// tensor alone in its shard, as transformers does) and model.safetensors.index.json. Returns
// the files written.
std::vector<std::string> write_hf_weights(const std::filesystem::path& dir,
                                          std::vector<HfTensorBytes> tensors,
                                          uint64_t max_shard_bytes);

// "5GB" (10^9), "500MB", "64KB", "2GiB" (2^30), "100MiB", "1KiB", or plain bytes "1000000";
// throws naming the value otherwise (transformers' max_shard_size spellings).
uint64_t parse_shard_size(const std::string& text);

}  // namespace moecore::convert
