// Zeroing and copying: one memset / memcpy (n may be 0, the pointers then may be null).
#include "ops/memory.h"

#include <cstring>

namespace moecore::ops::cpu {

void zero_bytes(void* p, size_t bytes) {
  if (bytes > 0) std::memset(p, 0, bytes);
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace moecore::ops::cpu
