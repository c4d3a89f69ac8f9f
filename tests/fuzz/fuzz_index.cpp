// libFuzzer target for Megatron's indexed dataset reader (src/data/indexed_dataset.cpp): a .idx
// and a .bin beside it, opened by prefix as --data-path does. Either the pair opens into a
// dataset whose every sequence lies inside the .bin, whose document indices are in order, and
// whose every token reads as an id or as a moecore::Error naming it, or the opening fails with
// moecore::Error.
//
// Input: 3 bytes that choose the .bin, then the .idx.
//   byte 0 % 4: 0 the .bin the index needs (its last sequence's end) plus byte 1 as a signed
//               delta; 1 no .bin; 2 an empty .bin; 3 bytes 1-2 (little-endian) as the size
//   byte 2:     the .bin's contents: 0 all zero (every token an id 0), else a pattern from it
//               (negative ints, NaNs, ids past 2^31 in the wide dtypes)
// The seeds (tests/fuzz/corpus/index/) carry these bytes in front of the committed indices.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/indexed_dataset.h"
#include "fuzz_common.h"

namespace {

using namespace moecore::data;

constexpr int64_t kMaxBin = 1 << 16;  // bigger .bin files only slow the target down

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Where the last sequence of a (possibly corrupt) index ends, read without trusting it: 0 when
// the header does not hold together, the size clamped to kMaxBin.
int64_t bin_bytes_needed(const uint8_t* idx, size_t size) {
  if (size < kIndexHeaderBytes || !is_valid_dtype_code(idx[17])) return 0;
  const uint64_t sc = load<uint64_t>(idx + 18);
  if (sc == 0 || sc > (size - kIndexHeaderBytes) / 12) return 0;
  const uint8_t* lengths = idx + kIndexHeaderBytes;
  const uint8_t* pointers = lengths + 4 * sc;
  const int64_t ptr = load<int64_t>(pointers + 8 * (sc - 1));
  const int64_t len = load<int32_t>(lengths + 4 * (sc - 1));
  const int64_t item = dtype_size(static_cast<TokenDType>(idx[17]));
  if (ptr < 0 || ptr > kMaxBin || len < 0 || len > kMaxBin) return 0;
  return std::min<int64_t>(ptr + len * item, kMaxBin);
}

// The properties of an accepted index (parse_index's promises).
void check_view(const IndexView& v, int64_t bin_bytes) {
  const int64_t item = dtype_size(v.dtype);
  int64_t end = 0;
  for (int64_t i = 0; i < v.sequence_count; ++i) {
    const int64_t p = v.sequence_pointer(i), n = v.sequence_length(i);
    FUZZ_EXPECT(n >= 0 && p >= end);
    end = p + n * item;
    FUZZ_EXPECT(bin_bytes < 0 || end <= bin_bytes);
  }
  FUZZ_EXPECT(v.document_count >= 1 && v.document_index(0) == 0);
  FUZZ_EXPECT(v.document_index(v.document_count - 1) == v.sequence_count);
  for (int64_t d = 1; d < v.document_count; ++d) {
    FUZZ_EXPECT(v.document_index(d) >= v.document_index(d - 1));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t mode = data[0] % 4, fill = data[2];
  const uint8_t* idx = data + 3;
  const size_t idx_size = size - 3;

  // The image alone, checked against no .bin.
  try {
    check_view(parse_index(idx, idx_size, "fuzz.idx", -1), -1);
  } catch (const moecore::Error&) {
  }

  int64_t bin_size = -1;  // -1: no .bin
  if (mode == 0) {
    bin_size = std::clamp<int64_t>(bin_bytes_needed(idx, idx_size) + static_cast<int8_t>(data[1]),
                                   0, kMaxBin);
  } else if (mode == 2) {
    bin_size = 0;
  } else if (mode == 3) {
    bin_size = data[1] | (data[2] << 8);
  }
  moecore::fuzz::write_file("ds.idx", idx, idx_size);
  if (bin_size < 0) {
    moecore::fuzz::remove_file("ds.bin");
  } else {
    std::vector<uint8_t> bin(static_cast<size_t>(bin_size));
    for (size_t i = 0; fill != 0 && i < bin.size(); ++i) bin[i] = static_cast<uint8_t>(i * fill + (i >> 3));
    moecore::fuzz::write_file("ds.bin", bin.data(), bin.size());
  }
  try {
    const IndexedDataset ds((moecore::fuzz::scratch_dir() / "ds").string());
    FUZZ_EXPECT(bin_size >= 0);
    check_view(parse_index(idx, idx_size, "fuzz.idx", bin_size), bin_size);
    FUZZ_EXPECT(ds.num_documents() >= 0);
    const std::vector<int32_t> lengths = ds.sequence_lengths();
    FUZZ_EXPECT(static_cast<int64_t>(lengths.size()) == ds.num_sequences());
    int64_t tokens = 0;
    std::vector<int32_t> out;
    for (int64_t i = 0; i < ds.num_sequences(); ++i) {
      FUZZ_EXPECT(lengths[i] == ds.sequence_length(i));
      tokens += lengths[i];
      out.assign(lengths[i], -1);
      try {
        ds.get(i, 0, lengths[i], out.data());
        for (int32_t t : out) FUZZ_EXPECT(t >= 0);
      } catch (const moecore::Error&) {
        // a token that is not an id: named in the message
      }
    }
    FUZZ_EXPECT(tokens == ds.num_tokens());
  } catch (const moecore::Error&) {
  }
  return 0;
}
