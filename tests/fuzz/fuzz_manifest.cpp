// libFuzzer target for the checkpoint manifest (src/ckpt/manifest.cpp): any text either parses
// into a manifest that validates, writes itself back as text that parses to the same manifest,
// merges alone into itself, and holds the numbers of the text (none narrowed or wrapped; a
// ranged slice's range inside its slice, the chunk digests one per chunk), or fails with
// moecore::Error. The same text as one rank's part
// of a multi-rank save goes through parse_manifest_part and merge_manifest_parts.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ckpt/manifest.h"
#include "ckpt/slice_geometry.h"
#include "core/check.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::ckpt;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const Manifest m = parse_manifest(text, "fuzz/manifest.json");
    const std::string again = m.to_json_text();
    const Manifest m2 = parse_manifest(again, "fuzz/manifest.json (written back)");
    FUZZ_EXPECT(m2.to_json_text() == again);
    // Accepted numbers are the text's: a world size of 2^32 + 1 is not a world of 1.
    const nlohmann::json j = nlohmann::json::parse(text);
    FUZZ_EXPECT(j["iteration"] == m.iteration && j["world_size"] == m.world_size);
    for (size_t i = 0; i < m.files.size(); ++i) {
      FUZZ_EXPECT(j["files"][i]["rank"] == m.files[i].rank);
      FUZZ_EXPECT(j["files"][i]["bytes"] == m.files[i].bytes);
      // Chunk digests: one per chunk, kept as the text gave them.
      FUZZ_EXPECT(m.files[i].chunk_sha256.size() == m.files[i].num_chunks());
      if (m.files[i].chunk_bytes > 0) {
        FUZZ_EXPECT(j["files"][i]["chunk_bytes"] == m.files[i].chunk_bytes);
        FUZZ_EXPECT(j["files"][i]["chunk_sha256"] == m.files[i].chunk_sha256);
      }
    }
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const nlohmann::json& t = j["tensors"][i];
      FUZZ_EXPECT(t["shape"] == m.tensors[i].shape);
      for (size_t s = 0; s < m.tensors[i].slices.size(); ++s) {
        const SliceRef& r = m.tensors[i].slices[s];
        if (r.dim >= 0) {
          FUZZ_EXPECT(t["slices"][s]["dim"] == r.dim && t["slices"][s]["offset"] == r.offset &&
                      t["slices"][s]["length"] == r.length);
        }
        // A ranged slice (version 2): its range as given, inside its slice's storage, and the
        // manifest's version the one that has ranges.
        FUZZ_EXPECT(r.ranged() == t["slices"][s].contains("range"));
        if (r.ranged()) {
          FUZZ_EXPECT(t["slices"][s]["range"]["offset"] == r.range.offset &&
                      t["slices"][s]["range"]["length"] == r.range.length);
          FUZZ_EXPECT(r.range.offset + r.range.length <= box_numel(r, m.tensors[i].shape));
          FUZZ_EXPECT(j["format_version"] == kManifestVersionRanged);
        }
      }
    }
    const Manifest merged = merge_manifest_parts({m}, "fuzz/manifest.json (merged)");
    validate_manifest(merged, "fuzz/manifest.json (merged)");
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  try {
    const Manifest part = parse_manifest_part(text, "fuzz/part.json");
    const Manifest merged = merge_manifest_parts({part, part}, "fuzz/parts");
    validate_manifest(merged, "fuzz/parts");  // twice the same part: overlapping slices
  } catch (const moecore::Error&) {
  }
  return 0;
}
