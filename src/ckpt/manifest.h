// The checkpoint manifest (docs/checkpoint_format.md, "Manifest"): every global tensor with its
// dtype and global shape, the shard file and range of each of its slices, and every shard's size
// and SHA-256. It is what makes a directory a checkpoint and what resharding reads: a rank of
// any layout finds the slices overlapping its part of a tensor here. Parsing validates all of it
// (format, version, names, slices tiling each tensor exactly once) before any shard is opened.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moecore::ckpt {

inline constexpr std::string_view kManifestFormat = "moecore-checkpoint";
// Format versions. 0: slices split one dimension, or are flat. 1 adds slices in parts and with a
// second split dimension (tensor and expert tensor parallelism). 2 adds ranged slices (a flat
// range of a slice's own storage: the distributed optimizer's piece of a tensor-parallel slice).
// A writer writes the lowest version its slices need (Manifest::needed_version): a checkpoint of
// a layout without them stays at the older version, which an older moecore reads; an older
// moecore refuses a newer manifest by its version instead of misreading its slices (it would
// ignore the keys it does not know). This moecore reads all three. The shards' per-chunk digests
// need no version: a reader that ignores them still checks the whole-shard SHA-256.
inline constexpr int kManifestVersion = 0;
inline constexpr int kManifestVersionParted = 1;
inline constexpr int kManifestVersionRanged = 2;
inline constexpr int kManifestNewestVersion = kManifestVersionRanged;
// The most parts a slice's dimension may have (SwiGLU's fc1 has 2): a bound on the intervals
// that validation and reads walk, whatever a manifest claims.
inline constexpr int kMaxSliceParts = 1024;

struct ShardFile {
  std::string file;  // a name inside the checkpoint directory
  int rank = 0;      // the global rank that wrote it
  uint64_t bytes = 0;
  std::string sha256;  // 64 lowercase hex digits, of the whole file
  // The SHA-256 of each chunk of chunk_bytes bytes of the file (from byte 0, the header
  // included; the last chunk short), so a reader verifies the byte ranges it reads without
  // reading the whole file. chunk_bytes = 0: none (written before they existed).
  uint64_t chunk_bytes = 0;
  std::vector<std::string> chunk_sha256;
  uint64_t num_chunks() const {
    return chunk_bytes == 0 ? 0 : (bytes + chunk_bytes - 1) / chunk_bytes;
  }
};

// One split dimension of a slice: dimension `dim` (of extent X) is `parts` equal chunks of X /
// parts indices, and the slice holds indices [offset, offset + length) of every chunk, the
// chunks' pieces back to back (SwiGLU's [gate; up] rows under tensor parallelism: parts = 2).
// dim = -1: not split.
struct SliceDim {
  int dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
  int parts = 1;
  bool split() const { return dim >= 0; }
  int64_t local_extent() const { return length * parts; }
};

// A range of a slice's storage: its elements [offset, offset + length) in row-major order.
// length = -1: none (the whole slice).
struct StorageRange {
  int64_t offset = 0;
  int64_t length = -1;
  bool set() const { return length >= 0; }
  bool operator==(const StorageRange&) const = default;
};

