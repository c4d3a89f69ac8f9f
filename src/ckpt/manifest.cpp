#include "ckpt/manifest.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "ckpt/safetensors.h"
#include "ckpt/slice_geometry.h"
#include "ckpt/sha256.h"
#include "core/check.h"
#include "core/shape.h"

namespace moecore::ckpt {
namespace {

using nlohmann::json;

// A file name that stays inside the checkpoint directory.
bool plain_name(std::string_view f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string_view::npos &&
         f.find('\\') == std::string_view::npos;
}

std::string slice_kind(const SliceRef& s) {
  return s.flat() ? "flat" : s.dim < 0 ? "whole" : fmt::format("dimension {}", s.dim);
}

std::string dim_text(const SliceDim& d) {
  std::string t = fmt::format("dimension {} [{}, {})", d.dim, d.offset, d.offset + d.length);
  if (d.parts > 1) t += fmt::format(" of each of {} parts", d.parts);
  return t;
}

// A slice in parts or of two dimensions, as messages name it.
std::string slice_text(const SliceRef& s) {
  if (s.flat()) return fmt::format("flat [{}, {})", s.offset, s.offset + s.length);
  if (s.whole() && !s.ranged()) return "whole";
  std::string t = s.whole() ? std::string("whole") : dim_text(s.first());
  if (s.second.split()) t += " x " + dim_text(s.second);
  if (s.ranged())
    t += fmt::format(", storage [{}, {})", s.range.offset, s.range.offset + s.range.length);
  return t;
}

// One split dimension of a slice of t lies in the tensor: an existing dimension whose extent is
// `parts` equal chunks, [offset, offset + length) inside a chunk.
void check_dim(const GlobalTensor& t, const SliceDim& d, const SliceRef& s,
               const std::string& where) {
  const int ndim = static_cast<int>(t.shape.size());
  MOE_CHECK(d.dim >= 0 && d.dim < ndim,
            "[checkpoint] '{}': tensor '{}' {}: a slice of '{}' splits dimension {}", where,
            t.name, format_shape(t.shape), s.file, d.dim);
  const int64_t extent = t.shape[d.dim];
  MOE_CHECK(d.parts >= 1 && d.parts <= kMaxSliceParts && extent % d.parts == 0,
            "[checkpoint] '{}': tensor '{}' {}: a slice of '{}' takes dimension {} ({} indices) "
            "as {} equal parts",
            where, t.name, format_shape(t.shape), s.file, d.dim, extent, d.parts);
  const int64_t chunk = extent / d.parts;
  MOE_CHECK(d.offset >= 0 && d.length >= 0 && d.offset <= chunk && d.length <= chunk - d.offset,
            "[checkpoint] '{}': tensor '{}' {}: the slice of '{}' ({}) is out of bounds: a part "
            "of dimension {} has {} indices",
            where, t.name, format_shape(t.shape), s.file, dim_text(d), d.dim, chunk);
}

// A base slice (the slice without its range) as a key: the slices that share one are the
// pieces of one box.
using BoxKey = std::tuple<int, int64_t, int64_t, int, int, int64_t, int64_t, int>;
BoxKey box_key(const SliceRef& s) {
  return {s.dim,        s.offset,        s.length,        s.parts,
          s.second.dim, s.second.offset, s.second.length, s.second.parts};
}

// The pieces of one box (its slices, ranged or whole) tile its storage [0, n) exactly.
void tile_ranges(const GlobalTensor& t, std::vector<const SliceRef*>& pieces, int64_t n,
                 const std::string& where) {
  const auto begin = [](const SliceRef* s) { return s->ranged() ? s->range.offset : 0; };
  const auto size = [n](const SliceRef* s) { return s->ranged() ? s->range.length : n; };
  for (const SliceRef* s : pieces) {
    MOE_CHECK(begin(s) >= 0 && size(s) >= 0 && begin(s) <= n && size(s) <= n - begin(s),
              "[checkpoint] '{}': tensor '{}' {}: the slice of '{}' ({}) runs past the {} "
              "elements of its slice's storage",
              where, t.name, format_shape(t.shape), s->file, slice_text(*s), n);
  }
  std::stable_sort(pieces.begin(), pieces.end(),
                   [&](const SliceRef* a, const SliceRef* b) { return begin(a) < begin(b); });
  int64_t next = 0;
  const SliceRef* prev = nullptr;
  for (const SliceRef* s : pieces) {
    MOE_CHECK(begin(s) >= next,
              "[checkpoint] '{}': tensor '{}' {}: the slices of '{}' ({}) and '{}' ({}) overlap: "
              "the slices must hold every element once",
              where, t.name, format_shape(t.shape), prev->file, slice_text(*prev), s->file,
              slice_text(*s));
    MOE_CHECK(begin(s) == next,
              "[checkpoint] '{}': tensor '{}' {}: elements [{}, {}) of the storage of slice {} "
              "are in no slice ({}): a slice is missing",
              where, t.name, format_shape(t.shape), next, begin(s), slice_text(s->base()),
              prev ? fmt::format("after the one of '{}'", prev->file)
                   : fmt::format("before the one of '{}'", s->file));
    next += size(s);
    prev = s;
  }
  MOE_CHECK(next == n,
            "[checkpoint] '{}': tensor '{}' {}: elements [{}, {}) of the storage of slice {} are "
            "in no slice (after the one of '{}'): a slice is missing",
            where, t.name, format_shape(t.shape), next, n, slice_text(prev->base()), prev->file);
}

// Slices in parts, of two dimensions or ranged (versions 1 and 2): the pieces of each base slice
// tiling its storage, the base slices each in bounds, no two sharing an element, their volumes
// adding up to the tensor's, so they hold every element exactly once. Two base slices can share
// an element only when their spans of the flattened tensor overlap: a sweep in span order
// compares those pairs only (the ETP slices of an EP slice, the TP slices of a row-parallel
// weight), not every pair.
void tile_boxes(const GlobalTensor& t, int64_t numel, const std::string& where) {
  for (const SliceRef& s : t.slices) {
    MOE_CHECK(!s.flat(),
              "[checkpoint] '{}': tensor '{}' has slices of two kinds (flat and {}): its slices "
              "split dimensions, or all are flat",
              where, t.name, slice_text(t.slices[0].flat() ? t.slices.back() : t.slices[0]));
    if (s.whole()) {
      MOE_CHECK(s.parts == 1 && !s.second.split() && !s.ranged(),
                "[checkpoint] '{}': tensor '{}': a whole-tensor slice of '{}' has parts, a "
                "second dimension or a range",
                where, t.name, s.file);
    } else {
      check_dim(t, s.first(), s, where);
    }
    if (s.second.split()) {
      check_dim(t, s.second, s, where);
      MOE_CHECK(s.second.dim > s.dim,
                "[checkpoint] '{}': tensor '{}': a slice of '{}' has second dimension {} after "
                "dimension {}: the second split dimension is a later one",
                where, t.name, s.file, s.second.dim, s.dim);
    }
  }
  // The pieces of each box: the storage tiled.
  std::map<BoxKey, std::vector<const SliceRef*>> boxes;
  for (const SliceRef& s : t.slices) boxes[box_key(s)].push_back(&s);
  struct Box {
    const SliceRef* s;  // its first piece in the manifest (the base is the same for all)
    int64_t n;          // its elements
    int64_t lo, hi;     // its span of the flattened tensor
  };
  std::vector<Box> order;
  for (auto& [key, pieces] : boxes) {
    const int64_t n = box_numel(*pieces[0], t.shape);
    tile_ranges(t, pieces, n, where);
    if (n == 0) continue;
    const auto [lo, hi] = box_span(*pieces[0], t.shape);
    order.push_back({*std::min_element(pieces.begin(), pieces.end()), n, lo, hi});
  }
  // By span, ties in manifest order (the messages name the earlier slice first).
  std::sort(order.begin(), order.end(),
            [](const Box& a, const Box& b) { return std::pair(a.lo, a.s) < std::pair(b.lo, b.s); });
  std::vector<const Box*> open;  // boxes whose span reaches past the current one's start
  for (const Box& b : order) {
    std::erase_if(open, [&](const Box* o) { return o->hi <= b.lo; });
    for (const Box* o : open) {
      MOE_CHECK(!boxes_intersect(o->s->base(), b.s->base(), t.shape),
                "[checkpoint] '{}': tensor '{}' {}: the slices of '{}' ({}) and '{}' ({}) "
                "overlap: the slices must hold every element once",
                where, t.name, format_shape(t.shape), o->s->file, slice_text(*o->s), b.s->file,
                slice_text(*b.s));
    }
    open.push_back(&b);
  }
  // Disjoint and in bounds: the volumes add up to at most numel.
  int64_t volume = 0;
  for (const Box& b : order) volume += b.n;
  MOE_CHECK(volume == numel,
            "[checkpoint] '{}': tensor '{}' {}: its {} slices hold {} of its {} elements: a slice "
            "is missing",
            where, t.name, format_shape(t.shape), t.slices.size(), volume, numel);
}

// The slices of t (all of one kind: along one dimension, or flat) cover [0, extent) of their
// index exactly once.
// `index` names it in messages ("dimension 0", "the flattened tensor").
void tile(const GlobalTensor& t, int64_t extent, const std::string& index,
          const std::string& where) {
  const std::string along = t.slices[0].flat() ? "in flat order" : "along " + index;
  std::vector<const SliceRef*> order;
  for (const SliceRef& s : t.slices) {
    MOE_CHECK(s.dim == t.slices[0].dim || s.dim < 0 || t.slices[0].dim < 0,
              "[checkpoint] '{}': tensor '{}' is split along dimension {} in one slice and {} in "
              "another: its slices must split one dimension",
              where, t.name, t.slices[0].dim, s.dim);
    MOE_CHECK(s.dim == t.slices[0].dim,
              "[checkpoint] '{}': tensor '{}' has slices of two kinds ({} and {}): its slices "
              "split one dimension, or all are flat",
              where, t.name, slice_kind(t.slices[0]), slice_kind(s));
    MOE_CHECK(s.offset >= 0 && s.length >= 0,
              "[checkpoint] '{}': tensor '{}' has a slice at offset {} of length {}", where,
              t.name, s.offset, s.length);
    order.push_back(&s);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const SliceRef* a, const SliceRef* b) { return a->offset < b->offset; });
  int64_t next = 0;  // <= extent: no slice may end past it (nor overflow)
  for (const SliceRef* s : order) {
    MOE_CHECK(s->offset == next,
              "[checkpoint] '{}': tensor '{}' {}: a slice starts at {} where {} was expected ({} "
              "a slice of '{}'): the slices must cover every index once",
              where, t.name, along, s->offset, next, s->offset < next ? "overlap with" : "gap before",
              s->file);
    MOE_CHECK(s->length <= extent - next,
              "[checkpoint] '{}': tensor '{}' {}: a slice of '{}' at offset {} of length {} runs "
              "past {} ({} indices)",
              where, t.name, format_shape(t.shape), s->file, s->offset, s->length, index, extent);
    next += s->length;
  }
  MOE_CHECK(next == extent, "[checkpoint] '{}': tensor '{}' {}: its slices cover {} of the {} "
            "indices of {}", where, t.name, format_shape(t.shape), next, extent, index);
}

void validate_slices(const GlobalTensor& t, const std::set<std::string_view>& files,
                     const std::string& where) {
  MOE_CHECK(!t.slices.empty(), "[checkpoint] '{}': tensor '{}' has no slice", where, t.name);
  for (size_t i = 0; i < t.slices.size(); ++i) {
    MOE_CHECK(files.count(t.slices[i].file) > 0,
              "[checkpoint] '{}': slice {} of tensor '{}' is in '{}', which is not among the "
              "manifest's files",
              where, i, t.name, t.slices[i].file);
  }
  const int dim = t.slices[0].dim;
  int64_t numel = 1;  // the shape's product, which must fit (a flat offset indexes it)
  for (int64_t d : t.shape) {
    MOE_CHECK(!__builtin_mul_overflow(numel, d, &numel),
              "[checkpoint] '{}': tensor '{}' {} has more than 2^63 elements", where, t.name,
              format_shape(t.shape));
  }
  if (!std::all_of(t.slices.begin(), t.slices.end(),
                   [](const SliceRef& s) { return s.simple(); })) {
    tile_boxes(t, numel, where);
    return;
  }
  if (dim == SliceRef::kFlat) {
    tile(t, numel, "the flattened tensor", where);
    return;
  }
  if (dim < 0) {
    MOE_CHECK(t.slices.size() == 1 && dim == -1,
              "[checkpoint] '{}': tensor '{}' has a whole-tensor slice and {} others: a tensor "
              "is stored whole once or split along one dimension",
              where, t.name, t.slices.size() - 1);
    return;
  }
  const int ndim = static_cast<int>(t.shape.size());
  MOE_CHECK(dim < ndim, "[checkpoint] '{}': tensor '{}' {} is split along dimension {}", where,
            t.name, format_shape(t.shape), dim);
  tile(t, t.shape[dim], fmt::format("dimension {}", dim), where);
}

json slice_json(const SliceRef& s) {
  json j = {{"file", s.file}};
  if (s.flat()) {
    j["flat_offset"] = s.offset;
    j["flat_length"] = s.length;
  } else if (s.dim >= 0) {
    j["dim"] = s.dim;
    j["offset"] = s.offset;
    j["length"] = s.length;
    if (s.parts != 1) j["parts"] = s.parts;
    if (s.second.split()) {
      j["second"] = {{"dim", s.second.dim}, {"offset", s.second.offset},
                     {"length", s.second.length}};
      if (s.second.parts != 1) j["second"]["parts"] = s.second.parts;
    }
    if (s.ranged()) j["range"] = {{"offset", s.range.offset}, {"length", s.range.length}};
  }
  return j;
}

// The value of a required key, with the kind it must have; the message names the entry.
const json& need(const json& obj, const char* key, json::value_t kind, const std::string& what,
                 const std::string& where) {
  MOE_CHECK(obj.is_object() && obj.contains(key),
            "[checkpoint] '{}': {} has no \"{}\"", where, what, key);
  const json& v = obj.at(key);
  const bool ok = kind == json::value_t::number_integer
                      ? v.is_number_integer()
                      : (kind == json::value_t::string ? v.is_string()
                                                       : (kind == json::value_t::array
                                                              ? v.is_array()
                                                              : v.is_object()));
  MOE_CHECK(ok, "[checkpoint] '{}': \"{}\" of {} is {}, not {}", where, key, what, v.type_name(),
            json(kind).type_name());
  return v;
}

// Whether the JSON integer v is a value of T (int, int64_t, uint64_t): a number outside T must
// fail, not wrap around (a world size of 2^32 + 1 is not a world of 1, -1 bytes not 2^64 - 1).
template <typename T>
bool fits(const json& v) {
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  const int64_t x = v.get<int64_t>();
  return x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
         (x < 0 || static_cast<uint64_t>(x) <= static_cast<uint64_t>(std::numeric_limits<T>::max()));
}

// need(obj, key, integer) read as T, its range checked.
template <typename T>
T need_int(const json& obj, const char* key, const std::string& what, const std::string& where) {
  const json& v = need(obj, key, json::value_t::number_integer, what, where);
  MOE_CHECK(fits<T>(v), "[checkpoint] '{}': \"{}\" of {} is {}, outside [{}, {}]", where, key,
            what, v.dump(), std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  return v.get<T>();
}

// The run state's fields that loading, --use-checkpoint-args and export read, typed here so a
// corrupt or hand-edited manifest fails naming the key, never as a json type_error when read;
// and the model signature complete, since loading compares only the keys it holds (an empty
// "model" would turn the model check off).
void validate_state(const json& state, int64_t iteration, const std::string& where) {
  auto key_of = [&](const json& obj, const char* key, bool (json::*is)() const noexcept,
                    const char* kind, const std::string& path) -> const json* {
    const auto it = obj.find(key);
    if (it == obj.end()) return nullptr;
    MOE_CHECK(((*it).*is)(), "[checkpoint] '{}': {}.{} is {}, not {}", where, path, key,
              it->dump(), kind);
    return &*it;
  };
  for (const char* k : {"iteration", "optimizer_steps", "consumed_train_samples",
                        "consumed_valid_samples"}) {
    if (const json* v = key_of(state, k, &json::is_number_integer, "an integer", "state")) {
      MOE_CHECK(fits<int64_t>(*v) && v->get<int64_t>() >= 0,
                "[checkpoint] '{}': state.{} is {}, not a count >= 0", where, k, v->dump());
    }
  }
  if (const json* v = key_of(state, "iteration", &json::is_number_integer, "an integer", "state")) {
    MOE_CHECK(v->get<int64_t>() == iteration,
              "[checkpoint] '{}': state.iteration {} differs from the manifest's iteration {}",
              where, v->dump(), iteration);
  }
  key_of(state, "has_optimizer", &json::is_boolean, "true or false", "state");
  if (const json* args = key_of(state, "args", &json::is_array, "a list of strings", "state")) {
    for (const json& a : *args) {
      MOE_CHECK(a.is_string(), "[checkpoint] '{}': state.args holds {}, not a string", where,
                a.dump());
    }
  }
  if (const json* rng = key_of(state, "rng", &json::is_object, "an object", "state")) {
    key_of(*rng, "seed", &json::is_number_integer, "an integer", "state.rng");
    key_of(*rng, "router_jitter_step", &json::is_number_integer, "an integer", "state.rng");
  }
  if (const json* hf = key_of(state, "hf", &json::is_object, "an object", "state")) {
    key_of(*hf, "architecture", &json::is_string, "a string", "state.hf");
    key_of(*hf, "config", &json::is_object, "an object", "state.hf");
  }
  if (const json* model = key_of(state, "model", &json::is_object, "an object", "state")) {
    for (const char* k : {"--num-layers", "--hidden-size", "--num-attention-heads"}) {
      MOE_CHECK(model->contains(k),
                "[checkpoint] '{}': state.model has no \"{}\": the model signature that "
                "loading compares is incomplete (the manifest was altered)",
                where, k);
    }
    // The vocabulary: "--vocab-size" (the model's), or "--vocab-size (padded)" in checkpoints
    // written while the padding was part of the model (loading refuses those by name).
    MOE_CHECK(model->contains("--vocab-size") || model->contains("--vocab-size (padded)"),
              "[checkpoint] '{}': state.model has no \"--vocab-size\": the model signature that "
              "loading compares is incomplete (the manifest was altered)",
              where);
    for (const char* k :
         {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
          "--num-query-groups", "--kv-channels", "--vocab-size", "--vocab-size (padded)",
          "--num-experts", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"}) {
      key_of(*model, k, &json::is_number_integer, "an integer", "state.model");
    }
  }
}

}  // namespace

std::vector<int64_t> GlobalTensor::slice_shape(const SliceRef& s) const {
  if (s.flat()) return {s.length};
  if (s.ranged()) return {s.range.length};
  std::vector<int64_t> out = shape;
  if (s.dim >= 0 && s.dim < static_cast<int>(out.size())) out[s.dim] = s.length * s.parts;
  const SliceDim& d = s.second;
  if (d.split() && d.dim < static_cast<int>(out.size())) out[d.dim] = d.length * d.parts;
  return out;
}

int64_t GlobalTensor::numel() const { return shape_numel(shape); }

const GlobalTensor* Manifest::find(std::string_view name) const {
  for (const GlobalTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int Manifest::needed_version() const {
  int v = kManifestVersion;
  for (const GlobalTensor& t : tensors) {
    for (const SliceRef& s : t.slices) {
      if (s.ranged()) return kManifestVersionRanged;
      if (!s.simple()) v = kManifestVersionParted;
    }
  }
  return v;
}

const ShardFile* Manifest::file(std::string_view name) const {
  for (const ShardFile& f : files) {
    if (f.file == name) return &f;
  }
  return nullptr;
}

void validate_manifest(const Manifest& m, const std::string& where) {
  MOE_CHECK(m.iteration >= 0, "[checkpoint] '{}': iteration {} < 0", where, m.iteration);
  MOE_CHECK(m.world_size >= 1, "[checkpoint] '{}': world size {} < 1", where, m.world_size);
  std::set<std::string_view> files;
  for (const ShardFile& f : m.files) {
    MOE_CHECK(plain_name(f.file),
              "[checkpoint] '{}': shard name '{}' is not a plain file name inside the checkpoint "
              "directory",
              where, f.file);
    MOE_CHECK(files.insert(f.file).second, "[checkpoint] '{}': shard '{}' is listed twice",
              where, f.file);
    MOE_CHECK(f.rank >= 0 && f.rank < m.world_size,
              "[checkpoint] '{}': shard '{}' was written by rank {} of a world of {}", where,
              f.file, f.rank, m.world_size);
    MOE_CHECK(is_sha256_hex(f.sha256),
              "[checkpoint] '{}': shard '{}' has sha256 '{}', not 64 lowercase hex digits", where,
              f.file, f.sha256);
    MOE_CHECK(f.chunk_sha256.size() == f.num_chunks(),
              "[checkpoint] '{}': shard '{}' of {} bytes in chunks of {} has {} chunk digests, "
              "not {}",
              where, f.file, f.bytes, f.chunk_bytes, f.chunk_sha256.size(), f.num_chunks());
    for (size_t c = 0; c < f.chunk_sha256.size(); ++c) {
      MOE_CHECK(is_sha256_hex(f.chunk_sha256[c]),
                "[checkpoint] '{}': shard '{}' has chunk {} sha256 '{}', not 64 lowercase hex "
                "digits",
                where, f.file, c, f.chunk_sha256[c]);
    }
  }
  std::set<std::string_view> names;
  for (const GlobalTensor& t : m.tensors) {
    MOE_CHECK(!t.name.empty(), "[checkpoint] '{}': a tensor has an empty name", where);
    MOE_CHECK(names.insert(t.name).second, "[checkpoint] '{}': tensor '{}' is listed twice",
              where, t.name);
    MOE_CHECK(is_known_dtype(t.dtype), "[checkpoint] '{}': tensor '{}' has dtype '{}' (known: {})",
              where, t.name, t.dtype, known_dtypes());
    for (int64_t d : t.shape) {
      MOE_CHECK(d >= 0, "[checkpoint] '{}': tensor '{}' has shape {}", where, t.name,
                format_shape(t.shape));
    }
    validate_slices(t, files, where);
  }
}

std::string Manifest::to_json_text() const {
  json j;
  j["format"] = kManifestFormat;
  j["format_version"] = needed_version();
  j["iteration"] = iteration;
  j["world_size"] = world_size;
  j["layout"] = json::object();
  for (const auto& [k, v] : layout) j["layout"][k] = v;
  j["state"] = state;
  j["files"] = json::array();
  for (const ShardFile& f : files) {
    json e = {{"file", f.file}, {"rank", f.rank}, {"bytes", f.bytes}, {"sha256", f.sha256}};
    if (f.chunk_bytes > 0) {
      e["chunk_bytes"] = f.chunk_bytes;
      e["chunk_sha256"] = f.chunk_sha256;
    }
    j["files"].push_back(std::move(e));
  }
  j["tensors"] = json::array();
  for (const GlobalTensor& t : tensors) {
    json slices = json::array();
    for (const SliceRef& s : t.slices) slices.push_back(slice_json(s));
    j["tensors"].push_back(
        {{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"slices", slices}});
  }
  return j.dump(1) + "\n";
}

Manifest parse_manifest_part(std::string_view text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    MOE_FAIL("[checkpoint] '{}': the manifest is not valid JSON ({}): the save did not finish "
             "or the file was altered",
             where, e.what());
  }
  MOE_CHECK(j.is_object(), "[checkpoint] '{}': the manifest is {}, not a JSON object", where,
            j.type_name());
  const std::string top = "the manifest";
  const std::string format = need(j, "format", json::value_t::string, top, where);
  MOE_CHECK(format == kManifestFormat,
            "[checkpoint] '{}': format '{}' is not '{}': not a moecore checkpoint manifest",
            where, format, kManifestFormat);
  const int64_t version = need_int<int64_t>(j, "format_version", top, where);
  MOE_CHECK(version >= kManifestVersion && version <= kManifestNewestVersion,
            "[checkpoint] '{}': format version {}; this moecore reads version {} to {}{}", where,
            version, kManifestVersion, kManifestNewestVersion,
            version > kManifestNewestVersion ? ": the checkpoint was written by a newer moecore"
                                             : "");
  Manifest m;
  m.iteration = need_int<int64_t>(j, "iteration", top, where);
  m.world_size = need_int<int>(j, "world_size", top, where);
  for (const auto& [k, v] : need(j, "layout", json::value_t::object, top, where).items()) {
    MOE_CHECK(v.is_number_integer() && fits<int64_t>(v),
              "[checkpoint] '{}': layout \"{}\" is {}, not a 64-bit integer", where, k, v.dump());
    m.layout[k] = v.get<int64_t>();
  }
  if (j.contains("state")) m.state = need(j, "state", json::value_t::object, top, where);
  validate_state(m.state, m.iteration, where);
  for (const json& f : need(j, "files", json::value_t::array, top, where)) {
    const std::string what = "a shard entry";
    ShardFile s;
    s.file = need(f, "file", json::value_t::string, what, where);
    s.rank = need_int<int>(f, "rank", "shard '" + s.file + "'", where);
    s.bytes = need_int<uint64_t>(f, "bytes", "shard '" + s.file + "'", where);
    s.sha256 = need(f, "sha256", json::value_t::string, "shard '" + s.file + "'", where);
    if (f.contains("chunk_bytes") || f.contains("chunk_sha256")) {
      s.chunk_bytes = need_int<uint64_t>(f, "chunk_bytes", "shard '" + s.file + "'", where);
      MOE_CHECK(s.chunk_bytes > 0, "[checkpoint] '{}': shard '{}' has chunks of 0 bytes", where,
                s.file);
      const json& c =
          need(f, "chunk_sha256", json::value_t::array, "shard '" + s.file + "'", where);
      MOE_CHECK(c.size() == s.num_chunks(),
                "[checkpoint] '{}': shard '{}' of {} bytes in chunks of {} has {} chunk digests, "
                "not {}",
                where, s.file, s.bytes, s.chunk_bytes, c.size(), s.num_chunks());
      for (const json& d : c) {
        MOE_CHECK(d.is_string(),
                  "[checkpoint] '{}': shard '{}' has a chunk digest {}, not a string", where,
                  s.file, d.dump());
        s.chunk_sha256.push_back(d.get<std::string>());
      }
    }
    m.files.push_back(std::move(s));
  }
  for (const json& t : need(j, "tensors", json::value_t::array, top, where)) {
    GlobalTensor g;
    g.name = need(t, "name", json::value_t::string, "a tensor entry", where);
    const std::string what = "tensor '" + g.name + "'";
    g.dtype = need(t, "dtype", json::value_t::string, what, where);
    for (const json& d : need(t, "shape", json::value_t::array, what, where)) {
      MOE_CHECK(d.is_number_integer() && fits<int64_t>(d),
                "[checkpoint] '{}': {} has a shape entry {}", where, what, d.dump());
      g.shape.push_back(d.get<int64_t>());
    }
    for (const json& s : need(t, "slices", json::value_t::array, what, where)) {
      SliceRef r;
      r.file = need(s, "file", json::value_t::string, "a slice of " + what, where);
      if (s.contains("dim")) {
        r.dim = need_int<int>(s, "dim", "a slice of " + what, where);
        MOE_CHECK(r.dim >= 0, "[checkpoint] '{}': a slice of {} splits dimension {}", where,
                  what, r.dim);
        r.offset = need_int<int64_t>(s, "offset", "a slice of " + what, where);
        r.length = need_int<int64_t>(s, "length", "a slice of " + what, where);
        MOE_CHECK(!s.contains("flat_offset"), "[checkpoint] '{}': a slice of {} has both "
                  "\"dim\" and \"flat_offset\"", where, what);
        // Version 1: a dimension in parts, a second split dimension.
        const auto read_parts = [&](const json& o, const std::string& of) {
          if (!o.contains("parts")) return 1;
          const int p = need_int<int>(o, "parts", of, where);
          MOE_CHECK(p >= 1 && p <= kMaxSliceParts,
                    "[checkpoint] '{}': {} has \"parts\": {}, not in [1, {}]", where, of, p,
                    kMaxSliceParts);
          return p;
        };
        r.parts = read_parts(s, "a slice of " + what);
        if (s.contains("second")) {
          const std::string of = "the second dimension of a slice of " + what;
          const json& d = need(s, "second", json::value_t::object, "a slice of " + what, where);
          r.second.dim = need_int<int>(d, "dim", of, where);
          MOE_CHECK(r.second.dim >= 0, "[checkpoint] '{}': {} is dimension {}", where, of,
                    r.second.dim);
          r.second.offset = need_int<int64_t>(d, "offset", of, where);
          r.second.length = need_int<int64_t>(d, "length", of, where);
          r.second.parts = read_parts(d, of);
        }
        // Version 2: a range of the slice's storage.
        if (s.contains("range")) {
          const std::string of = "the range of a slice of " + what;
          const json& d = need(s, "range", json::value_t::object, "a slice of " + what, where);
          r.range.offset = need_int<int64_t>(d, "offset", of, where);
          r.range.length = need_int<int64_t>(d, "length", of, where);
          MOE_CHECK(r.range.offset >= 0 && r.range.length >= 0,
                    "[checkpoint] '{}': {} is [{}, +{}): its offset and length are counts >= 0",
                    where, of, r.range.offset, r.range.length);
          MOE_CHECK(version >= kManifestVersionRanged,
                    "[checkpoint] '{}': a slice of {} has a range, which format version {} does "
                    "not have (version {} does): the manifest was altered",
                    where, what, version, kManifestVersionRanged);
        }
        MOE_CHECK(version >= kManifestVersionParted || r.base().simple(),
                  "[checkpoint] '{}': a slice of {} is in parts or splits two dimensions, which "
                  "format version {} does not have (version {} does): the manifest was altered",
                  where, what, version, kManifestVersionParted);
      } else if (s.contains("flat_offset")) {
        MOE_CHECK(!s.contains("range"), "[checkpoint] '{}': a flat slice of {} has a \"range\"",
                  where, what);
        r.dim = SliceRef::kFlat;
        r.offset = need_int<int64_t>(s, "flat_offset", "a slice of " + what, where);
        r.length = need_int<int64_t>(s, "flat_length", "a slice of " + what, where);
      } else {
        MOE_CHECK(!s.contains("range") && !s.contains("parts") && !s.contains("second"),
                  "[checkpoint] '{}': a whole-tensor slice of {} has \"range\", \"parts\" or "
                  "\"second\" without \"dim\"",
                  where, what);
      }
      g.slices.push_back(std::move(r));
    }
    m.tensors.push_back(std::move(g));
  }
  return m;
}

Manifest parse_manifest(std::string_view text, const std::string& where) {
  Manifest m = parse_manifest_part(text, where);
  validate_manifest(m, where);
  return m;
}

Manifest merge_manifest_parts(const std::vector<Manifest>& parts, const std::string& where) {
  MOE_CHECK(!parts.empty(), "[checkpoint] '{}': no parts to merge", where);
  Manifest m;
  m.iteration = parts[0].iteration;
  m.world_size = parts[0].world_size;
  std::map<std::string, size_t, std::less<>> index;  // tensor name -> position in m.tensors
  for (size_t r = 0; r < parts.size(); ++r) {
    const Manifest& p = parts[r];
    MOE_CHECK(p.iteration == m.iteration && p.world_size == m.world_size,
              "[checkpoint] '{}': part {} is iteration {} of a world of {}, part 0 iteration {} "
              "of {}: the ranks are not saving the same checkpoint",
              where, r, p.iteration, p.world_size, m.iteration, m.world_size);
    m.files.insert(m.files.end(), p.files.begin(), p.files.end());
    for (const GlobalTensor& t : p.tensors) {
      const auto [it, fresh] = index.try_emplace(t.name, m.tensors.size());
      if (fresh) {
        m.tensors.push_back(t);
        continue;
      }
      GlobalTensor& g = m.tensors[it->second];
      MOE_CHECK(g.dtype == t.dtype && g.shape == t.shape,
                "[checkpoint] '{}': tensor '{}' is {} {} in part {}, {} {} in an earlier part: "
                "the ranks disagree about the model",
                where, t.name, t.dtype, format_shape(t.shape), r, g.dtype, format_shape(g.shape));
      g.slices.insert(g.slices.end(), t.slices.begin(), t.slices.end());
    }
  }
  for (GlobalTensor& g : m.tensors) {
    std::stable_sort(g.slices.begin(), g.slices.end(), [](const SliceRef& a, const SliceRef& b) {
      return std::tuple(a.offset, a.second.offset, a.range.offset) <
             std::tuple(b.offset, b.second.offset, b.range.offset);
    });
  }
  return m;
}

}  // namespace moecore::ckpt
