// DevPtr<T>: the address of a buffer in the memory an execution context's ops run on (an
// arena's Device block: host memory on the CPU backend, GPU memory on CUDA). It offers what
// layer code needs to hand buffers to ops (offsets, null tests, comparison) and no element
// access: a host loop over a layer's buffer, `*p` or `p[i]`, does not compile. Ops take DevPtr
// arguments and unwrap them with raw_ptr() in their switch to call the backend; host code with
// host memory (tests, tools, the host's pinned staging) passes raw pointers, which convert.
//
// raw_ptr() is for the code that runs on the buffer's memory: the ops' switches, the
// communicators (MPI and NCCL take addresses), the host before step 0 (parameter init) and
// tests on the CPU backend. tests/check_layering.sh rejects it in the layers (moe/, model/,
// nn/ but the registry's init, optim/): they read device data only through ops::read_back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace moecore {

template <typename T>
class DevPtr;

// The read-only address: what a DevPtr<T> converts to (it derives from it, so an op template
// taking DevPtr<const T> deduces T from a DevPtr<T> argument).
template <typename T>
class DevPtr<const T> {
 public:
  using element_type = const T;
  constexpr DevPtr() = default;
  constexpr DevPtr(std::nullptr_t) {}
  constexpr DevPtr(const T* p) : p_(const_cast<T*>(p)) {}
  // From another element type the raw pointers convert to (a typed buffer to const void).
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U*, const T*> &&
                                                    !std::is_same_v<std::remove_const_t<U>, T>>>
  constexpr DevPtr(DevPtr<U> o) : p_(const_cast<T*>(static_cast<const T*>(raw_ptr(o)))) {}

  // p + i: the address i elements on (a row, a slot, a layer's slice of a stacked buffer).
  DevPtr operator+(int64_t i) const { return DevPtr(p_ + i); }
  explicit operator bool() const { return p_ != nullptr; }
  friend bool operator==(DevPtr a, DevPtr b) { return a.p_ == b.p_; }
  friend bool operator==(DevPtr a, std::nullptr_t) { return a.p_ == nullptr; }

  // No element access: the memory may not be the host's.
  template <typename I>
  void operator[](I) const = delete;
  void operator*() const = delete;
  void operator->() const = delete;

 protected:
  template <typename U>
  friend U* raw_ptr(DevPtr<U> p);

  T* p_ = nullptr;
};

template <typename T>
class DevPtr : public DevPtr<const T> {
 public:
  using element_type = T;
  constexpr DevPtr() = default;
  constexpr DevPtr(std::nullptr_t) {}
  constexpr DevPtr(T* p) : DevPtr<const T>(p) {}
  template <typename U,
            typename = std::enable_if_t<std::is_convertible_v<U*, T*> && !std::is_same_v<U, T>>>
  constexpr DevPtr(DevPtr<U> o) : DevPtr<const T>(static_cast<T*>(raw_ptr(o))) {}

  DevPtr operator+(int64_t i) const { return DevPtr(this->p_ + i); }
  friend bool operator==(DevPtr a, DevPtr b) { return a.p_ == b.p_; }
  friend bool operator==(DevPtr a, std::nullptr_t) { return a.p_ == nullptr; }
};

// The raw address (see the file comment for who may take it).
template <typename T>
T* raw_ptr(DevPtr<T> p) {
  return p.p_;
}

// The same address as another element type (untyped flat buffers to their dtype; bf16 as its
// bits), as reinterpret_cast does for raw pointers.
template <typename U, typename T>
DevPtr<U> dev_ptr_cast(DevPtr<T> p) {
  return DevPtr<U>(reinterpret_cast<U*>(raw_ptr(p)));
}

// The address of member m of the struct at p (a field of a report slot): address arithmetic,
// nothing is read.
template <typename S, typename M>
DevPtr<M> member_ptr(DevPtr<S> p, M S::*m) {
  return DevPtr<M>(&(raw_ptr(p)->*m));
}
template <typename S, typename M>
DevPtr<const M> member_ptr(DevPtr<const S> p, M S::*m) {
  return DevPtr<const M>(&(raw_ptr(p)->*m));
}

}  // namespace moecore