// A slice of a global tensor, stored in `file` under the tensor's global name. dim = -1: the
// whole tensor. dim >= 0: indices [offset, offset + length) of each of the `parts` chunks of
// dimension `dim`, and, when `second` splits a later dimension, that dimension's indices too:
// the shard holds the global shape with shape[dim] = length * parts (and shape[second.dim] =
// second.length * second.parts), in row-major order (a rank's local tensor under tensor and
// expert parallelism, written as it is). dim = kFlat: elements [offset, offset + length) of the
// tensor flattened in row-major order, stored as a 1-D tensor of `length` elements (the
// distributed optimizer's shard of a moment, whose boundaries may cut a row). A slice of
// dimensions with a `range` (version 2) holds only elements [range.offset, range.offset +
// range.length) of that slice's row-major storage, stored as a 1-D tensor of range.length
// elements: the distributed optimizer's piece of a slice that is not one run of the flattened
// tensor (its local elements in row-major order are increasing in the global flat index, so
// the piece is a sequence of runs of the flattened tensor).
struct SliceRef {
  static constexpr int kWhole = -1;
  static constexpr int kFlat = -2;
  std::string file;
  int dim = kWhole;
  int64_t offset = 0;
  int64_t length = 0;
  int parts = 1;
  SliceDim second{};
  StorageRange range{};
  bool flat() const { return dim == kFlat; }
  bool whole() const { return dim == kWhole; }
  bool ranged() const { return range.set(); }
  // One dimension, one chunk: the form version 0 knows.
  bool simple() const { return parts == 1 && !second.split() && !ranged(); }
  SliceDim first() const { return SliceDim{dim, offset, length, parts}; }
  // The slice without its range: the box of the tensor whose storage the range indexes.
  SliceRef base() const {
    SliceRef b = *this;
    b.range = {};
    return b;
  }
};

struct GlobalTensor {
  std::string name;
  std::string dtype;  // a safetensors dtype ("F32", "BF16", ...)
  std::vector<int64_t> shape;
  std::vector<SliceRef> slices;
  // The shape of slice s as stored in its shard.
  std::vector<int64_t> slice_shape(const SliceRef& s) const;
  // The number of elements (shape's product; the manifest's validation proved it fits).
  int64_t numel() const;
};

struct Manifest {
  int64_t iteration = 0;
  int world_size = 1;
  std::map<std::string, int64_t> layout;  // the writer's parallel sizes ("dp", "ep", ...)
  nlohmann::json state = nlohmann::json::object();  // the run state (iteration counters, RNG)
  std::vector<ShardFile> files;
  std::vector<GlobalTensor> tensors;

  const GlobalTensor* find(std::string_view name) const;
  const ShardFile* file(std::string_view name) const;
  // The lowest format version that describes every slice: 2 when one has a range, else 1 when
  // one is in parts or splits two dimensions, else 0. to_json_text writes it.
  int needed_version() const;
  // Deterministic JSON text (files and tensors in their order here).
  std::string to_json_text() const;
};

// Throws moecore::Error (each message starts "[checkpoint] '<where>': ") unless m is complete:
// the format version known; files unique, plain names, ranks within the world, hashes well
// formed (with chunk digests: one per chunk); tensors unique with known dtypes and non-negative
// shapes; every slice in a listed file, and the slices of each tensor either one whole-tensor
// slice, or slices of one dimension tiling [0, shape[dim]) exactly, or flat slices tiling
// [0, numel) exactly, without gaps or overlaps, or (versions 1 and 2) slices in parts, of two
// dimensions or ranged: the ranges of each base slice tiling its storage exactly, the base
// slices each in bounds (a parted dimension divisible by its parts), pairwise disjoint, their
// volumes adding up to the tensor's. Linear in the slices but for the pairs of base slices whose
// spans of the flattened tensor overlap (a few per slice in the layouts of tensor and expert
// parallelism).
void validate_manifest(const Manifest& m, const std::string& where);
// Parses the JSON text of a manifest (versions 0 to 2; a version 0 one may hold only slices of
// one dimension in one part, a version 1 one no ranges) and validates it (validate_manifest).
Manifest parse_manifest(std::string_view text, const std::string& where);

// A multi-rank save: each rank describes the shards it wrote (their files, and the slices of
// the global tensors they hold) as a part, a Manifest sent as its to_json_text;
// parse_manifest_part reads one (the format and every field checked, but not that its slices
// cover each tensor). merge_manifest_parts joins the parts in rank order: the files, and for
// each tensor its slices in offset order, its dtype and global shape equal in every part that
// holds it. validate_manifest on the result proves every global tensor is covered exactly once.
Manifest parse_manifest_part(std::string_view text, const std::string& where);
Manifest merge_manifest_parts(const std::vector<Manifest>& parts, const std::string& where);

}  // namespace moecore::ckpt
