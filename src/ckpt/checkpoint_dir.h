// A checkpoint on disk (docs/checkpoint_format.md): the per-iteration directory, the tracker
// that names the latest complete one, the shards with their sizes and hashes, and the reader
// that serves any slice of a global tensor from whichever shards hold it, so a checkpoint loads
// into another layout (resharding) by asking for that layout's slices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ckpt/manifest.h"
#include "ckpt/safetensors_file.h"
#include "ckpt/safetensors_writer.h"

namespace moecore::ckpt {

inline constexpr std::string_view kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr std::string_view kManifestFile = "manifest.json";

// <save>/iter_NNNNNNN (7 digits, more when needed: Megatron-LM's names).
std::filesystem::path iteration_dir(const std::filesystem::path& save, int64_t iteration);
// Where a save writes until it is complete: <save>/iter_NNNNNNN.partial. One left behind is the
// debris of an interrupted save: never read, removed by the next save of that iteration.
std::filesystem::path staging_dir(const std::filesystem::path& save, int64_t iteration);
// Makes `staging` (shards and manifest written and fsynced) the iteration directory `dir`, by a
// rename, so an iter_* directory always holds a whole checkpoint. An existing `dir` (a save of
// the same iteration again) is renamed aside first and removed after; `dir`'s parent is fsynced.
void publish_iteration_dir(const std::filesystem::path& staging, const std::filesystem::path& dir);
// "model_rank_RRRRR.safetensors" / "optim_rank_RRRRR.safetensors".
std::string shard_name(std::string_view kind, int rank);

// --save checked at start-up, before any training it is meant to keep: the directory is
// created when missing, and a probe file is written, fsynced and removed in it (`who` makes the
// probe's name unique per rank). Throws naming the path, the reason and the fix.
void check_save_dir(const std::filesystem::path& save, const std::string& who);

// The tracker, written last (write_file_atomic: a crash leaves the previous one).
void write_tracker(const std::filesystem::path& save, int64_t iteration);
// The iteration the tracker names; nullopt when there is no tracker (a fresh run). A tracker
// that is not a decimal iteration, or that names a directory without a manifest, throws.
std::optional<int64_t> read_tracker(const std::filesystem::path& save);

// Writes one shard atomically into `dir` and describes it for the manifest (its size and the
// SHA-256 of the bytes written).
ShardFile write_shard(const std::filesystem::path& dir, const std::string& file, int rank,
                      const SafetensorsWriter& shard);
// Writes the manifest (validated first) atomically into `dir`.
void write_manifest(const std::filesystem::path& dir, const Manifest& m);

// When CheckpointReader checks each shard's SHA-256 against the manifest.
enum class HashCheck {
  Upfront,  // every shard, in the constructor, before any tensor is read
  OnOpen,   // each shard when first needed, before any of its tensors is read: a rank that
            // reads a few shards of a large checkpoint hashes only those
  None,
};

// A written checkpoint directory, opened for reading. The constructor reads and validates the
// manifest and checks that every shard exists with the recorded size (and with
// HashCheck::Upfront the recorded SHA-256), all before a tensor is read; shards are opened (and
// validated whole, SafetensorsFile) when first needed.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::filesystem::path& dir,
                            HashCheck hashes = HashCheck::Upfront);

  const Manifest& manifest() const { return manifest_; }
  const std::filesystem::path& dir() const { return dir_; }
  // The global tensor `name`; missing throws naming the checkpoint.
  const GlobalTensor& tensor(std::string_view name) const;

  // Copies indices [offset, offset + length) along dimension `dim` of global tensor `name`
  // (dim = -1: the whole tensor) into dst, whatever slices the checkpoint stored it in (split
  // along the same dimension, or whole): the resharding read. dtype and dst's size must match.
  void read(std::string_view name, std::string_view dtype, int dim, int64_t offset,
            int64_t length, std::span<std::byte> dst);

 private:
  SafetensorsFile& shard(const std::string& file);

  void check_hash(const ShardFile& f, std::span<const std::byte> bytes) const;

  std::filesystem::path dir_;
  HashCheck hashes_;
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>, std::less<>> shards_;
};

}  // namespace moecore::ckpt
