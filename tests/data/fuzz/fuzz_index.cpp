// libFuzzer target for the .idx reader: any bytes either parse into a view whose every
// sequence lies inside the (virtual) .bin and whose document indices are in order, or fail
// with moecore::Error. Crashes, sanitizer reports and other exceptions are bugs.
// Built and run by run_fuzz.sh (ctest entry data_fuzz_index); by hand for longer:
//   tests/data/fuzz/run_fuzz.sh clang++ . build 600
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/check.h"
#include "data/indexed_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  // The first byte picks the .bin size the index is checked against (unknown, small or large).
  const int64_t bin_bytes = size == 0 ? -1 : (data[0] % 3 == 0 ? -1 : (data[0] % 3 == 1 ? 64 : 1 << 20));
  try {
    const IndexView v = parse_index(data, size, "fuzz", bin_bytes);
    const int64_t item = dtype_size(v.dtype);
    int64_t end = 0;
    for (int64_t i = 0; i < v.sequence_count; ++i) {
      const int64_t p = v.sequence_pointer(i), n = v.sequence_length(i);
      if (n < 0 || p < end) std::abort();
      end = p + n * item;
      if (bin_bytes >= 0 && end > bin_bytes) std::abort();
    }
    if (v.document_index(0) != 0 || v.document_index(v.document_count - 1) != v.sequence_count) {
      std::abort();
    }
    for (int64_t d = 1; d < v.document_count; ++d) {
      if (v.document_index(d) < v.document_index(d - 1)) std::abort();
    }
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
