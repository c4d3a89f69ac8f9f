// What layer code may and may not do with a DevPtr (core/dev_ptr.h), compiled by
// check_dev_ptr_access.sh: without a CASE it must compile; with each CASE it must fail.
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/add.h"

using moecore::DevPtr;

void layer_code(DevPtr<float> y, DevPtr<const float> x, int64_t n) {
  // Allowed: offsets, null tests, comparisons, handing the buffers to ops.
  DevPtr<float> row = y + n;
  if (row && row != y) moecore::ops::add(moecore::cpu_exec(), y, y, x, n);
#if CASE == 1
  y[0] = 1.0f;  // element access
#elif CASE == 2
  float v = *x;  // dereference
  (void)v;
#elif CASE == 3
  float* p = y;  // a host pointer from a device address
  (void)p;
#elif CASE == 4
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];  // the host loop itself
#endif
}
