// Zeroing: one memset (n may be 0, p then may be null).
#include "ops/fill.h"

#include <cstring>

namespace moecore::ops::cpu {

void zero_bytes(void* p, size_t bytes) {
  if (bytes > 0) std::memset(p, 0, bytes);
}

}  // namespace moecore::ops::cpu
