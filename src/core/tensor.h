// A non-owning tensor view: pointer, shape (row-major, contiguous), dtype, device. Memory is
// owned by the Arena; ops take raw pointers plus sizes, views carry them between components.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace moecore {

enum class Device : uint8_t { CPU, CUDA };

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  std::array<int64_t, kMaxDims> shape{};
  int ndim = 0;
  DType dtype = DType::F32;
  Device device = Device::CPU;

  Tensor() = default;
  Tensor(void* p, std::initializer_list<int64_t> dims, DType t, Device d = Device::CPU)
      : data(p), dtype(t), device(d) {
    MOE_CHECK(dims.size() <= kMaxDims, "[tensor] {} dims > {}", dims.size(), kMaxDims);
    for (int64_t s : dims) {
      MOE_CHECK(s >= 0, "[tensor] negative dimension {}", s);
      shape[ndim++] = s;
    }
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }

  template <typename T>
  T* as() const {
    MOE_CHECK(DTypeOf<T>::value == dtype, "[tensor] view of dtype {} read as {}",
              dtype_name(dtype), dtype_name(DTypeOf<T>::value));
    return static_cast<T*>(data);
  }

  std::string shape_str() const;
};

}  // namespace moecore
