// libFuzzer target for the safetensors reader (src/ckpt/safetensors_file.cpp): any bytes, read
// from a file as a checkpoint shard is, either give a file whose tensors tile the data block
// exactly (each tensor's bytes inside the file, numel * dtype size of them, in offset order) or
// fail with moecore::Error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "ckpt/safetensors_file.h"
#include "core/check.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::ckpt;
  const std::string path = moecore::fuzz::write_file("shard.safetensors", data, size);
  try {
    const SafetensorsFile f(path);
    uint64_t header = 0;  // accepted: the file has its 8-byte header length
    for (int i = 0; i < 8; ++i) header |= static_cast<uint64_t>(data[i]) << (8 * i);
    uint64_t next = 0;  // where the next tensor must begin in the data block
    for (const std::string& name : f.names()) {
      const TensorInfo& t = f.info(name);
      const auto bytes = f.bytes(name);
      FUZZ_EXPECT(bytes.size() == t.nbytes);
      FUZZ_EXPECT(checked_nbytes(t.shape, dtype_size(t.dtype)) == t.nbytes);
      FUZZ_EXPECT(t.offset == next);
      next = t.offset + t.nbytes;
      // Touch every byte: ASan reports a span that leaves the file.
      unsigned sum = 0;
      for (std::byte b : bytes) sum += static_cast<unsigned>(b);
      (void)sum;
    }
    FUZZ_EXPECT(next == size - 8 - header);
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
