// Element-wise sum of two tensors (residual connections, the shared expert's output added to the
// routed one): y = a + b. y may alias a or b. Exact per element, so fast == reference bitwise.
#pragma once

#include <cstdint>

namespace moecore::ops {

template <typename T>
void add(T* y, const T* a, const T* b, int64_t n);
template <typename T>
void add_ref(T* y, const T* a, const T* b, int64_t n);

}  // namespace moecore::ops
