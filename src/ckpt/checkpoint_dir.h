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

#include <unordered_map>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/safetensors_writer.h"
#include "ckpt/shard_reader.h"

namespace moecore::ckpt {

inline constexpr std::string_view kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr std::string_view kManifestFile = "manifest.json";

// <save>/iter_NNNNNNN (7 digits, more when needed: Megatron-LM's names).
std::filesystem::path iteration_dir(const std::filesystem::path& save, int64_t iteration);
// Where a save writes until it is complete: <save>/iter_NNNNNNN.partial. With its manifest it is
// a finished save not yet published (recovery publishes it); without, an interrupted one
// (recovery removes it). Never read as a checkpoint.
std::filesystem::path staging_dir(const std::filesystem::path& save, int64_t iteration);
// Where a re-save of an existing iteration keeps the earlier copy while the new one is moved
// in: <save>/iter_NNNNNNN.replaced. It exists only between those two renames (and until its
// removal after them); in that window the tracker may name the iteration, whose checkpoint is
// then read from here (find_iteration_dir).
std::filesystem::path replaced_dir(const std::filesystem::path& save, int64_t iteration);
// The directory holding iteration `iteration`'s checkpoint: iteration_dir, or the earlier copy
// at replaced_dir while a re-save is between its two renames. iteration_dir when neither has
// a manifest (so that errors name the usual place).
std::filesystem::path find_iteration_dir(const std::filesystem::path& save, int64_t iteration);

// Rank 0's first step of a save: an empty staging_dir (one left by an interrupted save of the
// same iteration is removed), <save> created when missing and fsynced. Returns the staging dir.
std::filesystem::path begin_staging(const std::filesystem::path& save, int64_t iteration);
// Moves the finished save in staging_dir(save, iteration) (shards and manifest written and
// fsynced) to iteration_dir by a rename, so an iter_* directory always holds a whole
// checkpoint. An existing iteration_dir (a re-save of that iteration) is first renamed to
// replaced_dir, and removed once the new copy is in place; each rename is followed by an fsync
// of <save>. A replaced_dir left by an interrupted re-save is removed only when iteration_dir
// is complete. The tracker is the caller's (write_tracker, after this).
void publish_iteration_dir(const std::filesystem::path& save, int64_t iteration);
// "model_rank_RRRRR.safetensors" / "optim_rank_RRRRR.safetensors".
std::string shard_name(std::string_view kind, int rank);

// The steps of a save, in the order a save passes them, at which the crash tests kill it:
// MOECORE_FAULT="kill:at=<name>[:rank=R]" (core/fault_injection.h) sends SIGKILL to the process
// that reaches the point. docs/checkpoint_format.md, "Kill points", says what each leaves.
struct SaveKillPoint {
  std::string_view name;
  bool replacing_only;  // reached only by a re-save of an existing iteration
};
inline constexpr SaveKillPoint kSaveKillPoints[] = {
    {"save.after_staging", false},          // rank 0: staging dir created, <save> fsynced
    {"save.after_model_shard", false},      // each rank: its model shard written and fsynced
    {"save.after_optim_shard", false},      // each rank: its optimizer shard likewise
    {"save.after_shards", false},           // each rank: all its shards written
    {"save.after_manifest", false},         // rank 0: the manifest durable: the save is finished
    {"publish.before_rename_aside", true},  // rank 0, from here to the tracker
    {"publish.after_rename_aside", true},
    {"publish.after_fsync_aside", true},
    {"publish.before_rename", false},
    {"publish.after_rename", false},
    {"publish.after_fsync", false},
    {"publish.after_remove_aside", true},
    {"save.before_tracker", false},
    {"save.after_tracker", false},
};
// fault::kill_point for one of kSaveKillPoints (a name not in the list is a bug: it throws, so
// the list the tests loop over stays the list of the points in the code).
void save_kill_point(std::string_view name, int rank);

// Startup recovery of a --save / --load directory after a crash in a save (rank 0, before any
// other rank reads it; docs/checkpoint_format.md, "Recovery"). For each iteration with debris:
// a finished staging dir is published (publish_iteration_dir), an unfinished one removed; an
// earlier copy moved aside is restored when iteration_dir is missing, and removed when
// iteration_dir is complete. The tracker is never changed, and the only complete copy of an
// iteration is never removed. Returns what it did, "" when there was nothing to do; a missing
// `save` has nothing to recover.
std::string recover_checkpoint_dir(const std::filesystem::path& save);

// --save checked at start-up, before any training it is meant to keep: the directory is
// created when missing, and a probe file is written, fsynced and removed in it (`who` makes the
// probe's name unique per rank). Throws naming the path, the reason and the fix.
void check_save_dir(const std::filesystem::path& save, const std::string& who);

// The tracker, written last (write_file_atomic: a crash leaves the previous one).
void write_tracker(const std::filesystem::path& save, int64_t iteration);
// The iteration the tracker names; nullopt when there is no tracker (a fresh run). A tracker
// that is not a regular file or not a decimal iteration, or that names an iteration that
// find_iteration_dir does not find, throws (naming the complete copies a crash left, if any).
std::optional<int64_t> read_tracker(const std::filesystem::path& save);

// Writes one shard atomically into `dir`, streamed (SafetensorsWriter::stream), and describes
// it for the manifest: its size, the SHA-256 of the whole file and of each chunk of
// `chunk_bytes` bytes (0: chunk_bytes_for the file's size), hashed as the bytes are written.
ShardFile write_shard(const std::filesystem::path& dir, const std::string& file, int rank,
                      const SafetensorsWriter& shard, uint64_t chunk_bytes = 0);
// Writes the manifest (validated first) atomically into `dir`.
void write_manifest(const std::filesystem::path& dir, const Manifest& m);

// A written checkpoint directory, opened for reading. The constructor reads and validates the
// manifest and checks that every shard exists with the recorded size (and with
// HashCheck::Upfront the recorded digests, each shard hashed whole, streaming), all before a
// tensor is read; a shard is opened when first needed (ShardReader: its header read and
// validated), and only the byte ranges of the slices asked for are read from it, each verified
// (HashCheck::OnRead) before it is used.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::filesystem::path& dir,
                            HashCheck hashes = HashCheck::Upfront);

  const Manifest& manifest() const { return manifest_; }
  const std::filesystem::path& dir() const { return dir_; }
  // The global tensor `name`; missing throws naming the checkpoint.
  const GlobalTensor& tensor(std::string_view name) const;

  // Copies slice `want` of global tensor `name` into dst (want's file is not read): any form,
  // whole, split along one or two dimensions, in parts (a rank's local tensor under tensor and
  // expert parallelism, row-major), flat, or ranged (a range of such a slice's storage), from
  // whatever slices of any of these forms the checkpoint stored it in: the resharding read.
  // dtype and dst's size must match. Reads from each shard only the bytes of its slices that
  // `want` shares.
  void read(std::string_view name, std::string_view dtype, const SliceRef& want,
            std::span<std::byte> dst);
  // Indices [offset, offset + length) along dimension `dim` (dim = -1: the whole tensor).
  void read(std::string_view name, std::string_view dtype, int dim, int64_t offset,
            int64_t length, std::span<std::byte> dst);
  // Elements [offset, offset + length) of the tensor flattened in row-major order: the
  // distributed optimizer's pieces and the reads of whole tensors.
  void read_flat(std::string_view name, std::string_view dtype, int64_t offset, int64_t length,
                 std::span<std::byte> dst);
  // The shards opened so far, and the bytes read from them (whole chunks): what a load reads.
  std::vector<std::string> opened() const;
  uint64_t bytes_read() const;

 private:
  ShardReader& shard(const std::string& file);

  std::filesystem::path dir_;
  HashCheck hashes_;
  Manifest manifest_;
  std::unordered_map<std::string_view, size_t> tensor_index_;  // name -> manifest_.tensors
  std::unordered_map<std::string_view, size_t> file_index_;    // name -> manifest_.files
  ChunkCache cache_;
  std::map<std::string, std::unique_ptr<ShardReader>, std::less<>> shards_;
};

}  // namespace moecore::ckpt
