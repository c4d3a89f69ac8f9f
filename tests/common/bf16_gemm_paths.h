// The bf16 GEMM paths a test runs on: the widen path everywhere, the native one where oneDNN has
// a bf16 matmul (AVX512-BF16). The process's choice is restored after each run, also when a
// failed ASSERT returns or an exception unwinds through it.
#pragma once

#include <cstdio>
#include <functional>
#include <initializer_list>
#include <vector>

#include "ops/gemm_bf16.h"

namespace moecore::testing {

// Sets the process's bf16 GEMM path while alive; the path before comes back at the end.
class ScopedBf16GemmPath {
 public:
  explicit ScopedBf16GemmPath(ops::Bf16GemmPath path) : before_(ops::bf16_gemm_path()) {
    ops::set_bf16_gemm_path(path);
  }
  ~ScopedBf16GemmPath() { ops::set_bf16_gemm_path(before_); }
  ScopedBf16GemmPath(const ScopedBf16GemmPath&) = delete;
  ScopedBf16GemmPath& operator=(const ScopedBf16GemmPath&) = delete;

 private:
  ops::Bf16GemmPath before_;
};

// `order`'s paths that run on this CPU; a line says the native one was left out.
inline std::vector<ops::Bf16GemmPath> runnable_bf16_gemm_paths(
    std::initializer_list<ops::Bf16GemmPath> order = {ops::Bf16GemmPath::Native,
                                                      ops::Bf16GemmPath::Widen}) {
  std::vector<ops::Bf16GemmPath> paths;
  for (ops::Bf16GemmPath path : order) {
    if (path == ops::Bf16GemmPath::Native && !ops::bf16_native_available()) {
      std::printf("[ NOT RUN  ] native bf16 path: oneDNN runs below AVX-512 here\n");
      continue;
    }
    paths.push_back(path);
  }
  return paths;
}

// body(path) once per path of `order` that runs here, with that path set.
inline void for_each_bf16_gemm_path(
    const std::function<void(ops::Bf16GemmPath)>& body,
    std::initializer_list<ops::Bf16GemmPath> order = {ops::Bf16GemmPath::Native,
                                                      ops::Bf16GemmPath::Widen}) {
  for (ops::Bf16GemmPath path : runnable_bf16_gemm_paths(order)) {
    ScopedBf16GemmPath scope(path);
    body(path);
  }
}

}  // namespace moecore::testing
